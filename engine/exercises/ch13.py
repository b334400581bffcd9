"""Chapter 13 exercises: the online-softmax merge, blockwise attention, the chunk schedule."""
from __future__ import annotations

import tracemalloc
from collections.abc import Callable

import numpy as np

from engine.exercises import call_learner, check_cases
from engine.exercises.ch03 import run_array_checks
from engine.ops.attention import causal_attention_ref

# ----------------------------------------------------------------------------- the online softmax


def partial_attention(scores: np.ndarray, values: np.ndarray):
    """One block of keys seen by R query rows: scores [R, N], values [N, D] -> (m [R], l [R], acc [R, D])
    with m the row max, l = sum exp(s - m) and acc = sum exp(s - m) v (not yet divided by l)."""
    m = scores.max(axis=1)
    p = np.exp(scores - np.where(np.isfinite(m), m, 0)[:, None])
    return m, p.sum(axis=1), p @ values


def merge_partials_ref(m1, l1, acc1, m2, l2, acc2):
    """Two partial results over disjoint key blocks -> the partial result over both."""
    m = np.maximum(m1, m2)
    safe = np.where(np.isfinite(m), m, 0)            # both blocks empty: keep zeros, not NaN
    a1, a2 = np.exp(m1 - safe), np.exp(m2 - safe)
    return m, a1 * l1 + a2 * l2, a1[:, None] * acc1 + a2[:, None] * acc2


def _merge_cases():
    rng = np.random.default_rng(13)
    for R, n1, n2, D, shift in ((1, 1, 1, 1, 0.0), (4, 8, 8, 16, 0.0), (3, 5, 11, 7, 30.0), (6, 16, 3, 8, -40.0)):
        s = rng.standard_normal((R, n1 + n2)).astype(np.float32) * 4
        s[:, n1:] += shift                           # the second block's max is far above or below
        v = rng.standard_normal((n1 + n2, D)).astype(np.float32)
        yield partial_attention(s[:, :n1], v[:n1]) + partial_attention(s[:, n1:], v[n1:])
    # a block fully masked for every row (a key tile past the diagonal): m = -inf, l = 0, acc = 0
    s = rng.standard_normal((2, 4)).astype(np.float32)
    v = rng.standard_normal((4, 3)).astype(np.float32)
    empty = (np.full(2, -np.inf, np.float32), np.zeros(2, np.float32), np.zeros((2, 3), np.float32))
    yield partial_attention(s, v) + empty


def check_merge_partials(fn: Callable) -> bool:
    """fn(m1, l1, acc1, m2, l2, acc2) -> (m, l, acc): the online-softmax merge of two key blocks."""
    count = 0
    for case in _merge_cases():
        want = merge_partials_ref(*case)
        ok, got = call_learner("merge_partials", "merge_partials(m1, l1, acc1, m2, l2, acc2)", fn,
                               *(np.array(a, copy=True) for a in case))
        if not ok:
            return False
        if not isinstance(got, tuple) or len(got) != 3:
            print("[x] merge_partials: return the tuple (m, l, acc)")
            return False
        m, l, acc = (np.asarray(x, dtype=np.float64) for x in got)
        if not np.allclose(m, want[0]):
            print(f"[x] merge_partials: m is {m}, expected {want[0]} (the max of the two maxima)")
            return False
        if not np.allclose(l, want[1], rtol=1e-5, atol=1e-7) or not np.allclose(acc, want[2], rtol=1e-5, atol=1e-6):
            unscaled = np.allclose(l, case[1] + case[4], rtol=1e-5)
            why = ("l and acc were added without rescaling: each block's sums are relative to its own "
                   "max, multiply them by exp(m_i - m) first" if unscaled else
                   "l or acc is off: l = exp(m1 - m) l1 + exp(m2 - m) l2, and acc the same with acc1, acc2"
                   + (" (a block with m = -inf must contribute 0, not NaN)" if not np.all(np.isfinite(acc)) else ""))
            print(f"[x] merge_partials: case {count + 1}: {why}")
            return False
        count += 1
    print(f"[OK] merge_partials: all {count} cases pass (the last one merges a fully masked block)")
    return True


# ----------------------------------------------------------------------------- blockwise attention

def dense_scores_bytes(T: int, Hq: int) -> int:
    """Bytes of the float32 [Hq, T, T] score matrix that dense attention builds."""
    return 4 * Hq * T * T


