"""Chapter 13 exercises: the online-softmax merge, blockwise attention, the key-tiled online-softmax
attention (FlashAttention's loop, plugged into the real model's prefill), the chunk schedule."""
from __future__ import annotations

import contextlib
import io
import tracemalloc
from collections.abc import Callable

import numpy as np

from engine.exercises import call_learner, check_cases
from engine.exercises.ch03 import array_mismatch, describe
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
    # rows that no key of either block may see (both maxima -inf): the merge must stay empty, not NaN
    m1 = np.array([-np.inf, 0.7, -np.inf], np.float32)
    l1 = np.array([0.0, 1.5, 0.0], np.float32)
    acc1 = np.array([[0.0, 0.0], [0.5, -1.0], [0.0, 0.0]], np.float32)
    m2 = np.array([-np.inf, -np.inf, 2.0], np.float32)
    l2 = np.array([0.0, 0.0, 1.25], np.float32)
    acc2 = np.array([[0.0, 0.0], [0.0, 0.0], [2.0, 1.0]], np.float32)
    yield m1, l1, acc1, m2, l2, acc2


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
        both_empty = np.isneginf(case[0]) & np.isneginf(case[3])          # rows no key of either block sees
        if np.any(both_empty) and not (np.all(np.isfinite(l[both_empty])) and np.all(np.isfinite(acc[both_empty]))):
            row = int(np.flatnonzero(both_empty & ~(np.isfinite(l) & np.isfinite(acc).all(axis=-1)))[0])
            print(f"[x] merge_partials: case {count + 1}, row {row}: both blocks are empty (m1 = m2 = -inf) and the "
                  f"merge returned l = {l[row]}, acc = {acc[row]}: exp(-inf - (-inf)) is NaN. Guard it: where "
                  f"m = -inf use 0 in place of m in the exponents (the row stays m = -inf, l = 0, acc = 0)")
            return False
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
    print(f"[OK] merge_partials: all {count} cases pass (the last two merge fully masked blocks, the last "
          f"one rows where both blocks are masked)")
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


