"""What the benchmarks share: one JSON line per measurement, the seeded serving workload, the
warm-up that runs before any timed run, and the timing of one forward pass and of batch-1 decode
(engine/bench/run.py, engine/bench/http.py, engine/bench/quantized.py)."""
from __future__ import annotations

import json
import time

import numpy as np


def emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


def random_prompt(rng, n: int, vocab: int) -> list[int]:
    return rng.integers(0, vocab, n).tolist()


# ---------------------------------------------------------------------------------------------


def serve_workload(args, vocab_size: int) -> tuple[list[list[int]], list[int]]:
    """--requests prompts (token ids) and output lengths, both uniform in [--min-len, --max-len], seeded."""
    rng = np.random.default_rng(args.seed)
    prompts = [random_prompt(rng, int(rng.integers(args.min_len, args.max_len + 1)), vocab_size)
               for _ in range(args.requests)]
    outs = [int(rng.integers(args.min_len, args.max_len + 1)) for _ in range(args.requests)]
    return prompts, outs


def warm_up_requests(prompts, max_seqs: int, max_context: int, max_batch_tokens: int
                     ) -> tuple[list[list[int]], list[int]]:
    """A short workload that compiles every kernel, grows the memory pool to the workload's largest
    step and captures every decode-graph bucket before the timed run: long prompts that fill more than
    one whole step's token budget (so that a chunk continues over the cache in a mixed step), then
    max_seqs - 3 requests of 16 prompt tokens whose outputs end a few at a time (2..81 tokens), and
    three stragglers, so the decode batch shrinks through every bucket down to one row."""
    long_len = max(1, min(max_context // 2, max(len(p) for p in prompts)))
    n_long = min(max_seqs, -(-max_batch_tokens * 5 // 4 // long_len))
    n = max(1, max_seqs - 3)
    lengths = [2] * n_long + [2 + i % 80 for i in range(n)] + [90, 95, 100][:max_seqs - n]
    long = [(prompts[i % len(prompts)] * (1 + long_len // len(prompts[i % len(prompts)])))[:long_len]
            for i in range(n_long)]
    return long + [prompts[i % len(prompts)][:16] for i in range(len(lengths) - n_long)], lengths


def forward_seconds(model, batch) -> float:
    """Seconds of one forward pass of `batch` (after two warm-up passes; the mean of 5 on a GPU)."""
    for _ in range(2):
        model.forward(batch)
    model.backend.synchronize()
    reps = 5 if model.backend.is_gpu else 1
    t = time.perf_counter()
    for _ in range(reps):
        model.forward(batch)
    model.backend.synchronize()
    return (time.perf_counter() - t) / reps


def llm_decode_tok_per_s(llm, ids, new_tokens: int) -> float:
    """Batch-1 decode through the engine itself (LLM: the engine loop, decode graphs, and on a GPU
    async scheduling, which launches step t+1 before step t's token reaches the host), from its
    step log: decode steps over their seconds."""
    from engine.runtime.sampling_params import SamplingParams
    llm.generate([ids], SamplingParams(max_new_tokens=8, ignore_eos=True))           # warm-up
    llm.generate([ids], SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
    decode = [entry for entry in llm.last_step_log if entry["kind"] == "decode"]
    return len(decode) / sum(entry["seconds"] for entry in decode)
