"""Chapter 11 exercises: the page-table lookup, the pages a request can need, paged attention in NumPy
(plugged into the real model's decode steps), and the online softmax (one key at a time, then merging
two partial states, as the split-K kernel does)."""
from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from engine.exercises import call_learner, check_cases
from engine.ops.paged_attention import NWARPS
from engine.runtime.kv_allocator import PageAllocator
from engine.runtime.sampling_params import SamplingParams
from engine.runtime.scheduler import Batch, InvalidRequest, Row, Scheduler

# ----------------------------------------------------------------------------- the lookup

def _slot_ref(page_table, position: int, page_size: int) -> int:
    """Where the engine puts the token: Batch.slot_mapping of a one-token row at that position."""
    row = Row(0, [0], position, list(page_table), None, 0)
    return int(Batch(0, "decode", [row], page_size).slot_mapping[0])


def check_slot_of(fn: Callable[[list, int, int], int]) -> bool:
    """fn(page_table, position, page_size) -> the cache slot (row of the flattened pool) that
    holds the token at that absolute position of the sequence."""
    rng = np.random.default_rng(13)
    cases = []
    for table, bs in (([7, 2, 9], 16), ([0], 16), ([5, 3], 4), ([11, 0, 4, 8, 1], 3), ([3], 256)):
        for pos in sorted({0, 1, bs - 1, bs, len(table) * bs - 1, int(rng.integers(0, len(table) * bs))}):
            if pos < len(table) * bs:
                cases.append(((table, pos, bs), _slot_ref(table, pos, bs)))
    hints = [("the position was used as the slot: that is only true for one contiguous page 0",
              lambda t, p, bs: p),
             ("the page number was not multiplied by page_size (slot = page * page_size + offset)",
              lambda t, p, bs: t[p // bs] + p % bs),
             ("the table was indexed by the offset and the page by the quotient, the wrong way round",
              lambda t, p, bs: t[p % bs] * bs + p // bs)]
    return check_cases("slot_of", fn, cases, hints=hints)


# ----------------------------------------------------------------------------- paged attention in NumPy

def _paged_variant(q, k_cache, v_cache, page_tables, seq_idx, positions, scale, *, where=None, head_of=None,
                   context=None, table_row=None):
    """Paged attention written key by key, with one piece swappable: what a learner's version computes.
    where(table, j, page_size) -> (page, offset) of key j; head_of(h, Hq, Hkv) -> the KV head of query
    head h; context(position, table, page_size) -> how many keys the row reads; table_row(r, seq) -> the
    row of page_tables it uses."""
    R, Hq, D = q.shape
    PS, Hkv = k_cache.shape[1], k_cache.shape[2]
    where = where or (lambda table, j, ps: (table[j // ps], j % ps))
    head_of = head_of or (lambda h, hq, hkv: h // (hq // hkv))
    context = context or (lambda pos, table, ps: pos + 1)
    table_row = table_row or (lambda r, seq: seq)
    out = np.empty((R, Hq, D), dtype=np.float32)
    for r in range(R):
        table = page_tables[table_row(r, int(seq_idx[r]))]
        n = int(context(int(positions[r]), table, PS))
        slots = [where(table, j, PS) for j in range(n)]
        pages, offsets = np.array([p for p, _ in slots], dtype=np.int64), np.array([o for _, o in slots], np.int64)
        keys, values = k_cache[pages, offsets], v_cache[pages, offsets]          # [n, Hkv, D]
        for h in range(Hq):
            g = head_of(h, Hq, Hkv)
            s = keys[:, g] @ q[r, h] * np.float32(scale)
            p = np.exp(s - s.max())
            out[r, h] = p @ values[:, g] / p.sum()
    return out


def _paged_case(rng, Hq: int, Hkv: int, D: int, page_size: int, contexts: list, rows_per_seq: int = 1,
                width: int | None = None):
    """Sequences of the given lengths in shuffled pages of a cache whose every slot holds data (what a
    row must not read is not zero); `rows_per_seq` > 1 gives a sequence several query rows at
    consecutive positions (a prompt appended to its cached prefix). Tables are padded with -1."""
    S = len(contexts)
    per_seq = [-(-c // page_size) for c in contexts]
    width = max(width or 0, max(per_seq))
    num_pages = sum(per_seq) + 3
    order = rng.permutation(num_pages).astype(np.int32)
    tables = np.full((S, width), -1, dtype=np.int32)
    start = 0
    for s, n in enumerate(per_seq):
        tables[s, :n] = order[start:start + n]
        start += n
    k_cache = rng.standard_normal((num_pages, page_size, Hkv, D), dtype=np.float32)
    v_cache = rng.standard_normal((num_pages, page_size, Hkv, D), dtype=np.float32)
    seq_idx, positions = [], []
    for s, c in enumerate(contexts):
        for i in range(min(rows_per_seq, c)):
            seq_idx.append(s)
            positions.append(c - min(rows_per_seq, c) + i)
    order_rows = rng.permutation(len(seq_idx))                                   # rows in any order
    seq_idx = np.array(seq_idx, dtype=np.int32)[order_rows]
    positions = np.array(positions, dtype=np.int32)[order_rows]
    q = rng.standard_normal((len(seq_idx), Hq, D), dtype=np.float32)
    return q, k_cache, v_cache, tables, seq_idx, positions, D ** -0.5


PAGED_HINTS = [
    ("the page index and the token offset were swapped: key j is at page table[j // page_size], offset "
     "j % page_size", lambda *a: _paged_variant(*a, where=lambda t, j, ps: (t[j % ps], j // ps))),
    ("the row read past its sequence's length: the rest of the last page holds other data (or nothing "
     "yet); read keys 0..positions[r] only",
     lambda *a: _paged_variant(*a, context=lambda pos, t, ps: -(-(pos + 1) // ps) * ps)),
    ("query head h read KV head h % n_kv; the heads of one group are neighbours: KV head h // (Hq // Hkv)",
     lambda *a: _paged_variant(*a, head_of=lambda h, hq, hkv: h % hkv)),
    ("the row's own position was left out: row r attends to positions 0..positions[r], inclusive",
     lambda *a: _paged_variant(*a, context=lambda pos, t, ps: pos)),
    ("the page table was ignored: key j is not at slot j of the pool (the pages are anywhere)",
     lambda *a: _paged_variant(*a, where=lambda t, j, ps: (j // ps, j % ps))),
    ("row r used page table r; the table of a row is page_tables[seq_idx[r]]",
     lambda *a: _paged_variant(*a, table_row=lambda r, seq: r)),
    ("the scores were not multiplied by scale",
     lambda q, kc, vc, t, si, p, scale: _paged_variant(q, kc, vc, t, si, p, 1.0)),
]


def _paged_cases():
    rng = np.random.default_rng(111)
    shapes = [  # (Hq, Hkv, D, page_size, contexts, rows_per_seq, table width)
        (6, 2, 8, 5, [9, 22, 4], 1, 6),          # keys < page_size², a table wider than a page: every mistake runs
        (6, 2, 16, 16, [37, 16, 1, 50], 1, None),
        (8, 2, 8, 5, [23, 7], 4, None),           # several rows per sequence (a prompt after its prefix)
        (4, 4, 8, 3, [10, 1, 3], 1, None),        # no GQA
        (9, 3, 4, 7, [70, 15, 8, 29], 1, 12),
        (2, 1, 32, 16, [200], 3, None),           # one KV head for every query head
    ]
    for Hq, Hkv, D, ps, ctxs, rows, width in shapes:
        args = _paged_case(rng, Hq, Hkv, D, ps, ctxs, rows, width)
        yield args, _paged_variant(*args)


def check_paged_attention(fn: Callable) -> bool:
    """fn(q [R, Hq, D], k_cache [NP, PS, Hkv, D], v_cache, page_tables [S, MP], seq_idx [R], positions [R],
    scale) -> [R, Hq, D]: row r attends to positions 0..positions[r] of sequence seq_idx[r], whose key j
    is at page page_tables[seq, j // PS], offset j % PS; query head h reads KV head h // (Hq // Hkv).
    The engine's signature for the paged_attention stage (engine/plugins.py)."""
    from engine.exercises.ch03 import run_array_checks
    return run_array_checks("paged_attention", fn, list(_paged_cases()), rtol=1e-4, atol=1e-5, hints=PAGED_HINTS)


def check_paged_attention_in_llm(fn: Callable, max_new_tokens: int = 12) -> bool:
    """The default model (SmolLM2, NumPy backend) answers three chat prompts through engine.LLM with a paged
    cache of 16-token pages while your function is its paged_attention stage: every decode step reads
    K/V through your code. The same tokens as the engine's own attention, request by request."""
    import engine
    from engine.exercises.serving_check import default_chat_prompts
    title = "your paged_attention inside engine.LLM"
    ok, _ = call_learner(title, "paged_attention on a small case", fn, *next(_paged_cases())[0])
    if not ok:                                   # not attempted (or broken): say so before loading the model
        return False
    model_dir, prompts = default_chat_prompts()
    params = SamplingParams(max_new_tokens=max_new_tokens)
    llm = engine.LLM(model_dir, backend="numpy", kv_cache="paged", kv_cache_mib=5.0, max_seqs=3, max_context=256)
    want = llm.generate(prompts, params)
    calls = [0]

    def counted(*args):
        calls[0] += 1
        return fn(*args)
    try:
        with engine.use_stage("paged_attention", counted):
            got = llm.generate(prompts, params)
    except NotImplementedError:
        print(f"[ ] {title}: not attempted yet (the function still raises NotImplementedError)")
        return False
    except Exception as e:  # the learner's bug, shown rather than raised
        print(f"[x] {title}: it raised {type(e).__name__}: {e}")
        return False
    for i, (mine, real) in enumerate(zip(got, want, strict=True)):
        if mine.token_ids != real.token_ids:
            first = next(j for j, (a, b) in enumerate(zip(mine.token_ids + [-1], real.token_ids + [-1])) if a != b)
            print(f"[x] {title}: request {i} first differs at generated token {first}: {mine.text!r}\n"
                  f"    with the engine's attention: {real.text!r}")
            return False
    print(f"[OK] {title}: {calls[0]} calls (one per layer per decode step), the same tokens for all "
          f"{len(prompts)} requests")
    for i, r in enumerate(got):
        print(f"    request {i}: {r.text!r}")
    return True


# ----------------------------------------------------------------------------- pages per request

def _worst_pages_ref(prompt_len: int, max_new: int, page_size: int, max_context: int) -> int:
    """The smallest pool the scheduler accepts the request into: submit() refuses a request whose
    worst case is larger than the whole pool, so that size is exactly what admission promises it."""
    def accepted(num_pages: int) -> bool:
        sched = Scheduler(PageAllocator(num_pages, page_size), 1, max(prompt_len, 1), max_context)
        try:
            sched.submit([1] * prompt_len, SamplingParams(max_new_tokens=max_new))
        except InvalidRequest:
            return False
        return True
    low, high = 1, -(-max_context // page_size)       # accepted(high) always holds
    while low < high:
        mid = (low + high) // 2
        low, high = (low, mid) if accepted(mid) else (mid + 1, high)
    return low


def check_pages_needed(fn: Callable[[int, int, int, int], int]) -> bool:
    """fn(prompt_len, max_new_tokens, page_size, max_context) -> the most pages the request can ever
    hold: what conservative admission must find free before admitting it."""
    cases = [((p, n, ps, ctx), _worst_pages_ref(p, n, ps, ctx))
             for p, n, ps, ctx in ((10, 7, 16, 4096), (16, 1, 16, 4096), (16, 2, 16, 4096), (17, 1, 16, 4096),
                                   (100, 924, 16, 4096), (1, 1, 16, 4096), (30, 100, 16, 64), (5, 3, 4, 4096),
                                   (1000, 1000, 16, 1500), (33, 32, 32, 4096))]
    hints = [("the last sampled token was counted; it is never written to the cache (it would be "
              "the input of a step that never runs)", lambda p, n, ps, ctx: -(-min(p + n, ctx) // ps)),
             ("the context limit was ignored: a request stops when prompt + generated reaches max_context",
              lambda p, n, ps, ctx: -(-(p + n - 1) // ps)),
             ("that rounds down; a partly filled page is still a whole page",
              lambda p, n, ps, ctx: (min(p + n, ctx) - 1) // ps)]
    return check_cases("pages_needed", fn, cases, hints=hints)


# ----------------------------------------------------------------------------- online softmax

def online_update_ref(m: float, l: float, acc: np.ndarray, s: float, v: np.ndarray):
    """Fold one key (score s, value v) into the running state (max m, sum l, weighted sum acc)."""
    m_new = max(m, s)
    alpha, p = math.exp(m - m_new), math.exp(s - m_new)
    return m_new, l * alpha + p, acc * alpha + p * v


def merge_ref(a, b):
    """Combine the states of two disjoint sets of keys into the state of their union."""
    (m1, l1, acc1), (m2, l2, acc2) = a, b
    m = max(m1, m2)
    if m == -math.inf:
        return m, 0.0, np.zeros_like(acc1)
    w1, w2 = math.exp(m1 - m), math.exp(m2 - m)
    return m, l1 * w1 + l2 * w2, acc1 * w1 + acc2 * w2


def _state_close(got, want) -> bool:
    """Same (m, l, acc) within float64 rounding; NaN matches NaN (so a hint can name a NaN answer)."""
    try:
        m, l, acc = got
        got = np.array([float(m), float(l)]), np.asarray(acc, dtype=np.float64)
    except (TypeError, ValueError):
        return False
    want = np.array([float(want[0]), float(want[1])]), np.asarray(want[2], dtype=np.float64)
    return all(a.shape == b.shape and np.allclose(a, b, rtol=1e-6, atol=1e-12, equal_nan=True)
               for a, b in zip(got, want))


def _state_of(scores, values):
    """(max, sum of exp(s - max), sum of exp(s - max) * v) of a set of keys, computed all at once."""
    if len(scores) == 0:
        return -math.inf, 0.0, np.zeros(values.shape[1])
    m = float(np.max(scores))
    p = np.exp(np.asarray(scores, dtype=np.float64) - m)
    return m, float(p.sum()), p @ values


def _streamed(update, scores, values):
    state = (-math.inf, 0.0, np.zeros(values.shape[1]))
    for s, v in zip(scores, values):
        state = update(*state, float(s), v.copy())
    return state


def check_online_update(fn: Callable) -> bool:
    """fn(m, l, acc [D], s, v [D]) -> (m', l', acc'): the state after one more key. The empty state
    is (-inf, 0, zeros); after all keys, acc / l is the attention output softmax(scores) @ values."""
    rng = np.random.default_rng(14)
    v3 = np.array([[1.0, 0.0], [0.0, 1.0], [2.0, 2.0]])
    cases = [((-math.inf, 0.0, np.zeros(2), 1.0, v3[0]), online_update_ref(-math.inf, 0.0, np.zeros(2), 1.0, v3[0])),
             ((1.0, 1.0, v3[0].copy(), 3.0, v3[1]), online_update_ref(1.0, 1.0, v3[0].copy(), 3.0, v3[1])),
             ((3.0, 1.1353, np.array([0.1353, 1.0]), 2.0, v3[2]),
              online_update_ref(3.0, 1.1353, np.array([0.1353, 1.0]), 2.0, v3[2]))]
    stream_cases = []
    for n, D, scale in ((3, 2, 1.0), (50, 8, 3.0), (200, 64, 30.0), (7, 4, 1000.0)):
        scores, values = rng.standard_normal(n) * scale, rng.standard_normal((n, D))
        stream_cases.append(((scores, values), _state_of(scores, values)))
    hints = [("acc was not rescaled by exp(m - m_new) when the max grew",
              lambda m, l, acc, s, v: (max(m, s), l * math.exp(m - max(m, s)) + math.exp(s - max(m, s)),
                                       acc + math.exp(s - max(m, s)) * v)),
             ("l was not rescaled by exp(m - m_new) when the max grew",
              lambda m, l, acc, s, v: (max(m, s), l + math.exp(s - max(m, s)), online_update_ref(m, l, acc, s, v)[2])),
             ("exp(s) was used without subtracting the running max",
              lambda m, l, acc, s, v: (max(m, s), l + math.exp(s), acc + math.exp(s) * v))]
    if not check_cases("online_update (one key)", fn, cases, hints=hints, same=_state_close):
        return False
    def your_update_over_every_key(scores, values):
        return _streamed(fn, scores, values)
    return check_cases("online_update (streaming every key)", your_update_over_every_key,
                             stream_cases, same=_state_close)


def check_merge(fn: Callable) -> bool:
    """fn(state_a, state_b) -> the state of both sets of keys; a state is (m, l, acc [D])."""
    rng = np.random.default_rng(15)
    cases = []
    for n, D, scale in ((3, 2, 1.0), (64, 8, 5.0), (300, 16, 40.0)):
        scores, values = rng.standard_normal(n) * scale, rng.standard_normal((n, D))
        for cut in sorted({1, n // 3, n - 1}):
            a, b = _state_of(scores[:cut], values[:cut]), _state_of(scores[cut:], values[cut:])
            cases.append(((a, b), _state_of(scores, values)))
    empty = _state_of(np.zeros(0), np.zeros((0, 4)))
    full = _state_of(np.array([0.5, -1.0]), np.array([[1.0, 2, 3, 4], [4.0, 3, 2, 1]]))
    cases += [((empty, full), full), ((full, empty), full), ((empty, empty), empty)]

    def unguarded(a, b):
        with np.errstate(invalid="ignore"):
            m = max(a[0], b[0])
            w1, w2 = np.exp(a[0] - m), np.exp(b[0] - m)
            return m, a[1] * w1 + b[1] * w2, a[2] * w1 + b[2] * w2
    hints = [("both states are empty: exp(-inf - (-inf)) is NaN; return the empty state as it is",
              lambda a, b: unguarded(a, b) if a[0] == b[0] == -math.inf else None),
             ("the two states were added without rescaling each to the common max",
              lambda a, b: (max(a[0], b[0]), a[1] + b[1], a[2] + b[2])),
             ("the outputs acc/l were averaged; weight each state by its share of the total l",
              lambda a, b: (max(a[0], b[0]), 1.0, (a[2] / a[1] + b[2] / b[1]) / 2))]
    return check_cases("merge", fn, cases, hints=hints, same=_state_close)


# ----------------------------------------------------------------------------------------------
# GPU track: the KV write and a first paged-attention decode kernel
# (kernels_cu/exercises/kv_write.cu, kernels_cu/exercises/paged_attention.cu)
# ----------------------------------------------------------------------------------------------

def _kv_write_kernel_case(rng, Hq: int, Hkv: int, D: int, T: int, pages: int, page_size: int, threads: int):
    from engine.exercises.cuda_check import Case, bf16_values
    q_dim, kv_dim = Hq * D, Hkv * D
    slots = pages * page_size
    qkv_bits, qkv = bf16_values(rng, (T, q_dim + 2 * kv_dim))       # [T, q_dim + 2 kv_dim]
    slot_mapping = rng.permutation(slots)[:T].astype(np.int32)       # [T], shuffled: pages are anywhere

    def cache(k_cols, v_cols, rows=slot_mapping):
        out = np.full((2 * slots, kv_dim), np.nan, dtype=np.float32)  # [k slots | v slots, kv_dim]; NaN = untouched
        out[rows] = qkv[:, k_cols]
        out[slots + rows] = qkv[:, v_cols]
        return out

    k_cols, v_cols = np.arange(q_dim, q_dim + kv_dim), np.arange(q_dim + kv_dim, q_dim + 2 * kv_dim)
    hints = [("k and v are swapped", cache(v_cols, k_cols)),
             ("the q heads were copied: k starts q_dim values into the row",
              cache(np.arange(kv_dim), np.arange(kv_dim, 2 * kv_dim)))]
    return Case(f"Hq={Hq} Hkv={Hkv} D={D} T={T} into {pages} pages of {page_size}, {threads} threads", (T,), threads,
                {"qkv": qkv_bits, "slot_mapping": slot_mapping},
                lambda d: (d["qkv"], d["slot_mapping"], d["out"][:slots], d["out"][slots:], np.int32(q_dim),
                           np.int32(kv_dim)),
                "bf16", cache(k_cols, v_cols), hints, exact=True, nbytes=T * kv_dim * 2 * 2 * 2)


def _kv_write_kernel_cases():
    rng = np.random.default_rng(110)
    return [_kv_write_kernel_case(rng, *c) for c in
            ((4, 2, 16, 5, 4, 3, 128), (9, 3, 64, 37, 10, 16, 32), (32, 8, 64, 129, 20, 16, 128),
             (1, 1, 2, 1, 1, 5, 128))]


def check_kv_write_kernel(source=None) -> bool | None:
    """GPU track: your kv_write kernel (default: kernels_cu/exercises/kv_write.cu; or a path, or the CUDA
    source text) against the reference, with the likely mistake named and its GB/s."""
    from engine.exercises.cuda_check import Exercise, check_kernel
    timing = lambda: _kv_write_kernel_case(np.random.default_rng(111), 32, 8, 64, 2047, 200, 16, 128)  # noqa: E731
    return check_kernel(Exercise("kv_write kernel", "kv_write.cu", "kv_write", "kv_write", _kv_write_kernel_cases,
                                 timing), source)


def _paged_kernel_case(rng, Hq: int, Hkv: int, D: int, ctxs: list, page_size: int, reference: bool = True):
    from engine.exercises.cuda_check import Case, bf16_values
    from engine.ops.paged_attention import paged_attention_ref
    S, G = len(ctxs), Hq // Hkv
    per_seq = max(-(-c // page_size) for c in ctxs)                  # pages per sequence (table width)
    pages = S * per_seq + 3
    order = rng.permutation(pages).astype(np.int32)                  # shuffled pages
    tables = order[:S * per_seq].reshape(S, per_seq).copy()          # [S, per_seq]
    kc_bits, kc = bf16_values(rng, (pages, page_size, Hkv, D))
    vc_bits, vc = bf16_values(rng, (pages, page_size, Hkv, D))
    qkv_bits, qkv = bf16_values(rng, (S, (Hq + 2 * Hkv) * D))       # one decode row per sequence
    q = qkv[:, :Hq * D].reshape(S, Hq, D)
    seq_idx = np.arange(S, dtype=np.int32)
    positions = np.array(ctxs, dtype=np.int32) - 1
    scale = D ** -0.5

    def attend(q=q, tables=tables, scale=scale, head_of=None):
        if not reference:
            return np.zeros((S, Hq * D), np.float32)
        if head_of is None:
            return paged_attention_ref(q, kc, vc, tables, seq_idx, positions, scale).reshape(S, -1)
        order_ = np.argsort(head_of, kind="stable")                  # query heads grouped by the KV head they read
        out = np.empty((S, Hq, D), np.float32)
        out[:, order_] = paged_attention_ref(q[:, order_], kc, vc, tables, seq_idx, positions, scale)
        return out.reshape(S, -1)

    in_order = (np.arange(S)[:, None] * per_seq + np.arange(per_seq)[None, :]).astype(np.int32)
    hints = [] if not reference else [
        ("the scale 1/sqrt(D) is missing (or applied twice)", attend(scale=1.0)),
        ("the page table is ignored: key j is not at slot j (the pages of a sequence are anywhere in the cache)",
         attend(tables=in_order)),
        ("query head h read KV head h % Hkv; heads sharing a KV head are consecutive: h / GROUP",
         attend(head_of=np.arange(Hq) % Hkv))]
    unused = np.zeros(1, np.float32)
    return Case(f"Hq={Hq} Hkv={Hkv} D={D} contexts {ctxs if S <= 6 else f'{ctxs[0]} x {S}'} in pages of {page_size}",
                (S, Hkv, 1), 32 * NWARPS,
                {"qkv": qkv_bits, "k": kc_bits, "v": vc_bits, "tables": tables, "seq": seq_idx, "pos": positions,
                 "unused": unused},
                lambda d: (d["qkv"], np.int64(qkv.shape[1]), d["k"], d["v"], d["tables"], np.int32(per_seq), d["seq"],
                           d["pos"], np.int32(page_size), np.int32(Hkv), np.float32(scale * np.log2(np.e)), d["out"],
                           np.int64(Hq * D), d["unused"], d["unused"]),
                "bf16", attend(), hints, defines={"HEAD_DIM": D, "GROUP": G, "NWARPS": NWARPS},
                nbytes=sum(ctxs) * Hkv * D * 2 * 2)


def _paged_kernel_cases():
    rng = np.random.default_rng(112)
    return [_paged_kernel_case(rng, *c) for c in
            ((4, 4, 64, [17, 33, 100, 2], 16), (8, 1, 32, [31, 16, 2], 7), (12, 3, 64, [500], 16),
             (6, 2, 128, [257, 64], 5), (2, 1, 16, [3, 40], 4), (32, 8, 64, [70, 129, 1], 16))]


def check_paged_attention_kernel(source=None) -> bool | None:
    """GPU track: your paged_attention decode kernel (default: kernels_cu/exercises/paged_attention.cu;
    or a path, or the CUDA source text) against the reference, with the mistake named and its GB/s
    beside the engine's pipelined kernel on 64 sequences of 2,048 keys."""
    from engine.exercises.cuda_check import Exercise, check_kernel
    timing = lambda: _paged_kernel_case(np.random.default_rng(113), 32, 8, 64, [2048] * 64, 16,  # noqa: E731
                                        reference=False)
    return check_kernel(Exercise("paged_attention kernel", "paged_attention.cu", "paged_attention", "paged_attention",
                                 _paged_kernel_cases, timing), source)


# ----------------------------------------------------------------------------- write the page allocator yourself

class PageAllocatorSkeleton(PageAllocator):
    """engine.runtime.kv_allocator.PageAllocator with reserve, free and rollback left to you (no page
    is shared between sequences here: chapter 15's prefix caching adds that, and it is off while your
    allocator runs).

    The state (all yours to change):
      self.free_list   the free pages, a FreeQueue: .head is the first free page (-1 when none),
                       .remove(page) takes a page out, .append(page) puts one at the tail,
                       .insert_after(-1, page) puts one back at the head; len() and iteration work
      self.tables      {seq_id: [page, page, ...]} the page table of every sequence holding pages
      self.refs        one count per page: how many tables hold it (0 when free, 1 when in a table)
      self.journal     a list for your undo records since the last commit (commit() clears it)
    Tools: self.pages_needed(n_tokens) = ceil(n / page_size); self.can_reserve(seq_id, new_len).

      reserve(seq_id, new_len) -> list[int]
          Grow seq's table (a new one if it has none) to cover positions < new_len, taking pages from
          the HEAD of the free list; return the pages just taken, in order (maybe []). If it cannot
          (self.can_reserve is False), raise OutOfPages and change nothing. Record what rollback()
          needs to undo it.
      free(seq_id)
          Give all of seq's pages back to the TAIL of the free list, the LAST page of the table first
          (a prefix outlives its tail there), and forget its table. A sequence without a table: raise
          AllocatorError. Record it for rollback().
      rollback()
          Undo every reserve and free since the last commit, newest first, so that the free list
          (same order!), the tables and the counts are exactly what they were at the last commit.
    """

    @property
    def free_list(self):
        return self._free

    @property
    def tables(self) -> dict[int, list[int]]:
        return self._tables

    @property
    def refs(self) -> list[int]:
        return self._refs

    @property
    def journal(self) -> list:
        return self._journal

    def pages_needed(self, n_tokens: int) -> int:
        return super().pages_needed(n_tokens)

    def reserve(self, seq_id: int, new_len: int) -> list[int]:
        raise NotImplementedError

    def free(self, seq_id: int) -> None:
        raise NotImplementedError

    def rollback(self) -> None:
        raise NotImplementedError


def _allocator_scripts(seed: int):
    """(num_pages, page_size, operations): reserve/free/commit/rollback, including ones that must fail."""
    rng = np.random.default_rng(seed)
    yield 6, 4, [("reserve", 0, 5), ("reserve", 1, 3), ("commit",), ("reserve", 0, 9), ("free", 1),
                 ("reserve", 2, 12), ("rollback",), ("reserve", 0, 30), ("free", 7), ("free", 0), ("commit",)]
    for _ in range(40):
        ops: list[tuple] = []              # (name, *arguments)
        lengths: dict[int, int] = {}        # sequence -> tokens reserved so far
        for _ in range(int(rng.integers(5, 30))):
            kind = rng.choice(["reserve", "reserve", "reserve", "free", "commit", "rollback"])
            seq = int(rng.integers(0, 5))
            if kind == "reserve":
                lengths[seq] = lengths.get(seq, 0) + int(rng.integers(1, 20))
                ops.append(("reserve", seq, lengths[seq]))
            elif kind == "free":
                lengths.pop(seq, None)
                ops.append(("free", seq))
            else:
                ops.append((str(kind),))
        yield int(rng.integers(3, 20)), int(rng.choice([1, 4, 16])), ops


def _apply(allocator, op) -> str:
    """Run one operation; what it returned or raised, as text."""
    from engine.runtime.kv_allocator import AllocatorError, OutOfPages
    try:
        result = getattr(allocator, op[0])(*op[1:])
    except OutOfPages:
        return "raised OutOfPages"
    except AllocatorError:
        return "raised AllocatorError"
    return f"returned {result!r}"


def check_page_allocator(cls: type, model_dir=None) -> bool:
    """Your PageAllocatorSkeleton subclass behaves exactly like the engine's PageAllocator on ~40 scripts
    of reserve/free/commit/rollback (results, errors, free list order, tables and counts after every
    step), then runs engine.LLM (paged cache, preemptions) with the same step log and tokens as the
    engine's."""
    from engine.exercises.serving_check import tiny_model_dir
    title = "page_allocator"
    count = 0
    for num_pages, page_size, ops in _allocator_scripts(3):
        engine_alloc = PageAllocator(num_pages, page_size)
        ok, yours = call_learner(title, f"{cls.__name__}({num_pages}, {page_size})", cls, num_pages, page_size)
        if not ok:
            return False
        for i, op in enumerate(ops):
            call = f"{op[0]}({', '.join(map(str, op[1:]))})"
            want = _apply(engine_alloc, op)
            ok, got = call_learner(title, call, _apply, yours, op)
            if not ok:
                return False
            if got != want or yours.snapshot() != engine_alloc.snapshot():
                done = "; ".join(f"{o[0]}{o[1:] if len(o) > 1 else ''}" for o in ops[:i])
                print(f"[x] {title}: operation {i}, {call}, on a pool of {num_pages} pages of {page_size} "
                      f"(after: {done or 'nothing'}):\n    yours {got}, state {yours.snapshot()}\n"
                      f"    the engine's {want}, state {engine_alloc.snapshot()}")
                return False
        count += 1
    print(f"[OK] {title}: the same results and states as the engine's on all {count} scripts")
    return check_allocator_in_llm(title, cls, model_dir or tiny_model_dir(), *_tiny_requests(), kv_cache_mib=0.05)


def check_allocator_in_llm(title: str, cls: type, model_dir, prompts, params, *, kv_cache_mib: float,
                           max_seqs: int = 4, show_text: bool = False) -> bool:
    """engine.LLM (NumPy, paged, on-demand admission, prefix caching off) with your allocator class and
    with the engine's: the same step log, the same tokens for every request (serving_check.check_llm_with)."""
    from engine.exercises.serving_check import check_llm_with
    return check_llm_with(title, model_dir, prompts, params, kv_cache_mib=kv_cache_mib, admission="on_demand",
                          max_seqs=max_seqs, show_text=show_text, allocator_cls=cls)


def check_allocator_in_default_model(cls: type, max_new_tokens: int = 16) -> bool:
    """The default model (SmolLM2) answers three chat prompts through engine.LLM with your allocator, in a
    pool too small for all three at once; the same steps and tokens as with the engine's allocator."""
    from engine.exercises.serving_check import default_chat_prompts, default_params
    model_dir, prompts = default_chat_prompts()
    return check_allocator_in_llm("your page allocator", cls, model_dir, prompts,
                                  default_params(len(prompts), max_new_tokens), kv_cache_mib=5.0, show_text=True)


def _tiny_requests():
    rng = np.random.default_rng(9)
    prompts = [rng.integers(3, 390, int(n)).tolist() for n in (30, 12, 25, 40, 9)]
    params = [SamplingParams(max_new_tokens=int(n), ignore_eos=True) for n in (40, 30, 35, 20, 45)]
    return prompts, params
