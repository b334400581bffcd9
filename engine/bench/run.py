"""`python -m engine.bench`: measured performance, one JSON line per measurement (chapter 12).

Every line carries its setup (model shape, backend, device, batch, prompt/output lengths) and its
figures, next to a peer measured in the same run (transformers, with --hf) or the device's measured
ceiling (copy bandwidth). Scenarios:

  parity   logits of this backend vs the NumPy backend (and transformers) on the same weights
  prefill  one prompt of --prompt-len tokens: time and tokens/s
  decode   batch 1: --prompt-len prompt, --new-tokens generated; decode tok/s, achieved bandwidth
  serve    --requests requests with prompt and output lengths uniform in [--min-len, --max-len]
           (seeded, ignore_eos): output tok/s for each batching x cache mode, concurrency
  serve-oversubscribed  --oversub-requests (1,024) requests for --oversub-max-seqs (128) seats, lengths
           uniform in [--min-len, --max-len]: static vs continuous batching (paged and contiguous)
           in the same run; requests wait for seats, so continuous batching shows what it is for
  serve-http  the same workload sent at once over HTTP to `python -m engine.serve` (streaming, one
           client process), against LLM.generate in the same run: throughput ratio, time to first
           token p50/p99 (engine/bench/http.py)
  long-prefill   one prompt of each of --lengths tokens: one forward pass (last logits only) and
           the serving path (LLM, chunked prefill into the paged cache, time to the first token)
  chunked-itl    --itl-requests requests are decoding when a --long-prompt-token prompt arrives:
           p50/p99 inter-token latency of the running requests with and without chunked prefill
  shared-prefix  --requests requests sharing a --system-len-token system prompt, with and without
           prefix caching: output tok/s, prompt tokens computed, time to first token (engine/bench/prefix.py)
  chat-turns     a --turns-turn conversation with and without prefix caching: time to first token per turn
  spec-decode    batch 1, greedy, a prompt whose answer quotes it and a random one: plain decoding and
           n-gram speculation with each of --spec-k guesses, in the same run (engine/bench/speculative.py)
  quantized      batch-1 decode and a --prefill-len prefill with the checkpoint's weights and each of
           --quantization (int8, int4, quantized on load), in the same run (engine/bench/quantized.py)
  structured     --requests chat requests for a JSON record, free and constrained to a JSON schema, in the
           same run: output tok/s, answers that parse and conform, mask time (engine/bench/structured.py)
  fair-flood     --requests streaming requests from --room-clients API keys, alone and again just after
           one more key sent --flood-requests at once: the room's time to first token p50/p99 in both
           runs (engine/bench/flood.py)

    python -m engine.bench --preset llama-3.2-1b --backend cupy --scenario prefill decode --hf
    python -m engine.bench --backend numpy --scenario decode --prompt-len 128 --new-tokens 128 --hf
    python -m engine.bench --preset llama-3.2-1b --backend cupy --scenario long-prefill chunked-itl --hf
    python -m engine.bench --preset llama-3.2-1b --backend cupy --scenario shared-prefix chat-turns

    python -m engine.bench --preset llama-3.2-1b --backend cupy --profile     # per-kernel times of a step

--profile (with or without scenarios) prints the per-kernel GPU times of one decode step at each
of --profile-batches rows x --profile-context tokens (engine/bench/step_profile.py): a table on stderr,
JSON lines on stdout, and with --profile-json PATH all of it in one JSON file.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from engine.backend import BACKENDS, copy_bandwidth, gemm_tflops, resolve_backend
from engine.bench import prefix
from engine.bench.workload import emit, forward_seconds, llm_decode_tok_per_s, random_prompt, serve_workload, warm_up_requests
from engine.formats.config import HybridConfig, load_config

SCENARIOS = ("parity", "prefill", "decode", "serve", "serve-oversubscribed", "serve-http", "long-prefill",
             "chunked-itl", "shared-prefix", "chat-turns", "fair-flood", "spec-decode", "structured", "quantized")


def device_name(backend) -> str:
    if backend.is_gpu:
        from engine.backend import gpu_name
        return gpu_name()
    return f"CPU ({platform.processor() or platform.machine()})"


class HFPeer:
    """transformers on the same directory: bf16 on the GPU, fp32 on the CPU."""

    def __init__(self, model_dir: Path, gpu: bool):
        import torch
        import transformers
        self.torch = torch
        self.device = "cuda" if gpu else "cpu"
        dtype = torch.bfloat16 if gpu else torch.float32
        self.model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(self.device).eval()
        self.version = transformers.__version__

    def sync(self):
        if self.device == "cuda":
            self.torch.cuda.synchronize()

    def logits(self, ids) -> np.ndarray:
        with self.torch.no_grad():
            out = self.model(self.torch.tensor([ids], device=self.device)).logits[0]
        return out.float().cpu().numpy()

    def prefill_seconds(self, ids, last_only: bool) -> float:
        x = self.torch.tensor([ids], device=self.device)
        kw = {"logits_to_keep": 1} if last_only else {}
        with self.torch.no_grad():
            for _ in range(2):
                self.model(x, **kw)
            self.sync()
            t = time.perf_counter()
            for _ in range(5):
                self.model(x, **kw)
            self.sync()
        return (time.perf_counter() - t) / 5

    def generate_seconds(self, batch_ids: list[list[int]], new_tokens: int, static_cache=False) -> float:
        torch = self.torch
        width = max(len(p) for p in batch_ids)
        pad = 0
        x = torch.tensor([[pad] * (width - len(p)) + p for p in batch_ids], device=self.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch_ids], device=self.device)
        kw: dict[str, Any] = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad)
        if static_cache:
            kw["cache_implementation"] = "static"
        with torch.no_grad():
            self.model.generate(x[:, :8], attention_mask=mask[:, :8], **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})
            self.sync()
            t = time.perf_counter()
            self.model.generate(x, attention_mask=mask, **kw)
            self.sync()
        return time.perf_counter() - t


# ---------------------------------------------------------------------------------------------
def _rel(a: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(a - ref) / np.linalg.norm(ref))


def scenario_parity(args, setup, model, model_dir, hf):
    from engine.model.forward_pass import load_model
    rng = np.random.default_rng(0)
    ids = random_prompt(rng, args.parity_len, model.config.vocab_size)
    ours = model.logits(ids)
    rec = {**setup, "scenario": "parity", "tokens": len(ids)}
    fp32 = None
    if model.backend.is_gpu:         # the NumPy fp32 model on the same weights, loaded once
        fp32 = load_model(model_dir, "numpy", model.max_context).logits(ids)
        rec["rel_err_vs_numpy"] = _rel(ours, fp32)
        rec["argmax_agree_vs_numpy"] = float(np.mean(ours.argmax(-1) == fp32.argmax(-1)))
    if hf is not None:
        ref = hf.logits(ids)
        rec["rel_err_vs_hf"] = _rel(ours, ref)
        rec["argmax_agree_vs_hf"] = float(np.mean(ours.argmax(-1) == ref.argmax(-1)))
        if fp32 is not None:
            rec["hf_bf16_rel_err_vs_numpy_fp32"] = _rel(ref, fp32)
    emit(rec)


def scenario_prefill(args, setup, model, hf):
    from engine.model.forward_pass import ForwardBatch
    rng = np.random.default_rng(1)
    ids = random_prompt(rng, args.prompt_len, model.config.vocab_size)
    for last_only in (True, False):
        batch = ForwardBatch.single(ids, logits_rows=[len(ids) - 1] if last_only else None)
        sec = forward_seconds(model, batch)
        rec = {**setup, "scenario": "prefill", "prompt_len": len(ids), "logits": "last" if last_only else "all",
               "ms": round(sec * 1e3, 2), "tok_per_s": round(len(ids) / sec, 1)}
        if hf is not None:
            hs = hf.prefill_seconds(ids, last_only)
            rec.update(hf_ms=round(hs * 1e3, 2), ratio_vs_hf=round(sec / hs, 3))
        emit(rec)


def engine_decode_tok_per_s(model_dir, backend, ids, new_tokens: int, max_context: int) -> tuple[float, bool]:
    """llm_decode_tok_per_s of a one-seat LLM of the model: (tok/s, whether async scheduling ran)."""
    from engine.runtime.llm import LLM
    llm = LLM(model_dir, backend, max_context=max_context, max_seqs=1)
    tok_per_s, overlapped = llm_decode_tok_per_s(llm, ids, new_tokens), llm.async_scheduling
    llm.close()
    return tok_per_s, overlapped


def chat_session_decode(model, ids, new_tokens: int) -> tuple[float, float, int]:
    """Batch-1 decode through chapter 08's ChatSession: (prefill seconds, decode seconds, decode steps)."""
    from engine.runtime.chat_session import ChatSession
    from engine.runtime.sampling_params import SamplingParams
    session = ChatSession(model)
    list(session.stream(ids, SamplingParams(max_new_tokens=4, ignore_eos=True)))     # warm-up
    session.reset()
    stamps = []
    t0 = time.perf_counter()
    for _ in session.stream(ids, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)):
        stamps.append(time.perf_counter())
    return stamps[0] - t0, stamps[-1] - stamps[0], len(stamps) - 1


