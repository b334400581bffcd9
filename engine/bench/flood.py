"""`python -m engine.bench --scenario fair-flood`: does one client flooding the server hurt the room?

One server (`python -m engine.serve` in a child process, API keys on: a client is its key), two runs:

1. the room alone: --requests streaming requests (lengths uniform in [--min-len, --max-len]) from
   --room-clients keys, one load-generator process per key, all sent at once;
2. the same room, sent --flood-lead seconds after one more key has sent --flood-requests requests
   at once (the flood holds every seat it could get by the time the room arrives).

The record gives the room's time to first token (request sent -> first streamed chunk) p50 and p99 in
both runs and their ratio, the flood's accepted and refused (429) requests, and the server's limits.
What keeps the ratio low is the scheduler's fair seats (engine/runtime/scheduler.py): each request
names its client, and the flood's newest requests are preempted until every client holds its share.
"""
from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import time

import numpy as np

from engine.bench.http import SERVER_START_TIMEOUT_S, client_share, free_port, wait_healthy
from engine.bench.workload import emit, serve_workload
from engine.formats.config import load_config


def keys(n: int) -> list[str]:
    return [f"bench-key-{i:04d}" for i in range(n)]


def run_clients(url: str, shares: list[tuple[list, list, str]], delays: list[float]) -> list[tuple]:
    """One process per (prompts, lengths, key) share, each starting `delay` seconds after a common
    start; client_share()'s results, in order."""
    with multiprocessing.get_context("spawn").Pool(len(shares)) as pool:
        start_at = time.time() + 3.0          # after every worker has started and imported httpx
        return pool.starmap(client_share, [(url, prompts, outs, start_at + delay, key)
                                           for (prompts, outs, key), delay in zip(shares, delays, strict=True)])


def quantile_ms(values, q: float) -> float:
    return round(1e3 * float(np.quantile(values, q)), 1)


def scenario_fair_flood(args, setup, model_dir, backend) -> None:
    vocab = load_config(model_dir).vocab_size
    prompts, outs = serve_workload(args, vocab)
    flood_args = type(args)(**{**vars(args), "requests": args.flood_requests, "seed": args.seed + 1})
    flood_prompts, flood_outs = serve_workload(flood_args, vocab)
    room_keys, flood_key = keys(args.room_clients), "bench-key-flood"
    room = [(prompts[i::args.room_clients], outs[i::args.room_clients], key) for i, key in enumerate(room_keys)]
    max_context = args.max_len * 2 + 8

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "engine.serve", "--model", str(model_dir), "--backend", backend.name,
           "--port", str(port), "--served-model-name", "bench", "--max-context", str(max_context),
           "--log-level", "warning"]
    if args.max_seqs is not None:
        cmd += ["--max-seqs", str(args.max_seqs)]
    if args.kv_cache_mib is not None:
        cmd += ["--kv-cache-mib", str(args.kv_cache_mib)]
    env = {**os.environ, "ENGINE_API_KEYS": ",".join(room_keys + [flood_key])}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, env=env)
    try:
        wait_healthy(url, proc, SERVER_START_TIMEOUT_S)
        # warm-up (kernels, graphs, the memory pool): the room once, untimed
        run_clients(url, room, [0.0] * len(room))
        alone = run_clients(url, room, [0.0] * len(room))
        flooded = run_clients(url, [(flood_prompts, flood_outs, flood_key)] + room,
                              [0.0] + [args.flood_lead] * len(room))
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    ttft_alone = [t for r in alone for t in r[2]]
    ttft_flooded = [t for r in flooded[1:] for t in r[2]]
    room_tokens = sum(n for r in flooded[1:] for n in r[3])
    if room_tokens != sum(outs) or sum(n for r in alone for n in r[3]) != sum(outs):
        raise RuntimeError("the room's requests did not all complete in full")
    flood = flooded[0]
    p99_alone, p99_flooded = quantile_ms(ttft_alone, 0.99), quantile_ms(ttft_flooded, 0.99)
    emit({**setup, "scenario": "fair-flood", "room_requests": args.requests, "room_clients": args.room_clients,
          "len_range": [args.min_len, args.max_len], "max_seqs": args.max_seqs,
          "flood_requests": args.flood_requests, "flood_lead_s": args.flood_lead,
          "flood_accepted": len(flood[2]), "flood_refused": flood[4],
          "room_ttft_p50_ms_alone": quantile_ms(ttft_alone, 0.5), "room_ttft_p99_ms_alone": p99_alone,
          "room_ttft_p50_ms_flooded": quantile_ms(ttft_flooded, 0.5), "room_ttft_p99_ms_flooded": p99_flooded,
          "room_p99_flooded_vs_alone": round(p99_flooded / p99_alone, 3),
          "room_seconds_alone": round(max(r[1] for r in alone) - min(r[0] for r in alone), 2),
          "room_seconds_flooded": round(max(r[1] for r in flooded[1:]) - min(r[0] for r in flooded[1:]), 2)})
