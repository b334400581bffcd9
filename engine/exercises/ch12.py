"""Chapter 12 exercises: the decode speed limit, what fits in a KV pool, reading a serving log."""
from __future__ import annotations

import math
import tempfile
from collections.abc import Callable

import numpy as np

from engine.exercises import check_cases
from engine.exercises.ch08 import config_label, preset_config
from engine.formats.config import LlamaConfig
from engine.model.random_model import write_random_model
from engine.runtime.kv_allocator import PageAllocator, SlotAllocator
from engine.runtime.sampling_params import SamplingParams
from engine.runtime.step_log import StepRecord, summarize

GIB = 2**30


def _call(fn: Callable, args: tuple) -> str:
    def show(a):
        if isinstance(a, LlamaConfig):
            return config_label(a)
        if isinstance(a, list) and len(a) > 8:
            return f"[{len(a)} lengths: {', '.join(map(str, a[:4]))}, ...]"
        return repr(a)
    parts = [show(a) for a in args]
    return f"{getattr(fn, '__name__', 'fn')}({', '.join(parts)})"


def _close(got, want) -> bool:
    return math.isclose(float(got), float(want), rel_tol=1e-6)


# ----------------------------------------------------------------------------- the bandwidth floor

def decode_floor_ref(config: LlamaConfig, batch: int, context_len: int, bandwidth_gbps: float,
                     bytes_per_value: int = 2) -> float:
    """Best possible decode tokens/s: each step reads every weight once plus each sequence's K/V, and
    produces one token per sequence."""
    weights = config.num_parameters() * bytes_per_value
    kv = batch * context_len * config.kv_bytes_per_token(bytes_per_value)
    return batch * bandwidth_gbps * 1e9 / (weights + kv)


def check_decode_floor(fn: Callable) -> bool:
    """fn(config, batch, context_len, bandwidth_gbps, bytes_per_value) -> the decode tokens/s that memory
    bandwidth allows: a step reads all weights once and the K/V of context_len tokens per sequence."""
    llama, smol = preset_config("llama-3.2-1b"), preset_config("smollm2-135m")
    setups = [(llama, 1, 256, 4200.0, 2), (llama, 64, 1024, 4200.0, 2), (llama, 256, 600, 4200.0, 2),
              (smol, 1, 128, 18.0, 4), (smol, 16, 4096, 3350.0, 2), (llama, 1, 0, 1000.0, 1)]
    cases = [(args, decode_floor_ref(*args)) for args in setups]
    hints = [("the K/V reads are missing (they dominate at large batch x context)",
              lambda c, b, n, bw, bpv: b * bw * 1e9 / (c.num_parameters() * bpv)),
             ("that is steps/s; a step produces one token per sequence: multiply by the batch",
              lambda c, b, n, bw, bpv: decode_floor_ref(c, b, n, bw, bpv) / b),
             ("the K/V was counted once per step; every sequence reads its own",
              lambda c, b, n, bw, bpv: b * bw * 1e9 / (c.num_parameters() * bpv + n * c.kv_bytes_per_token(bpv)))]
    return check_cases("decode_floor", fn, cases, same=_close, hints=hints, label=_call)


# ----------------------------------------------------------------------------- what fits in a pool

def contiguous_slots_ref(config: LlamaConfig, pool_bytes: int, max_context: int, bytes_per_value: int = 2) -> int:
    """Sequences a contiguous pool holds at once: each reserves max_context tokens up front."""
    return pool_bytes // (max_context * config.kv_bytes_per_token(bytes_per_value))