def scenario_decode(args, setup, model, hf, ceiling_gbps, model_dir=None):
    rng = np.random.default_rng(2)
    ids = random_prompt(rng, args.prompt_len, model.config.vocab_size)
    cfg = model.config
    rec = {**setup, "scenario": "decode", "batch": 1, "prompt_len": len(ids), "new_tokens": args.new_tokens}
    if isinstance(cfg, HybridConfig):     # ChatSession keeps K/V only, no recurrent state: LLM alone
        decode_s = 1 / engine_decode_tok_per_s(model_dir, model.backend, ids, args.new_tokens, model.max_context)[0]
        n_decode = 1
    else:
        prefill_s, decode_s, n_decode = chat_session_decode(model, ids, args.new_tokens)
        rec["prefill_ms"] = round(prefill_s * 1e3, 2)
    bytes_per_value = 2 if model.backend.is_gpu else 4
    weight_bytes = cfg.num_parameters(active=True) * bytes_per_value   # a mixture of experts: k of E per layer
    avg_ctx = args.prompt_len + args.new_tokens / 2
    # + a hybrid model's recurrent states, read and written once per step
    kv_bytes = avg_ctx * cfg.kv_bytes_per_token(bytes_per_value) + 2 * cfg.state_bytes_per_sequence
    step = decode_s / max(n_decode, 1)
    rec.update({"decode_tok_per_s": round(n_decode / decode_s, 1),
                "ms_per_token": round(step * 1e3, 3), "bytes_per_step_gb": round((weight_bytes + kv_bytes) / 1e9, 3),
                "achieved_gbps": round((weight_bytes + kv_bytes) / step / 1e9, 1),
                "ceiling_copy_gbps": round(ceiling_gbps, 1),
                "floor_tok_per_s": round(ceiling_gbps * 1e9 / (weight_bytes + kv_bytes), 1)})
    if model_dir is not None and not isinstance(cfg, HybridConfig):   # the same decode through LLM
        tok_per_s, overlapped = engine_decode_tok_per_s(model_dir, model.backend, ids, args.new_tokens,
                                                        model.max_context)
        rec["engine_decode_tok_per_s"] = round(tok_per_s, 1)
        rec["engine_async_scheduling"] = overlapped
    if hf is not None:
        for static in ([False, True] if model.backend.is_gpu else [False]):
            try:
                total = hf.generate_seconds([ids], args.new_tokens, static_cache=static)
                hf_pre = hf.prefill_seconds(ids, last_only=True)
                key = "hf_static_cache" if static else "hf"
                rec[f"{key}_decode_tok_per_s"] = round((args.new_tokens - 1) / max(total - hf_pre, 1e-9), 1)
            except Exception as exc:   # an optional peer: report, don't die
                rec[f"hf_error{'_static' if static else ''}"] = f"{type(exc).__name__}: {exc}"[:200]
        if "hf_decode_tok_per_s" in rec:
            rec["speedup_vs_hf"] = round(rec["decode_tok_per_s"] / rec["hf_decode_tok_per_s"], 2)
    emit(rec)