def peak_bytes(fn: Callable, *args) -> tuple[object, int]:
    """(fn(*args), peak bytes NumPy allocated while it ran), measured with tracemalloc."""
    tracemalloc.start()
    try:
        out = fn(*args)
        return out, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def check_blockwise_attention(fn: Callable) -> bool:
    """fn(q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D], scale, tile) -> [T, Hq, D], causal GQA attention
    that never holds more than `tile` query rows of scores: memory linear in T."""
    rng = np.random.default_rng(7)
    cases = []
    for T, Hq, Hkv, D, tile in ((1, 1, 1, 4, 4), (7, 6, 2, 16, 3), (33, 4, 1, 8, 8), (50, 9, 3, 12, 16),
                                (64, 8, 2, 32, 64), (20, 2, 2, 4, 7)):
        q, k, v = (rng.standard_normal((T, H, D), dtype=np.float32) for H in (Hq, Hkv, Hkv))
        cases.append(((q, k, v, D ** -0.5, tile), causal_attention_ref(q, k, v, D ** -0.5)))
    hints = [("the causal mask is missing: query t may only see keys 0..t (of the whole sequence, "
              "not of its tile)", lambda q, k, v, s, tile: _unmasked(q, k, v, s)),
             ("the scores were not multiplied by scale", lambda q, k, v, s, tile: causal_attention_ref(q, k, v, 1.0))]
    if not run_array_checks("blockwise_attention", fn, cases, rtol=1e-4, atol=1e-5, hints=hints):
        return False
    T, Hq, Hkv, D, tile = 2048, 2, 1, 8, 64
    q, k, v = (rng.standard_normal((T, H, D), dtype=np.float32) for H in (Hq, Hkv, Hkv))
    ok, result = call_learner("blockwise_attention", "blockwise_attention(T=2048, tile=64)", peak_bytes,
                              fn, q, k, v, D ** -0.5, tile)
    if not ok:
        return False
    _, peak = result
    dense = dense_scores_bytes(T, Hq)
    if peak > dense / 4:
        print(f"[x] blockwise_attention: T=2048 peaked at {peak / 2**20:.1f} MiB, the dense scores are "
              f"{dense / 2**20:.0f} MiB: some [T, T] array is still built (score only `tile` queries at a time)")
        return False
    print(f"[OK] blockwise_attention: and T=2048 peaked at {peak / 2**20:.2f} MiB "
          f"(dense scores: {dense / 2**20:.0f} MiB)")
    return True


def _unmasked(q, k, v, scale):
    T, Hq, D = q.shape
    r = Hq // k.shape[1]
    kk, vv = np.repeat(k, r, axis=1), np.repeat(v, r, axis=1)
    s = np.einsum("thd,shd->hts", q, kk) * scale
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("hts,shd->thd", p / p.sum(-1, keepdims=True), vv)


# ----------------------------------------------------------------------------- the chunk schedule

def chunk_schedule_ref(prompt_len: int, num_decoding: int, max_batch_tokens: int) -> list[int]:
    """The real scheduler's chunks of a prompt that arrives while num_decoding requests decode."""
    from engine.runtime.kv_allocator import PageAllocator
    from engine.runtime.sampling_params import SamplingParams
    from engine.runtime.scheduler import Scheduler
    steps = prompt_len // max(1, max_batch_tokens - num_decoding) + 2    # the decodes outlive the prefill
    pages = (num_decoding * (steps + 2) + prompt_len) // 16 + num_decoding + 2   # room for everyone
    sched = Scheduler(PageAllocator(pages, 16), max_seqs=num_decoding + 1, max_batch_tokens=max_batch_tokens,
                      max_context=prompt_len + steps + 2, chunked_prefill=True)
    for _ in range(num_decoding):
        sched.submit([1], SamplingParams(max_new_tokens=steps, ignore_eos=True))
    if num_decoding:
        batch = sched.schedule()                      # their prefill: one token each
        assert batch is not None                      # (None only when nothing is left to run)
        sched.complete(batch.batch_id, [1] * len(batch.sampling_rows))
    long_id = sched.submit([1] * prompt_len, SamplingParams(max_new_tokens=1, ignore_eos=True))
    chunks = []
    while sched.has_unfinished() and long_id in sched.snapshot()["waiting"] + sched.snapshot()["running"]:
        batch = sched.schedule()
        assert batch is not None
        chunks += [len(row.token_ids) for row in batch.rows if row.request_id == long_id]
        sched.complete(batch.batch_id, [1] * len(batch.sampling_rows))
    return chunks


def check_chunk_schedule(fn: Callable[[int, int, int], list]) -> bool:
    """fn(prompt_len, num_decoding, max_batch_tokens) -> the prompt's chunk lengths, step by step."""
    shapes = ((100, 3, 32), (64, 0, 16), (10, 5, 16), (33, 1, 16), (1, 4, 4 + 1), (32768, 64, 2048), (500, 7, 8))
    cases = [(s, chunk_schedule_ref(*s)) for s in shapes]

    def same(got, want):
        return [int(c) for c in got] == want
    return check_cases("chunk_schedule", fn, cases, same=same)
