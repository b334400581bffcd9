"""`python -m engine.bench --scenario serve-http`: the serving workload over HTTP vs LLM.generate.

The same seeded requests (token-id prompts, ignore_eos, lengths in [--min-len, --max-len]) are served
twice in one run:

1. in process, `LLM.generate(prompts, params)`: the engine's own throughput, the peer;
2. by `python -m engine.serve` in a child process (same model, same KV pool size and max_seqs), all
   requests sent at once by this process as streaming /v1/completions calls over loopback.

The record gives both output tokens/s, their ratio, and time to first token as the clients saw it
(request sent -> first streamed chunk), p50 and p99. The server (with its engine process) and the
load generators (--http-clients processes, the requests dealt among them) are separate processes, as
in production: the clients' JSON parsing competes neither with the server nor with the engine loop.
"""
from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time

import numpy as np

from engine.bench.workload import emit, serve_workload, warm_up_requests
from engine.formats.config import load_config

SERVER_START_TIMEOUT_S = 900    # loading a 1B model and compiling the kernels on first use


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> None:
    import httpx
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode} before it was ready")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server was not ready after {timeout:.0f} s")


async def stream_all(url: str, prompts, max_tokens, key: str | None = None,
                     refused: list | None = None) -> tuple[float, list[float], list[int]]:
    """Send every request at once; (wall seconds, time to first text per request, tokens per request).
    key: the API key to send; refused: a list that collects 429 answers (else they raise)."""
    import httpx
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    headers = {"authorization": f"Bearer {key}"} if key else {}
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=None, headers=headers) as client:
        async def one(prompt, n):
            body = {"model": "bench", "prompt": prompt, "max_tokens": n, "temperature": 0.0, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True}}
            sent, first, tokens = time.perf_counter(), None, 0
            async with client.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code == 429 and refused is not None:
                    refused.append(r.headers.get("retry-after"))
                    return None, 0
                if r.status_code != 200:
                    raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if first is None and chunk["choices"]:      # one chunk per sampled token
                        first = time.perf_counter() - sent
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
            return first, tokens

        t = time.perf_counter()
        results = await asyncio.gather(*(one(p, n) for p, n in zip(prompts, max_tokens, strict=True)))
        seconds = time.perf_counter() - t
    return seconds, [r[0] for r in results if r[0] is not None], [r[1] for r in results]


def client_share(url: str, prompts, max_tokens, start_at: float, key: str | None = None
                 ) -> tuple[float, float, list[float], list[int], int]:
    """One load-generator process: wait until the shared start time, send its share of the requests.
    (wall-clock start, end, time to first text per request, tokens per request, requests refused)."""
    time.sleep(max(0.0, start_at - time.time()))
    start = time.time()
    refused: list = []
    _, ttft, tokens = asyncio.run(stream_all(url, prompts, max_tokens, key, refused))
    return start, time.time(), ttft, tokens, len(refused)


def stream_from_processes(url: str, prompts, max_tokens, processes: int) -> tuple[float, list[float], list[int]]:
    """stream_all() split over several client processes that start together: one Python process
    parsing every server-sent event of a fast server would measure the client, not the server."""
    import multiprocessing
    shares = [(url, prompts[i::processes], max_tokens[i::processes]) for i in range(processes)]
    with multiprocessing.get_context("spawn").Pool(processes) as pool:
        start_at = time.time() + 3.0          # after every worker has started and imported httpx
        results = pool.starmap(client_share, [(*share, start_at) for share in shares])
    seconds = max(r[1] for r in results) - min(r[0] for r in results)
    return seconds, [t for r in results for t in r[2]], [n for r in results for n in r[3]]


def scenario_serve_http(args, setup, model_dir, backend) -> None:
    from engine.runtime.llm import LLM
    from engine.runtime.sampling_params import SamplingParams
    prompts, outs = serve_workload(args, load_config(model_dir).vocab_size)
    useful = sum(outs)
    max_context = args.max_len * 2 + 8
    base = {**setup, "scenario": "serve-http", "requests": args.requests,
            "len_range": [args.min_len, args.max_len], "output_tokens": useful}

    llm = LLM(model_dir, backend, kv_cache_mib=args.kv_cache_mib, max_context=max_context, max_seqs=args.max_seqs)
    # kernels, the memory pool and every graph bucket, untimed
    warm, warm_lengths = warm_up_requests(prompts, llm.max_seqs, llm.max_context, llm.max_batch_tokens)
    llm.generate(warm, [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in warm_lengths])
    backend.synchronize()
    t = time.perf_counter()
    results = llm.generate(prompts, [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in outs])
    backend.synchronize()
    generate_s = time.perf_counter() - t
    assert sum(len(r.token_ids) for r in results) == useful
    kv_mib, max_seqs = llm.cache.nbytes / 2**20, llm.max_seqs
    llm.close()
    del llm, results
    if backend.is_gpu:
        backend.xp.get_default_memory_pool().free_all_blocks()

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "engine.serve", "--model", str(model_dir), "--backend", backend.name,
           "--port", str(port), "--served-model-name", "bench", "--max-context", str(max_context),
           "--kv-cache-mib", f"{kv_mib:.3f}", "--max-seqs", str(max_seqs), "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    try:
        wait_healthy(url, proc, SERVER_START_TIMEOUT_S)
        asyncio.run(stream_all(url, warm, warm_lengths))                      # the same warm-up, in the server
        http_s, ttft, tokens = stream_from_processes(url, prompts, outs, args.http_clients)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    if sum(tokens) != useful:
        raise RuntimeError(f"the server generated {sum(tokens)} tokens, expected {useful}")
    generate_tps, http_tps = useful / generate_s, useful / http_s
    emit({**base, "mode": "continuous+paged", "kv_cache_mib": round(kv_mib, 1), "max_seqs": max_seqs,
          "server": "engine process", "client_processes": args.http_clients,
          "generate_seconds": round(generate_s, 2), "generate_tok_per_s": round(generate_tps, 1),
          "http_seconds": round(http_s, 2), "http_tok_per_s": round(http_tps, 1),
          "http_vs_generate": round(http_tps / generate_tps, 3),
          "ttft_p50_ms": round(1e3 * float(np.quantile(ttft, 0.5)), 1),
          "ttft_p99_ms": round(1e3 * float(np.quantile(ttft, 0.99)), 1),
          "ttft_max_ms": round(1e3 * max(ttft), 1)})