def step_floor_seconds(log, cfg, bytes_per_value: int, copy_gbps: float, tflops: float | None) -> float:
    """A lower bound on a served workload's time: each step of its log at the hardware's limit.

    A step reads every weight it multiplies by once (not an untied model's embedding table, of
    which it gathers a few rows) and every row's context from the KV cache (bytes at copy bandwidth),
    and multiplies its tokens by the weights: 2 FLOPs per weight per token for the layers, the LM
    head only for the rows that sample (at the measured GEMM rate; attention FLOPs left out).
    Whichever takes longer. No host time, no launch gaps, no kernel below the roofline: the engine's
    time over this is what it leaves on the table. A hybrid model (Qwen3.5) also reads and writes each
    row's recurrent states once. A mixture of experts counts its active parameters
    (each token's k experts, which its FLOPs are exactly; a step with many tokens reads more experts
    than that, so for memory it is a lower bound)."""
    head = cfg.vocab_size * cfg.hidden_size                     # the LM head (the table itself when tied)
    layers = cfg.num_parameters(active=True) - head * (1 if cfg.tie_word_embeddings else 2)
    weights = (layers + head) * bytes_per_value
    per_token_kv = cfg.kv_bytes_per_token(bytes_per_value)
    per_row_state = 2 * cfg.state_bytes_per_sequence          # a hybrid model's states, read and written
    total = 0.0
    for entry in log:
        states = entry["rows"] * per_row_state if per_row_state else 0
        memory = (weights + entry["context_tokens"] * per_token_kv + states) / (copy_gbps * 1e9)
        flops = 2 * layers * entry["tokens"] + 2 * head * entry["sampled"]
        compute = flops / (tflops * 1e12) if tflops else 0.0
        total += max(memory, compute)
    return total