def _quietly(check: Callable, *args, **kwargs) -> tuple[bool, str]:
    """(verdict, what it printed) of a checker whose [OK] must wait for a further check."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        ok = check(*args, **kwargs)
    return ok, out.getvalue()


def _explain_nan(got, want, guard: bool) -> str | None:
    """array_mismatch, plus what a NaN answer usually means in causal attention."""
    reason = array_mismatch(got, want, 1e-4, 1e-5)
    if reason is None or "NaN" not in reason:
        return reason
    bad_rows = np.flatnonzero(~np.isfinite(np.asarray(got, dtype=np.float64)).reshape(len(want), -1).all(axis=1))
    if bad_rows.tolist() == [0]:
        return reason + (" in row 0 only -- it looks like the diagonal was masked too: query t sees key t "
                         "itself (mask key > t, not key >= t), so row 0 saw no key at all")
    if guard:
        return reason + (" -- a row whose keys in a tile are all masked has m_new = -inf, and exp(-inf - (-inf)) "
                         "is NaN: where m_new is -inf use 0 in the exponents (the -inf guard), or start at key 0")
    return reason


def _array_cases(title: str, fn: Callable, cases: list, hints: list, guard: bool) -> bool:
    return check_cases(title, fn, cases, copy_args=True, hints=hints,
                       explain=lambda got, want: _explain_nan(got, want, guard),
                       same=lambda got, want: array_mismatch(got, want, 1e-4, 1e-5) is None,
                       label=lambda f, args: f"{getattr(f, '__name__', 'fn')}{describe(args)}")


def check_blockwise_attention(fn: Callable) -> bool:
    """fn(q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D], scale, tile) -> [T, Hq, D], causal GQA attention
    that never holds more than `tile` query rows of scores: memory linear in T. One verdict: right on
    every case AND below the memory bound at T = 2,048."""
    rng = np.random.default_rng(7)
    cases = []
    for T, Hq, Hkv, D, tile in ((1, 1, 1, 4, 4), (7, 6, 2, 16, 3), (33, 4, 1, 8, 8), (50, 9, 3, 12, 16),
                                (64, 8, 2, 32, 64), (20, 2, 2, 4, 7)):
        q, k, v = (rng.standard_normal((T, H, D), dtype=np.float32) for H in (Hq, Hkv, Hkv))
        cases.append(((q, k, v, D ** -0.5, tile), causal_attention_ref(q, k, v, D ** -0.5)))
    hints = [("the causal mask is missing: query t may only see keys 0..t (of the whole sequence, "
              "not of its tile)", lambda q, k, v, s, tile: _unmasked(q, k, v, s)),
             ("the scores were not multiplied by scale", lambda q, k, v, s, tile: causal_attention_ref(q, k, v, 1.0))]
    ok, printed = _quietly(_array_cases, "blockwise_attention", fn, cases, hints, False)
    if not ok:
        print(printed, end="")
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
        print(f"[x] blockwise_attention: right on all {len(cases)} cases, but T=2048 peaked at {peak / 2**20:.1f} MiB "
              f"and the dense scores are {dense / 2**20:.0f} MiB: some [T, T] array is still built (score only "
              f"`tile` queries at a time)")
        return False
    print(f"[OK] blockwise_attention: all {len(cases)} cases pass, and T=2048 peaked at {peak / 2**20:.2f} MiB "
          f"(dense scores: {dense / 2**20:.0f} MiB)")
    return True


# ----------------------------------------------------------------------------- the key-tiled loop

def _flash_variant(q, k, v, scale, block_q: int, block_k: int, *, rescale_acc: bool = True,
                   rescale_l: bool = True, mask: str = "causal", head_of=None) -> np.ndarray:
    """The key-tiled online-softmax loop, with one piece swappable: what a learner's version computes.
    mask: "causal" (key <= query, absolute positions), "none" (tiles past the diagonal skipped but the
    diagonal tile unmasked), "local" (positions inside the tiles compared)."""
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    head_of = head_of or (lambda h: h // (Hq // Hkv))
    out = np.empty((T, Hq, D), dtype=np.float32)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        for h in range(Hq):
            g = head_of(h)
            for q0 in range(0, T, block_q):
                rows = np.arange(q0, min(q0 + block_q, T))
                m = np.full(len(rows), -np.inf, dtype=np.float32)
                l = np.zeros(len(rows), dtype=np.float32)
                acc = np.zeros((len(rows), D), dtype=np.float32)
                for k0 in range(0, int(rows[-1]) + 1, block_k):
                    keys = np.arange(k0, min(k0 + block_k, T))
                    s = q[rows, h] @ k[keys, g].T * np.float32(scale)
                    if mask == "causal":
                        s = np.where(keys[None, :] <= rows[:, None], s, -np.inf)
                    elif mask == "local":
                        s = np.where((keys - k0)[None, :] <= (rows - q0)[:, None], s, -np.inf)
                    m_new = np.maximum(m, s.max(axis=1))
                    safe = np.where(np.isneginf(m_new), 0, m_new)
                    alpha = np.exp(m - safe)
                    p = np.exp(s - safe[:, None])
                    l = (alpha * l if rescale_l else l) + p.sum(axis=1)
                    acc = (alpha[:, None] * acc if rescale_acc else acc) + p @ v[keys, g]
                    m = m_new
                out[rows, h] = acc / l[:, None]
    return out


def _flash_memory_bound(T: int, Hq: int, D: int, block_q: int, block_k: int) -> int:
    """Bytes a key-tiled loop may allocate: the output, plus a few score tiles of one GQA group."""
    return 4 * T * Hq * D + 8 * 4 * block_q * Hq * block_k


def check_flash_attention(fn: Callable) -> bool:
    """fn(q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D], scale, block_q, block_k) -> [T, Hq, D]: causal GQA
    attention by query tiles of block_q rows that walk the key tiles of block_k keys with a running
    (m, l, acc) per row, rescaled by exp(m_old - m_new) as the max grows, divided by l at the end.
    One verdict: right on every case (tile sizes that do not divide T, GQA, a large score range) AND
    within the memory of a few [block_q, block_k] tiles at T = 8,192 (no [block_q, T] strip of scores)."""
    title = "flash_attention"
    rng = np.random.default_rng(131)
    cases = []
    for T, Hq, Hkv, D, bq, bk, spread in ((1, 1, 1, 4, 4, 4, 1.0), (9, 6, 2, 8, 4, 3, 1.0),
                                          (40, 4, 1, 8, 16, 8, 1.0), (37, 9, 3, 12, 8, 16, 1.0),
                                          (64, 8, 2, 16, 64, 64, 1.0), (50, 2, 2, 4, 7, 5, 30.0),
                                          (100, 4, 2, 8, 32, 16, 1.0)):
        q, k, v = (rng.standard_normal((T, H, D), dtype=np.float32) for H in (Hq, Hkv, Hkv))
        q *= np.float32(spread)                               # spread 30: scores in the hundreds, the max moves a lot
        cases.append(((q, k, v, D ** -0.5, bq, bk), causal_attention_ref(q, k, v, D ** -0.5)))
    hints = [
        ("acc was not rescaled by alpha = exp(m_old - m_new) when a tile raised the max",
         lambda *a: _flash_variant(*a, rescale_acc=False)),
        ("l was not rescaled by alpha = exp(m_old - m_new) when a tile raised the max",
         lambda *a: _flash_variant(*a, rescale_l=False)),
        ("the diagonal tile was not masked: tiles past the diagonal are skipped, but inside the diagonal tile "
         "query t must still not see keys after t", lambda *a: _flash_variant(*a, mask="none")),
        ("the mask compared positions inside the tiles; compare absolute positions (q0 + i against k0 + j)",
         lambda *a: _flash_variant(*a, mask="local")),
        ("query head h read KV head h % Hkv; the heads of one group are neighbours: h // (Hq // Hkv)",
         lambda *a: _flash_variant(*a, head_of=lambda h, n=a[0].shape[1], m=a[1].shape[1]: h % m)),
        ("the scores were not multiplied by scale",
         lambda q, k, v, s, bq, bk: _flash_variant(q, k, v, 1.0, bq, bk)),
    ]

    ok, printed = _quietly(_array_cases, title, fn, cases, hints, True)
    if not ok:
        print(printed, end="")
        return False
    T, Hq, Hkv, D, bq, bk = 8192, 2, 1, 4, 256, 256
    q, k, v = (rng.standard_normal((T, H, D), dtype=np.float32) for H in (Hq, Hkv, Hkv))
    ok, result = call_learner(title, f"{title}(T={T}, block_q={bq}, block_k={bk})", peak_bytes, fn, q, k, v,
                              D ** -0.5, bq, bk)
    if not ok:
        return False
    _, peak = result
    bound, strip = _flash_memory_bound(T, Hq, D, bq, bk), 4 * bq * T
    if peak > bound:
        print(f"[x] {title}: right on all {len(cases)} cases, but T={T} peaked at {peak / 2**20:.1f} MiB, more than "
              f"the output and a few score tiles ({bound / 2**20:.1f} MiB); one query tile's strip of scores "
              f"against every key is {strip / 2**20:.0f} MiB a head: score block_k keys at a time and fold them "
              f"into (m, l, acc)")
        return False
    print(f"[OK] {title}: all {len(cases)} cases pass, and T={T} peaked at {peak / 2**20:.2f} MiB (the output and "
          f"a few tiles; a [block_q, T] strip of scores would be {strip / 2**20:.0f} MiB a head)")
    return True


def answer_through_flash_attention(fn: Callable, prompt: str = "What is the capital of France?",
                                   max_new_tokens: int = 10, block_q: int = 16, block_k: int = 16) -> bool:
    """The default model (SmolLM2, NumPy) answers `prompt` with your flash attention as its prefill attention:
    every token is a full causal pass (`model.logits`, no cache) whose 30 layers attend through
    fn(q, k, v, scale, block_q, block_k), the chapter 06 'attention' stage of engine/plugins.py. Prints the
    answer and whether it is token for token the engine's (greedy); True when it is."""
    import engine
    from engine.exercises.model_check import _default_model
    from engine.runtime.chat_session import ChatSession
    title = "your flash_attention inside SmolLM2"
    rng = np.random.default_rng(0)
    ok, _ = call_learner(title, "flash_attention on a small case", fn,
                         *(rng.standard_normal((5, H, 4), dtype=np.float32) for H in (2, 1, 1)), 0.5, 2, 2)
    if not ok:                                   # not attempted (or broken): say so before loading the model
        return False
    model, tok = _default_model(None, 256)
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": prompt}]), add_special_tokens=False)
    params = engine.SamplingParams(max_new_tokens=max_new_tokens)
    want = list(ChatSession(model).stream(ids, params))
    got: list[int] = []
    try:
        with engine.use_stage("attention", lambda q, k, v, scale: fn(q, k, v, scale, block_q, block_k)):
            while len(got) < len(want):
                got.append(int(np.argmax(model.logits(ids + got)[-1])))
                if got[-1] != want[len(got) - 1]:
                    break
    except NotImplementedError:
        print(f"[ ] {title}: not attempted yet (the function still raises NotImplementedError)")
        return False
    except Exception as e:  # the learner's bug, shown rather than raised
        print(f"[x] {title}: it raised {type(e).__name__}: {e}")
        return False
    text = tok.decode(got, skip_special_tokens=True)
    if got != want:
        print(f"[x] {title}: generated token {len(got) - 1} differs from the engine's ({got[-1]} vs "
              f"{want[len(got) - 1]}); check_in_model names the first layer and position that diverge")
    else:
        print(f"[OK] {title}: {len(got)} tokens, each from a full causal pass through your tiles "
              f"(block_q={block_q}, block_k={block_k}), the same as the engine's")
    print(f"    {prompt!r} -> {text!r}")
    return got == want


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

    def cut(prompt_len, chunk):
        return [min(chunk, prompt_len - a) for a in range(0, prompt_len, chunk)] if chunk > 0 else None
    hints = [("every chunk took the whole budget; the running decodes ride in the same step, one token "
              "each, so a chunk gets max_batch_tokens - num_decoding",
              lambda p, d, b: cut(p, b)),
             ("the prompt's own row was counted as one more decode: a chunk gets max_batch_tokens - "
              "num_decoding tokens", lambda p, d, b: cut(p, b - d - 1)),
             ("the decodes' tokens were taken out of the first chunk only; they ride in every step until "
              "the prompt is done", lambda p, d, b: [min(b - d, p)] + (cut(p - (b - d), b) or [])
              if p > b - d else None)]
    return check_cases("chunk_schedule", fn, cases, same=same, hints=hints)
