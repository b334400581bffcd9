"""Chapter 06 exercises: a stable softmax, the GQA head mapping, causal attention, KV memory."""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from engine.exercises import check_cases
from engine.exercises.ch03 import run_array_checks
from engine.ops.attention import causal_attention_ref, softmax


def check_softmax(fn: Callable) -> bool:
    """fn(x) -> softmax along the last axis; must survive large scores and -inf (masked) entries."""
    rng = np.random.default_rng(0)
    cases = [rng.standard_normal((3, 5), dtype=np.float32),
             np.array([[1000.0, 999.0, 998.0], [-1000.0, -1001.0, -1002.0]], dtype=np.float32),
             np.array([[0.5, -np.inf, -np.inf], [0.1, 0.2, -np.inf], [1.0, 2.0, 3.0]], dtype=np.float32),
             rng.standard_normal((2, 4, 7), dtype=np.float32) * 30,
             np.zeros((1, 6), dtype=np.float32)]
    hints = [("the sum is over the wrong axis (use the last one, axis=-1)",
              lambda x: np.exp(x - x.max()) / np.exp(x - x.max()).sum(axis=0, keepdims=True))]
    return run_array_checks("softmax", fn, [((x,), softmax(x)) for x in cases], rtol=1e-5, atol=1e-7, hints=hints)


def check_kv_head_of(fn: Callable[[int, int, int], int]) -> bool:
    """fn(h, n_heads, n_kv_heads) -> the KV head that query head h reads (h // (n_heads / n_kv_heads))."""
    cases = [((h, nq, nkv), h // (nq // nkv))
             for nq, nkv in ((8, 8), (9, 3), (32, 8), (4, 1), (6, 2), (12, 4)) for h in range(nq)]
    hints = [("h % n_kv_heads deals the query heads out round-robin; GQA gives each KV head a block of "
              "n_heads / n_kv_heads consecutive query heads: h // (n_heads / n_kv_heads)", lambda h, nq, nkv: h % nkv),
             ("h // n_kv_heads divides by the number of KV heads; divide by the group size n_heads / n_kv_heads",
              lambda h, nq, nkv: h // nkv)]
    return check_cases("kv_head_of", fn, cases, same=lambda got, want: int(got) == want, hints=hints)


def _repeat_kv_attention(q, k, v, scale, kv_index):
    """Attention with K/V heads copied out per query head via kv_index(h, Hq, Hkv)."""
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    idx = [kv_index(h, Hq, Hkv) for h in range(Hq)]
    return causal_attention_ref(q, k[:, idx], v[:, idx], scale)


def _masked(q, k, v, scale, offset: int, empty_rows: float = np.nan):
    """Attention with key s allowed for query t when s <= t + offset (offset 0 is the causal mask);
    a query with no allowed key gets `empty_rows` (NaN: softmax over nothing; 0: a guarded softmax)."""
    T, Hq, _ = q.shape
    r = Hq // k.shape[1]
    kk, vv = np.repeat(k, r, axis=1), np.repeat(v, r, axis=1)
    s = np.einsum("thd,shd->hts", q, kk) * scale
    allowed = np.tril(np.ones((T, T), dtype=bool), k=offset)
    s = np.where(allowed, s, -np.inf)
    m = np.max(s, axis=-1, keepdims=True)
    e = np.exp(s - np.where(np.isfinite(m), m, 0))
    some = np.asarray(allowed.any(-1))                   # [T] rows with at least one key allowed
    p = e / np.where(some[None, :, None], e.sum(-1, keepdims=True), 1)
    out = np.einsum("hts,shd->thd", p, vv)
    out[~some] = empty_rows
    return out


def _no_mask(q, k, v, scale):
    T, Hq, _ = q.shape
    r = Hq // k.shape[1]
    kk, vv = np.repeat(k, r, axis=1), np.repeat(v, r, axis=1)
    p = softmax(np.einsum("thd,shd->hts", q, kk) * scale)
    return np.einsum("hts,shd->thd", p, vv)


def check_causal_attention(fn: Callable) -> bool:
    """fn(q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D], scale) -> [T, Hq, D], causal, GQA."""
    rng = np.random.default_rng(1)
    cases = []
    for T, Hq, Hkv, D in ((1, 1, 1, 4), (4, 2, 2, 8), (7, 6, 2, 16), (5, 9, 3, 64), (9, 8, 2, 32), (6, 4, 1, 12)):
        q, k, v = (rng.standard_normal((T, H, D), dtype=np.float32) for H in (Hq, Hkv, Hkv))
        scale = D ** -0.5
        cases.append(((q, k, v, scale), causal_attention_ref(q, k, v, scale)))
    hints = [("query head h read KV head h % n_kv_heads; with GQA it is h // (n_heads / n_kv_heads)",
              lambda q, k, v, s: _repeat_kv_attention(q, k, v, s, lambda h, nq, nkv: h % nkv)),
             ("the causal mask is missing: token t may only attend to tokens 0..t", _no_mask),
             ("the causal mask excludes the diagonal: token t attends to tokens 0..t, itself included "
              "(keep s <= t, np.tril(..., k=0); mask only s > t)", lambda q, k, v, s: _masked(q, k, v, s, -1)),
             ("the causal mask excludes the diagonal: token t attends to tokens 0..t, itself included "
              "(keep s <= t, np.tril(..., k=0); mask only s > t)", lambda q, k, v, s: _masked(q, k, v, s, -1, 0.0)),
             ("the causal mask is off by one: token t saw token t + 1 (keep s <= t, np.tril(..., k=0))",
              lambda q, k, v, s: _masked(q, k, v, s, 1)),
             ("the scores were not multiplied by scale (1/sqrt(D))",
              lambda q, k, v, s: causal_attention_ref(q, k, v, 1.0)),
             ("the softmax ran over the queries (axis -2) instead of over the keys (axis -1)",
              lambda q, k, v, s: _softmax_over_queries(q, k, v, s))]
    return run_array_checks("causal_attention", fn, cases, rtol=1e-4, atol=1e-5, hints=hints)


def _softmax_over_queries(q, k, v, scale):
    T, Hq, _ = q.shape
    r = Hq // k.shape[1]
    kk, vv = np.repeat(k, r, axis=1), np.repeat(v, r, axis=1)
    s = np.einsum("thd,shd->hts", q, kk) * scale
    s = np.where(np.tril(np.ones((T, T), dtype=bool)), s, -np.inf)
    return np.einsum("hts,shd->thd", softmax(s, axis=-2), vv)


def check_kv_bytes_per_token(fn: Callable[[int, int, int, int], int]) -> bool:
    """fn(n_layers, n_kv_heads, head_dim, bytes_per_value) -> bytes of K and V one token adds to the cache."""
    shapes = ((16, 8, 64, 2), (16, 32, 64, 2), (16, 1, 64, 2), (30, 3, 64, 2), (30, 3, 64, 4), (32, 8, 128, 2),
              (80, 8, 128, 1), (1, 1, 1, 1))
    cases = [(s, 2 * s[0] * s[1] * s[2] * s[3]) for s in shapes]
    return check_cases("kv_bytes_per_token", fn, cases, same=lambda got, want: got == want)