def scenario_serve(args, setup, model_dir, backend, hf, ceiling_gbps: float, oversubscribed: bool = False):
    from engine.runtime.llm import LLM
    from engine.runtime.sampling_params import SamplingParams
    if oversubscribed:
        args = argparse.Namespace(**{**vars(args), "requests": args.oversub_requests,
                                     "max_seqs": args.oversub_max_seqs})
    prompts, outs = serve_workload(args, load_config(model_dir).vocab_size)
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in outs]
    useful = sum(outs)
    base = {**setup, "scenario": "serve-oversubscribed" if oversubscribed else "serve", "requests": args.requests,
            "len_range": [args.min_len, args.max_len], "output_tokens": useful}
    modes = args.serve_modes
    tflops = gemm_tflops(backend) if backend.is_gpu else None
    if oversubscribed:
        modes = ["static+contiguous", "static+paged", "continuous+contiguous", "continuous+paged"]
        hf = None        # a padded batch of 1,024 rows is not a peer for a 128-seat server
    for mode in modes:
        # "+sync": the host schedules one step at a time; "+nocache": no prefix caching; "+int8" / "+int4":
        # the weights quantized on load (chapter 18; the floor below stays the bf16 weights'); "+sampled":
        # every request samples (temperature 0.8, top-k 50, top-p 0.95, seeded) instead of decoding greedily
        batching, kv, *flags = mode.split("+")
        mode_params = params if "sampled" not in flags else [
            SamplingParams(max_new_tokens=n, ignore_eos=True, temperature=0.8, top_k=50, top_p=0.95, seed=i)
            for i, n in enumerate(outs)]
        llm = LLM(model_dir, backend, batching=batching, kv_cache=kv, kv_cache_mib=args.kv_cache_mib,
                  max_context=args.max_len * 2 + 8, max_seqs=args.max_seqs, cuda_graphs=not args.no_graphs,
                  async_scheduling=False if "sync" in flags else None,
                  prefix_caching=False if "nocache" in flags else None,
                  speculative={"method": "ngram", "num_tokens": 4} if "spec" in flags else None,
                  quantization=next((f for f in flags if f in ("int8", "int4")), None), group_size=args.group_size)
        warm, warm_lengths = warm_up_requests(prompts, llm.max_seqs, llm.max_context, llm.max_batch_tokens)
        llm.generate(warm, [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in warm_lengths])
        if llm.prefix_caching:      # the warm-up's prompts are cut from the workload's: forget them
            llm.reset_prefix_cache()
        backend.synchronize()
        t = time.perf_counter()
        results = llm.generate(prompts, mode_params)
        backend.synchronize()
        sec = time.perf_counter() - t
        assert sum(len(r.token_ids) for r in results) == useful
        log = llm.last_step_log
        floor = step_floor_seconds(log, llm.config, 2 if backend.is_gpu else 4, ceiling_gbps, tflops)
        decode_rows = [s["rows"] for s in log if s["kind"] == "decode"]
        emit({**base, "mode": mode, "seconds": round(sec, 2), "output_tok_per_s": round(useful / sec, 1),
              "steps": len(log), "max_running": max(s["running"] for s in log),
              "mean_decode_rows": round(float(np.mean(decode_rows)), 1) if decode_rows else 0,
              "preemptions": sum(len(s["preempted"]) for s in log),
              "floor_seconds": round(floor, 2), "floor_tok_per_s": round(useful / floor, 1),
              "pct_of_floor": round(100 * floor / sec, 1), "gemm_tflops": tflops and round(tflops, 1),
              "kv_cache_mib": round(llm.cache.nbytes / 2**20, 1), "max_seqs": llm.max_seqs,
              "cuda_graphs": llm.decode_graphs.enabled, "graph_replays": llm.decode_graphs.replays,
              "async_scheduling": llm.async_scheduling, "prefix_caching": llm.prefix_caching,
              "prefix_hit_tokens": sum(s["reused_tokens"] for s in log),
              "discarded_rows": sum(len(s.get("discarded", ())) for s in log),
              "spec_draft_tokens": sum(s.get("draft_tokens", 0) for s in log),
              "spec_accepted_tokens": sum(s.get("accepted_tokens", 0) for s in log)})
        del llm
        if backend.is_gpu:
            backend.xp.get_default_memory_pool().free_all_blocks()
    if hf is not None:
        try:
            sec = hf.generate_seconds(prompts, max(outs))
            emit({**base, "mode": "transformers generate (padded batch)", "seconds": round(sec, 2),
                  "output_tok_per_s": round(useful / sec, 1), "max_running": args.requests,
                  "note": "one padded batch; every row generates max(output lengths) tokens, only the requested ones count"})
        except Exception as exc:
            emit({**base, "mode": "transformers", "error": f"{type(exc).__name__}: {exc}"[:300]})