def check_contiguous_slots(fn: Callable) -> bool:
    """fn(config, pool_bytes, max_context, bytes_per_value) -> how many max_context-token slots fit."""
    llama, smol = preset_config("llama-3.2-1b"), preset_config("smollm2-135m")
    cases = [(llama, 8 * GIB, 2056, 2), (llama, 8 * GIB, 4096, 2), (llama, 1 * GIB, 131072, 2),
             (smol, 1 * GIB, 4096, 4), (smol, 512 * 2**20, 8192, 2), (llama, 70 * GIB, 8192, 1)]
    checked = []
    for cfg, pool, ctx, bpv in cases:
        slots = contiguous_slots_ref(cfg, pool, ctx, bpv)
        SlotAllocator(max(slots, 1), ctx)                          # the engine's allocator takes it
        checked.append(((cfg, pool, ctx, bpv), slots))
    hints = [("that rounds up; a slot that does not fit entirely is no slot: round down",
              lambda c, p, n, b: -(-p // (n * c.kv_bytes_per_token(b)))),
             ("K and V are two tensors: the factor 2 is missing",
              lambda c, p, n, b: p // (n * c.kv_bytes_per_token(b) // 2))]
    return check_cases("contiguous_slots", fn, checked, same=lambda got, want: int(got) == want, hints=hints,
                       label=_call)


def paged_fit_ref(config: LlamaConfig, pool_bytes: int, seq_lens: list[int], page_size: int = 16,
                  bytes_per_value: int = 2) -> int:
    """How many of the sequences, admitted in order, a paged pool holds at once (each takes
    ceil(len / page_size) pages), found by asking the engine's PageAllocator."""
    num_pages = pool_bytes // (page_size * config.kv_bytes_per_token(bytes_per_value))
    if num_pages < 1:
        return 0
    pool = PageAllocator(int(num_pages), page_size)
    for i, n in enumerate(seq_lens):
        if not pool.can_reserve(i, n):
            return i
        pool.reserve(i, n)
    return len(seq_lens)


def check_paged_fit(fn: Callable) -> bool:
    """fn(config, pool_bytes, seq_lens, page_size, bytes_per_value) -> how many of the sequences, taken in
    order, fit in a paged pool at once: the pool has pool_bytes // (page_size * bytes per token) pages
    and a sequence of n tokens takes ceil(n / page_size) of them."""
    rng = np.random.default_rng(4)
    llama, smol = preset_config("llama-3.2-1b"), preset_config("smollm2-135m")
    lens = [int(n) for n in rng.integers(100, 1025, 400)]
    cases = [(llama, 8 * GIB, lens, 16, 2), (llama, 1 * GIB, lens, 16, 2), (llama, 1 * GIB, lens, 256, 2),
             (smol, 64 * 2**20, [17, 16, 1, 33, 500, 2, 2, 2], 16, 4), (smol, 23040 * 16, [16, 1], 16, 2),
             (smol, 23040 * 16, [17], 16, 2), (llama, 8 * GIB, [2056] * 300, 16, 2)]
    checked = [(args, paged_fit_ref(*args)) for args in cases]

    def by_tokens(c, p, lens, ps, b):
        return int(np.searchsorted(np.cumsum(lens), p // c.kv_bytes_per_token(b), side="right"))
    hints = [("the sequences were counted in tokens; each takes whole pages (round its length up)", by_tokens)]
    return check_cases("paged_fit", fn, checked, same=lambda got, want: int(got) == want, hints=hints,
                       label=_call)


# ----------------------------------------------------------------------------- a serving log

def step_log_summary_ref(step_log: list[StepRecord]) -> tuple[int, int, float]:
    """(prefill steps, decode steps, mean rows of the decode steps) of LLM.last_step_log."""
    totals = summarize(step_log)
    return totals["prefill_steps"], totals["decode_steps"], totals["mean_decode_rows"]


def serving_logs() -> list[list[StepRecord]]:
    """Real step logs of engine.LLM on a tiny random model: static and continuous, roomy and tight pools."""
    from engine.runtime.llm import LLM
    rng = np.random.default_rng(5)
    logs = []
    with tempfile.TemporaryDirectory(prefix="ch12_") as d:
        model_dir = write_random_model(f"{d}/tiny", "tiny", seed=12, dtype="F32")
        for batching, kv, mib, max_seqs in (("continuous", "paged", None, 4), ("static", "contiguous", None, 4),
                                            ("continuous", "paged", 0.05, 8)):
            llm = LLM(model_dir, "numpy", batching=batching, kv_cache=kv, kv_cache_mib=mib,
                      max_context=96, max_seqs=max_seqs, chunked_prefill=False)   # kinds: prefill | decode
            prompts = [[int(t) for t in rng.integers(3, 300, int(rng.integers(2, 20)))] for _ in range(7)]
            params = [SamplingParams(max_new_tokens=int(rng.integers(1, 30)), ignore_eos=True) for _ in prompts]
            llm.generate(prompts, params)
            logs.append(llm.last_step_log)
    return logs


def check_step_log_summary(fn: Callable) -> bool:
    """fn(step_log) -> (prefill_steps, decode_steps, mean_decode_rows): how many steps of each kind
    LLM.generate ran, and how many sequences a decode step served on average (0.0 without decode steps)."""
    cases = [((log,), step_log_summary_ref(log)) for log in serving_logs()] + [(([],), (0, 0, 0.0))]

    def same(got, want):
        return len(got) == 3 and [int(g) for g in got[:2]] == list(want[:2]) and _close(got[2], want[2])

    def mean_over_all_steps(log):
        rows = [s["rows"] for s in log]
        return step_log_summary_ref(log)[:2] + (float(np.mean(rows)) if rows else 0.0,)

    hints = [("the mean counts the rows of every step; only decode steps count", mean_over_all_steps)]
    return check_cases("step_log_summary", fn, cases, same=same, hints=hints,
                label=lambda f, args: f"{getattr(f, '__name__', 'fn')}(<step log of {len(args[0])} steps>)")