def run_profile(args, setup, model, ceiling_gbps) -> None:
    from engine.bench.step_profile import format_table, profile_decode, profile_records
    everything: dict[str, Any] = {"setup": {**setup, "copy_gbps": round(ceiling_gbps, 1)}, "steps": []}
    for rows in args.profile_batches:
        result = profile_decode(model, rows, args.profile_context)
        records = profile_records(result, ceiling_gbps)
        print(format_table(records, rows, args.profile_context), file=sys.stderr, flush=True)
        for rec in records:
            emit({**setup, "scenario": "profile", "batch": rows, "context": args.profile_context, **rec})
        everything["steps"].append({"batch": rows, "context": args.profile_context, "records": records,
                                    "timeline": result["timeline"]})
    if args.profile_json:
        Path(args.profile_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.profile_json).write_text(json.dumps(everything, indent=1) + "\n")


def _timed_forward(model, ids, reps: int) -> float:
    """Seconds of one whole-prompt forward pass with the last position's logits only."""
    from engine.model.forward_pass import ForwardBatch
    batch = ForwardBatch.single(ids, logits_rows=[len(ids) - 1])
    model.forward(batch)                                   # warm-up: kernels compile, pools grow
    model.backend.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        model.forward(batch)
    model.backend.synchronize()
    return (time.perf_counter() - t) / reps


def scenario_long_prefill(args, setup, model_dir, backend, hf):
    """Prefill time vs length: the model's forward pass, the serving path, and transformers."""
    from engine.runtime.llm import LLM
    from engine.runtime.sampling_params import SamplingParams
    cfg = load_config(model_dir)
    rng = np.random.default_rng(2)
    longest = max(args.lengths)
    llm = LLM(model_dir, backend, max_context=args.max_context or min(cfg.max_position_embeddings,
                                                                      longest + args.long_new_tokens + 8),
              max_seqs=1, max_batch_tokens=args.max_batch_tokens, kv_cache_mib=args.kv_cache_mib)
    for n in args.lengths:
        ids = random_prompt(rng, n, cfg.vocab_size)
        rec = {**setup, "scenario": "long-prefill", "prompt_len": n, "max_batch_tokens": llm.max_batch_tokens}
        try:
            sec = _timed_forward(llm.model, ids, reps=3 if n <= 8192 else 1)
            rec.update(forward_ms=round(sec * 1e3, 1), forward_tok_per_s=round(n / sec, 1))
            # the serving path: chunked prefill into the paged cache, then a few decode steps (a prompt
            # as long as the whole context leaves no room for them: it is cut to fit)
            served = ids[:llm.max_context - args.long_new_tokens]
            rec["llm_prompt_len"] = len(served)
            llm.generate([served], SamplingParams(max_new_tokens=args.long_new_tokens, ignore_eos=True))
            seconds = [entry["seconds"] for entry in llm.last_step_log]
            first = next(i for i, entry in enumerate(llm.last_step_log) if entry["sampled"])
            ttft = sum(seconds[:first + 1])
            rec.update(llm_ttft_ms=round(ttft * 1e3, 1), llm_prefill_tok_per_s=round(len(served) / ttft, 1),
                       llm_prefill_steps=first + 1)
            if len(seconds) > first + 1:
                rec["llm_decode_ms_per_token"] = round(float(np.mean(seconds[first + 1:])) * 1e3, 2)
        except Exception as exc:                       # e.g. out of memory: report it, go on
            rec["error"] = f"{type(exc).__name__}: {exc}"[:300]
        if hf is not None:
            try:
                hs = hf.prefill_seconds(ids, last_only=True)
                rec.update(hf_ms=round(hs * 1e3, 1), hf_tok_per_s=round(n / hs, 1))
                if "forward_ms" in rec:
                    rec["ratio_vs_hf"] = round(rec["forward_ms"] / rec["hf_ms"], 3)
            except Exception as exc:
                rec["hf_error"] = f"{type(exc).__name__}: {exc}"[:300]
                hf.torch.cuda.empty_cache() if hf.device == "cuda" else None
        emit(rec)
        if backend.is_gpu:
            backend.xp.get_default_memory_pool().free_all_blocks()
    llm.close()


def inter_token_latencies(token_times: dict[int, list[float]], start: float, end: float) -> list[float]:
    """Gaps between consecutive tokens of each request, for the tokens produced in (start, end]."""
    gaps = []
    for times in token_times.values():
        gaps += [b - a for a, b in zip(times[:-1], times[1:], strict=True) if start < b <= end]
    return gaps


def run_itl(llm, running, long_prompt, decode_params, long_params, settle_steps: int = 4) -> dict:
    """Start `running` decoding, let them settle, submit the long prompt, step until its first token
    and settle_steps more; the running requests' inter-token gaps before the arrival and from the
    arrival to the end (the stall of an unchunked prefill shows in the tail, p99 and max)."""
    sched = llm.new_scheduler()
    ids = [sched.submit(p, decode_params) for p in running]
    seeds = dict.fromkeys(ids, 0)
    token_times: dict[int, list[float]] = {rid: [] for rid in ids}

    def step():
        llm.step(sched, seeds)
        llm.backend.synchronize()
        now = time.perf_counter()
        entry = sched.step_log[-1]
        for rid in entry["request_ids"]:
            if rid in token_times and rid not in entry["prefill_ids"]:
                token_times[rid].append(now)
        return entry

    while any(not times for times in token_times.values()):     # every running request has a token
        step()
    for _ in range(settle_steps):
        step()
    arrival = time.perf_counter()
    long_id = sched.submit(long_prompt, long_params)
    seeds[long_id] = 0
    steps = 0
    while True:
        entry = step()
        steps += 1
        if long_id in entry["request_ids"] and long_id not in {c[0] for c in entry["chunks"] if not c[3]}:
            break
    first_token = time.perf_counter()
    for _ in range(settle_steps):
        step()
    end = time.perf_counter()
    for rid in list(sched.snapshot()["waiting"]) + list(sched.snapshot()["running"]):
        sched.cancel(rid)
    before = inter_token_latencies(token_times, 0.0, arrival)
    during = inter_token_latencies(token_times, arrival, end)
    pct = lambda xs, q: round(float(np.percentile(xs, q)) * 1e3, 2) if xs else None   # noqa: E731
    return {"ttft_long_ms": round((first_token - arrival) * 1e3, 1), "steps_to_first_token": steps,
            "itl_before_p50_ms": pct(before, 50), "itl_p50_ms": pct(during, 50), "itl_p99_ms": pct(during, 99),
            "itl_max_ms": pct(during, 100)}


def scenario_chunked_itl(args, setup, model_dir, backend):
    """Running requests' inter-token latency while a long prompt is prefilled, chunked or not."""
    from engine.runtime.llm import LLM
    from engine.runtime.sampling_params import SamplingParams
    cfg = load_config(model_dir)
    rng = np.random.default_rng(3)
    running = [random_prompt(rng, args.itl_prompt_len, cfg.vocab_size) for _ in range(args.itl_requests)]
    long_prompt = random_prompt(rng, args.long_prompt, cfg.vocab_size)
    decode_params = SamplingParams(max_new_tokens=args.max_context or cfg.max_position_embeddings, ignore_eos=True)
    for chunked in (True, False):
        llm = LLM(model_dir, backend, max_context=args.long_prompt + args.itl_prompt_len + 64,
                  max_seqs=args.itl_requests + 1, max_batch_tokens=args.max_batch_tokens,
                  kv_cache_mib=args.kv_cache_mib, chunked_prefill=chunked)
        room = llm.max_context - args.itl_prompt_len - 1
        params = SamplingParams(max_new_tokens=min(decode_params.max_new_tokens, room), ignore_eos=True)
        run_itl(llm, running[:2], long_prompt[:64], params, SamplingParams(max_new_tokens=2))   # warm-up
        rec = run_itl(llm, running, long_prompt, params, SamplingParams(max_new_tokens=2))
        emit({**setup, "scenario": "chunked-itl", "chunked_prefill": chunked, "running": args.itl_requests,
              "running_prompt_len": args.itl_prompt_len, "long_prompt": args.long_prompt,
              "max_batch_tokens": llm.max_batch_tokens, **rec})
        llm.close()
        del llm
        if backend.is_gpu:
            backend.xp.get_default_memory_pool().free_all_blocks()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine.bench", description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--model", default=None, help="model directory (default: the embedded default model)")
    src.add_argument("--preset", default=None, help="random weights of a preset shape (e.g. llama-3.2-1b)")
    ap.add_argument("--backend", default="auto", choices=BACKENDS)
    ap.add_argument("--scenario", nargs="+", default=["decode"], choices=SCENARIOS)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--parity-len", type=int, default=64)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--min-len", type=int, default=100)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-seqs", type=int, default=None)
    ap.add_argument("--kv-cache-mib", type=float, default=None, help="KV pool size for serve")
    ap.add_argument("--serve-modes", nargs="+", default=["continuous+paged", "continuous+paged+nocache",
                                                          "continuous+paged+sync", "continuous+contiguous",
                                                          "static+contiguous"],
                    help="batching+cache[+sync][+nocache][+spec][+int8|+int4][+sampled]; +sync: no async scheduling (the host "
                         "schedules between steps); +nocache: no prefix caching; +spec: n-gram speculation (k=4); "
                         "+int8 / +int4: weights quantized on load (--group-size); +sampled: temperature 0.8, top-k 50, "
                         "top-p 0.95")
    ap.add_argument("--max-context", type=int, default=None)
    ap.add_argument("--hf", action="store_true", help="measure transformers on the same weights in the same run")
    ap.add_argument("--oversub-requests", type=int, default=1024, help="requests of serve-oversubscribed")
    ap.add_argument("--oversub-max-seqs", type=int, default=128, help="seats (max running) of serve-oversubscribed")
    ap.add_argument("--no-graphs", action="store_true", help="serve with eager decode steps (no CUDA graphs)")
    ap.add_argument("--profile", action="store_true", help="per-kernel times of one decode step")
    ap.add_argument("--profile-batches", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--profile-context", type=int, default=1024, help="tokens each profiled row attends to")
    ap.add_argument("--profile-json", default=None, help="also write the profile records to this JSON file")
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 32768, 131072],
                    help="long-prefill: prompt lengths")
    ap.add_argument("--long-new-tokens", type=int, default=16, help="long-prefill: tokens decoded after the prompt")
    ap.add_argument("--max-batch-tokens", type=int, default=None, help="the step's token budget (chunk size)")
    ap.add_argument("--itl-requests", type=int, default=64, help="chunked-itl: requests decoding")
    ap.add_argument("--itl-prompt-len", type=int, default=256, help="chunked-itl: their prompt length")
    ap.add_argument("--long-prompt", type=int, default=32768, help="chunked-itl: the prompt that arrives")
    ap.add_argument("--http-clients", type=int, default=4, help="serve-http: load-generator processes")
    ap.add_argument("--spec-k", type=int, nargs="+", default=[2, 4, 8], help="spec-decode: guesses per verify row")
    ap.add_argument("--quantization", nargs="+", default=["int8", "int4"], choices=["int8", "int4"],
                    help="quantized: the quantizations compared with the checkpoint's weights")
    ap.add_argument("--group-size", type=int, default=None,
                    help="quantized: inputs per scale and zero point (default: 128, or the largest group below it "
                         "that the model's sizes take)")
    ap.add_argument("--prefill-len", type=int, default=2048, help="quantized: the prompt of the timed prefill")
    ap.add_argument("--spec-draft", metavar="DIR", help="spec-decode: also a draft model's guesses (same tokenizer)")
    ap.add_argument("--room-clients", type=int, default=8, help="fair-flood: API keys the room's requests use")
    ap.add_argument("--flood-requests", type=int, default=1000, help="fair-flood: requests the flooding key sends")
    ap.add_argument("--flood-lead", type=float, default=1.0,
                    help="fair-flood: seconds the flood starts before the room")
    prefix.add_arguments(ap)
    args = ap.parse_args(argv)
    if args.hf and not all(importlib.util.find_spec(m) for m in ("torch", "transformers")):
        print("error: --hf measures transformers in the same run, which needs torch and transformers: "
              "pip install -e '.[oracle]'", file=sys.stderr)
        return 2

    from engine.model.forward_pass import load_model
    backend = resolve_backend(args.backend)
    if args.preset:
        from engine.model.random_model import write_random_model
        model_dir = write_random_model(Path(tempfile.mkdtemp(prefix="bench-")) / args.preset, args.preset)
    elif args.model:
        model_dir = Path(args.model)
    else:
        from engine.model.default_model import ensure_default_model
        model_dir = ensure_default_model()
    cfg = load_config(model_dir)
    setup = {"model": args.preset or Path(model_dir).name, "params_m": round(cfg.num_parameters() / 1e6, 1),
             "layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size, "heads": cfg.num_attention_heads,
             "kv_heads": cfg.num_key_value_heads, "backend": backend.name, "device": device_name(backend)}
    if cfg.moe is not None:
        setup.update(active_params_m=round(cfg.num_parameters(active=True) / 1e6, 1), experts=cfg.moe.num_experts,
                     experts_per_token=cfg.moe.experts_per_token)
    ceiling = copy_bandwidth(backend)
    emit({**setup, "scenario": "setup", "copy_gbps": round(ceiling, 1), "python": platform.python_version(),
          "numpy": np.__version__})
    hf = HFPeer(model_dir, backend.is_gpu) if args.hf else None
    if hf is not None:
        setup["hf_version"] = hf.version
    needs_model = set(args.scenario) & {"parity", "prefill", "decode"} or args.profile
    model = None
    if needs_model:
        t = time.perf_counter()
        wanted = max(4096, args.prompt_len + args.new_tokens + 8, args.profile_context + 1)
        model = load_model(model_dir, backend, args.max_context or min(wanted, cfg.max_position_embeddings))
        backend.synchronize()
        seconds = time.perf_counter() - t
        from engine.formats.safetensors import open_checkpoint
        with open_checkpoint(model_dir) as ckpt:
            stored = ckpt.nbytes
        emit({**setup, "scenario": "load", "seconds": round(seconds, 2), "checkpoint_gb": round(stored / 1e9, 3),
              "gb_per_s": round(stored / seconds / 1e9, 2)})
    if "parity" in args.scenario:
        scenario_parity(args, setup, model, model_dir, hf)
    if "prefill" in args.scenario:
        scenario_prefill(args, setup, model, hf)
    if "decode" in args.scenario:
        scenario_decode(args, setup, model, hf, ceiling, model_dir)
    if args.profile:
        run_profile(args, setup, model, ceiling)
    if {"serve", "serve-oversubscribed"} & set(args.scenario):
        model = None                                   # serving loads its own model: free this one
    if "serve" in args.scenario:
        scenario_serve(args, setup, model_dir, backend, hf, ceiling)
    if "serve-oversubscribed" in args.scenario:
        scenario_serve(args, setup, model_dir, backend, hf, ceiling, oversubscribed=True)
    if "serve-http" in args.scenario:
        from engine.bench.http import scenario_serve_http
        scenario_serve_http(args, setup, model_dir, backend)
    if "long-prefill" in args.scenario:
        model = None
        scenario_long_prefill(args, setup, model_dir, backend, hf)
    if "chunked-itl" in args.scenario:
        model = None
        scenario_chunked_itl(args, setup, model_dir, backend)
    if "shared-prefix" in args.scenario:
        model = None
        prefix.scenario_shared_prefix(args, setup, model_dir, backend, cfg.vocab_size)
    if "chat-turns" in args.scenario:
        model = None
        prefix.scenario_chat_turns(args, setup, model_dir, backend, cfg.vocab_size)
    if "spec-decode" in args.scenario:
        from engine.bench.speculative import scenario_spec_decode
        model = None
        scenario_spec_decode(args, setup, model_dir, backend)
    if "structured" in args.scenario:
        from engine.bench.structured import scenario_structured
        model = None
        scenario_structured(args, setup, model_dir, backend)
    if "quantized" in args.scenario:
        from engine.bench.quantized import scenario_quantized
        model = None
        scenario_quantized(args, setup, model_dir, backend, ceiling)
    if "fair-flood" in args.scenario:
        from engine.bench.flood import scenario_fair_flood
        model = None
        scenario_fair_flood(args, setup, model_dir, backend)
    return 0


if __name__ == "__main__":
    sys.exit(main())
