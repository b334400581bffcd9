"""Every op's NumPy reference against an independent formulation of the same math.

The oracles are written differently on purpose: attention as explicit loops over heads with K/V
repeated per query head (float64), RoPE as complex multiplication of interleaved pairs (Meta's
original layout) after undoing the rotate-half permutation, RMSNorm and SwiGLU in float64, llama3
frequency scaling re-derived piecewise from the published formula, bf16 rounding by comparing the
two neighbouring bf16 values. Shapes are awkward on purpose (not powers of two, GQA ratios 1, 3, 4).
"""
import copy
import math

import numpy as np
import pytest
from helpers.oracle import FIXTURES, needs_transformers
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.backend import (
    BackendError,
    bf16_to_f32,
    cupy_unavailable_reason,
    f32_to_bf16,
    resolve_backend,
    round_to_bf16,
)
from engine.formats.config import config_from_dict
from engine.model.random_model import PRESETS
from engine.ops.argmax import argmax_rows
from engine.ops.attention import causal_attention_ref, prefill_attention, softmax
from engine.ops.embedding import embedding, embedding_ref
from engine.ops.kv_write import kv_write, kv_write_ref
from engine.ops.linear import linear, linear_ref
from engine.ops.paged_attention import paged_attention, paged_attention_ref
from engine.ops.rmsnorm import add_rmsnorm, add_rmsnorm_ref, rmsnorm, rmsnorm_ref
from engine.ops.rope import rope_inv_freq, rope_qkv, rope_ref, rope_tables
from engine.ops.swiglu import swiglu, swiglu_ref

# (query heads, KV heads): GQA ratios 1, 3, 4, and MQA with 3 and 4 query heads
HEADS = [(5, 5), (6, 2), (9, 3), (8, 2), (3, 1), (4, 1)]
LLAMA3_CONFIGS = {
    "llama-3.2-1b": PRESETS["llama-3.2-1b"],
    "tiny": PRESETS["tiny"],
    "odd": {**PRESETS["tiny"], "hidden_size": 56, "num_attention_heads": 8, "num_key_value_heads": 2,
            "head_dim": 10, "rope_theta": 10000.0,
            "rope_scaling": {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 8.0, "original_max_position_embeddings": 64}},
    "no-scaling": {**PRESETS["tiny-mqa"]},
}


def make_config(Hq, Hkv, D, **overrides):
    return config_from_dict({**PRESETS["tiny"], "num_attention_heads": Hq, "num_key_value_heads": Hkv,
                             "head_dim": D, "hidden_size": 12 * Hq, **overrides})


def randn(rng, *shape, scale=1.0):
    return (scale * rng.standard_normal(shape)).astype(np.float32)


# ---- embedding, linear, argmax, softmax --------------------------------------------------------

def test_embedding_is_a_one_hot_product():
    rng = np.random.default_rng(0)
    table = randn(rng, 37, 13)                                  # [V, H]
    ids = np.array([5, 0, 36, 5, 17, 17, 2], dtype=np.int32)    # repeats, unsorted, both ends
    one_hot = np.eye(37)[ids]                                   # [T, V]
    out = embedding_ref(ids, table)
    assert out.dtype == np.float32 and out.shape == (7, 13)
    np.testing.assert_array_equal(out, one_hot @ table.astype(np.float64))
    np.testing.assert_array_equal(embedding(ids.tolist(), table), out)


@pytest.mark.parametrize("T,K,N", [(1, 7, 5), (13, 72, 100), (5, 129, 31)])
def test_linear_is_x_times_w_transposed(T, K, N):
    rng = np.random.default_rng(T * K)
    x, w = randn(rng, T, K), randn(rng, N, K)                  # w stored [out, in] like nn.Linear
    expected = np.einsum("tk,nk->tn", x.astype(np.float64), w.astype(np.float64))
    np.testing.assert_allclose(linear_ref(x, w), expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(linear(x, w), linear_ref(x, w))


def test_argmax_rows_takes_the_first_index_on_ties():
    logits = np.array([[1, 3, 3, 0], [-5, -5, -5, -5], [0, 0, 0, 7], [2, -np.inf, 2, 1]], dtype=np.float32)
    out = argmax_rows(logits)
    assert out.dtype == np.int32
    expected = [max(range(4), key=lambda i: (row[i], -i)) for row in logits]
    np.testing.assert_array_equal(out, expected)


def test_softmax_is_stable_and_masks():
    x = np.array([[1000.0, 999.0, -np.inf], [-1e4, -1e4 - 1, -1e4 - 2]], dtype=np.float32)
    p = softmax(x)
    assert np.all(np.isfinite(p)) and p[0, 2] == 0
    e = np.exp(np.array([0.0, -1.0, -2.0]))
    np.testing.assert_allclose(p[1], e / e.sum(), rtol=1e-6)
    np.testing.assert_allclose(p.sum(-1), 1, rtol=1e-6)


# ---- RMSNorm and SwiGLU --------------------------------------------------------------------

def rmsnorm_f64(x, w, eps):
    x = x.astype(np.float64)
    return x / np.sqrt(np.mean(x ** 2, axis=-1, keepdims=True) + eps) * w


@pytest.mark.parametrize("H", [1, 50, 72, 137, 576])
@pytest.mark.parametrize("scale", [1e-3, 1.0, 300.0])
def test_rmsnorm_matches_float64(H, scale):
    rng = np.random.default_rng(H)
    x, w = randn(rng, 7, H, scale=scale), (1 + randn(rng, H, scale=0.1))
    eps = 1e-5
    out = rmsnorm_ref(x, w, eps)
    assert out.dtype == np.float32 and out.shape == x.shape
    np.testing.assert_allclose(out, rmsnorm_f64(x, w, eps), rtol=2e-6, atol=1e-6)
    np.testing.assert_array_equal(rmsnorm(x, w, eps), out)


def test_rmsnorm_eps_matters_for_tiny_inputs():
    x = np.full((1, 8), 1e-4, dtype=np.float32)
    w = np.ones(8, dtype=np.float32)
    np.testing.assert_allclose(rmsnorm_ref(x, w, 1e-6), rmsnorm_f64(x, w, 1e-6), rtol=1e-6)
    assert rmsnorm_ref(x, w, 1e-6)[0, 0] < 0.995       # 1e-4 / sqrt(1e-8 + 1e-6), not 1


def test_add_rmsnorm_updates_the_residual_in_place():
    rng = np.random.default_rng(3)
    residual, delta, w = randn(rng, 5, 72), randn(rng, 5, 72), randn(rng, 72)
    before = residual.copy()
    for fn in (add_rmsnorm_ref, add_rmsnorm):
        residual[:] = before
        out = fn(residual, delta, w, 1e-5)
        np.testing.assert_array_equal(residual, before + delta)   # the stream itself, exactly
        np.testing.assert_allclose(out, rmsnorm_f64(before + delta, w, 1e-5), rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("T,I", [(1, 1), (9, 77), (4, 136)])
def test_swiglu_matches_float64(T, I):
    rng = np.random.default_rng(I)
    gate_up = randn(rng, T, 2 * I, scale=4.0)                  # [T, 2I]: gate columns, then up
    g, u = gate_up[:, :I].astype(np.float64), gate_up[:, I:].astype(np.float64)
    sigmoid = 0.5 * (1 + np.tanh(g / 2))                       # another way to write 1 / (1 + e^-g)
    out = swiglu_ref(gate_up)
    assert out.shape == (T, I) and out.dtype == np.float32
    np.testing.assert_allclose(out, g * sigmoid * u, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(swiglu(gate_up), out)


def test_swiglu_limits_are_finite():
    gate_up = np.array([[-100.0, -20.0, 0.0, 20.0, 80.0, 1.0, 1.0, 1.0, 1.0, 1.0]], dtype=np.float32)
    with np.errstate(over="ignore"):   # exp(100) overflows to inf in float32; silu is then exactly -0
        out = swiglu_ref(gate_up)[0]
    np.testing.assert_allclose(out, [0.0, -20 / (1 + math.exp(20)), 0.0, 20 / (1 + math.exp(-20)), 80.0],
                               rtol=1e-6, atol=1e-12)


# ---- RoPE --------------------------------------------------------------------------------------

def rope_complex(x, angles):
    """x [T, n, D] in rotate-half layout, angles [T, D/2] -> rotated, via complex pairs (float64).

    Rotate-half pairs element i with element i + D/2. Permute to the interleaved layout of Meta's
    original code (x0, x_{D/2}, x1, x_{D/2+1}, ...), read consecutive pairs as complex numbers,
    multiply by e^{i angle}, and permute back.
    """
    T, n, D = x.shape
    half = D // 2
    interleave = np.stack([np.arange(half), np.arange(half) + half], axis=-1).reshape(-1)   # [D]
    pairs = x.astype(np.float64)[..., interleave].reshape(T, n, half, 2)
    z = (pairs[..., 0] + 1j * pairs[..., 1]) * np.exp(1j * angles)[:, None, :]           # [T, n, D/2]
    out = np.empty((T, n, D))
    out[..., interleave] = np.stack([z.real, z.imag], axis=-1).reshape(T, n, D)
    return out


@pytest.mark.parametrize("D", [2, 10, 16, 64])
def test_rope_ref_is_complex_rotation(D):
    rng = np.random.default_rng(D)
    config = make_config(4, 2, D)
    cos, sin = rope_tables(config, 200)                       # [P, D/2]
    positions = np.array([0, 1, 199, 7, 7, 63, 64, 150], dtype=np.int64)   # unsorted, repeated
    x = randn(rng, len(positions), 3, D)
    angles = np.arctan2(sin[positions], cos[positions]).astype(np.float64)
    out = rope_ref(x, positions, cos, sin)
    np.testing.assert_allclose(out, rope_complex(x, angles), rtol=1e-5, atol=1e-6)
    # a rotation: every pair keeps its length
    def norms(y):
        return np.hypot(y[..., :D // 2], y[..., D // 2:])
    np.testing.assert_allclose(norms(out), norms(x), rtol=1e-5)


def llama3_inv_freq_published(D, theta, rope_scaling):
    """Llama 3.1's frequency scaling, written out per frequency from the published formula."""
    if rope_scaling is None:
        return np.array([theta ** (-i / D) for i in range(0, D, 2)])
    factor, low, high = rope_scaling["factor"], rope_scaling["low_freq_factor"], rope_scaling["high_freq_factor"]
    old_context = rope_scaling["original_max_position_embeddings"]
    out = []
    for i in range(0, D, 2):
        freq = theta ** (-i / D)
        wavelen = 2 * math.pi / freq
        if wavelen < old_context / high:            # high frequency: kept
            out.append(freq)
        elif wavelen > old_context / low:           # low frequency: slowed down by `factor`
            out.append(freq / factor)
        else:                                       # in between: blend the two smoothly
            smooth = (old_context / wavelen - low) / (high - low)
            out.append((1 - smooth) * freq / factor + smooth * freq)
    return np.array(out)


@pytest.mark.parametrize("name", LLAMA3_CONFIGS)
def test_rope_inv_freq_matches_published_llama3_formula(name):
    d = LLAMA3_CONFIGS[name]
    config = config_from_dict(d)
    inv_freq = rope_inv_freq(config)
    assert inv_freq.dtype == np.float32 and inv_freq.shape == (config.head_dim // 2,)
    np.testing.assert_allclose(inv_freq, llama3_inv_freq_published(config.head_dim, config.rope_theta,
                                                                   d.get("rope_scaling")), rtol=2e-6)


def test_llama3_test_configs_reach_every_branch():
    """The formula has three regimes; the configs above must exercise each of them."""
    for name in ("llama-3.2-1b", "tiny", "odd"):
        config = config_from_dict(LLAMA3_CONFIGS[name])
        rs = config.rope_scaling
        plain = llama3_inv_freq_published(config.head_dim, config.rope_theta, None)
        wavelen = 2 * math.pi / plain
        high = wavelen < rs.original_max_position_embeddings / rs.high_freq_factor
        low = wavelen > rs.original_max_position_embeddings / rs.low_freq_factor
        assert high.any() and low.any() and (~high & ~low).any(), name


@pytest.mark.parametrize("name", ["tiny", "odd"])
def test_rope_tables_are_cos_sin_of_position_times_frequency(name):
    config = config_from_dict(LLAMA3_CONFIGS[name])
    P = 300
    cos, sin = rope_tables(config, P)
    assert cos.shape == sin.shape == (P, config.head_dim // 2) and cos.dtype == np.float32
    angles = np.arange(P)[:, None] * rope_inv_freq(config).astype(np.float64)[None, :]
    # float32 angles are exact only to ~1 ulp of the angle itself
    tol = 4 * P * 2.0 ** -24
    np.testing.assert_allclose(cos, np.cos(angles), atol=tol)
    np.testing.assert_allclose(sin, np.sin(angles), atol=tol)


@settings(max_examples=40, deadline=None)
@given(m=st.integers(0, 120), n=st.integers(0, 120), shift=st.integers(0, 120), seed=st.integers(0, 2**16))
def test_rope_scores_depend_only_on_relative_position(m, n, shift, seed):
    config = config_from_dict(LLAMA3_CONFIGS["tiny"])
    cos, sin = rope_tables(config, 256)
    rng = np.random.default_rng(seed)
    q, k = randn(rng, 1, 1, config.head_dim), randn(rng, 1, 1, config.head_dim)
    def score(a, b):
        return float(np.sum(rope_ref(q, np.array([a]), cos, sin) * rope_ref(k, np.array([b]), cos, sin)))
    assert score(m, n) == pytest.approx(score(m + shift, n + shift), abs=2e-4 * (1 + abs(score(m, n))))


@pytest.mark.parametrize("Hq,Hkv", HEADS[:3])
def test_rope_qkv_rotates_q_and_k_and_leaves_v(Hq, Hkv):
    rng = np.random.default_rng(Hq)
    D = 12
    config = make_config(Hq, Hkv, D)
    cos, sin = rope_tables(config, 64)
    positions = np.array([3, 0, 63, 10, 10], dtype=np.int32)
    qkv = randn(rng, 5, (Hq + 2 * Hkv) * D)                            # [T, (Hq + 2Hkv) D]
    out = rope_qkv(qkv, positions, cos, sin, config).reshape(5, Hq + 2 * Hkv, D)
    heads = qkv.reshape(5, Hq + 2 * Hkv, D)
    angles = np.arctan2(sin[positions], cos[positions]).astype(np.float64)
    np.testing.assert_allclose(out[:, :Hq + Hkv], rope_complex(heads[:, :Hq + Hkv], angles), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(out[:, Hq + Hkv:], heads[:, Hq + Hkv:])


@needs_transformers
@pytest.mark.parametrize("name", ["llama-3.2-1b", "tiny", "odd", "no-scaling"])
def test_rope_matches_transformers_live(name):
    import torch
    import transformers
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    d = LLAMA3_CONFIGS[name]
    config = config_from_dict(d)
    rotary = LlamaRotaryEmbedding(transformers.LlamaConfig(**copy.deepcopy(d)))   # it edits nested dicts in place
    # float32 pow differs by up to an ulp between NumPy and torch, so neither side is bit-exact
    np.testing.assert_allclose(rope_inv_freq(config), rotary.inv_freq.numpy(), rtol=3e-7)
    P = 500
    positions = torch.arange(0, P, 7)
    hf_cos, hf_sin = rotary(torch.zeros(1, 1, dtype=torch.float32), positions[None])   # [1, P, D]
    cos, sin = rope_tables(config, P)
    half = config.head_dim // 2
    tol = 4 * P * 2.0 ** -24          # an ulp of inv_freq times the position, plus the angle's own ulp
    np.testing.assert_allclose(cos[positions.numpy()], hf_cos[0, :, :half].numpy(), atol=tol)
    np.testing.assert_allclose(sin[positions.numpy()], hf_sin[0, :, half:].numpy(), atol=tol)


# ---- attention -------------------------------------------------------------------------------

def attention_rows(q_rows, keys, values, contexts, scale):
    """Oracle: q_rows [R, Hq, D]; row r attends to keys/values[r][:contexts[r]] ([S, Hkv, D] each).
    Loops over rows and query heads, with K/V repeated so that query head h reads KV head h // r."""
    R, Hq, D = q_rows.shape
    out = np.zeros((R, Hq, D))
    for row in range(R):
        group = Hq // keys[row].shape[1]
        k = np.repeat(keys[row][:contexts[row]].astype(np.float64), group, axis=1)      # [ctx, Hq, D]
        v = np.repeat(values[row][:contexts[row]].astype(np.float64), group, axis=1)
        for h in range(Hq):
            scores = scale * (k[:, h] @ q_rows[row, h].astype(np.float64))              # [ctx]
            weights = np.exp(scores - scores.max())
            out[row, h] = (weights / weights.sum()) @ v[:, h]
    return out


def causal_oracle(q, k, v, scale):
    T = q.shape[0]
    return attention_rows(q, [k] * T, [v] * T, np.arange(1, T + 1), scale)


@pytest.mark.parametrize("Hq,Hkv", HEADS)
@pytest.mark.parametrize("T,D", [(1, 8), (11, 12), (26, 20)])
def test_causal_attention_matches_loops(Hq, Hkv, T, D):
    rng = np.random.default_rng(T * Hq + D)
    q, k, v = randn(rng, T, Hq, D, scale=2.0), randn(rng, T, Hkv, D, scale=2.0), randn(rng, T, Hkv, D)
    out = causal_attention_ref(q, k, v, D ** -0.5)
    assert out.dtype == np.float32 and out.shape == (T, Hq, D)
    np.testing.assert_allclose(out, causal_oracle(q, k, v, D ** -0.5), rtol=1e-5, atol=1e-5)


def test_causal_attention_survives_huge_scores():
    rng = np.random.default_rng(1)
    q, k, v = randn(rng, 9, 4, 16, scale=40.0), randn(rng, 9, 2, 16, scale=40.0), randn(rng, 9, 2, 16)
    out = causal_attention_ref(q, k, v, 0.25)
    assert np.all(np.isfinite(out))
    np.testing.assert_allclose(out, causal_oracle(q, k, v, 0.25), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("Hq,Hkv", HEADS[1:3])
def test_prefill_attention_keeps_packed_prompts_apart(Hq, Hkv):
    rng = np.random.default_rng(5)
    D = 10
    config = make_config(Hq, Hkv, D)
    cu_seqlens = np.array([0, 7, 8, 21, 30], dtype=np.int32)          # four prompts, one of one token
    qkv = randn(rng, 30, (Hq + 2 * Hkv) * D)
    out = prefill_attention(qkv, cu_seqlens, config)                    # [T, Hq*D]
    heads = qkv.reshape(30, -1, D)
    for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        q, k, v = heads[a:b, :Hq], heads[a:b, Hq:Hq + Hkv], heads[a:b, Hq + Hkv:]
        np.testing.assert_allclose(out[a:b].reshape(b - a, Hq, D), causal_oracle(q, k, v, D ** -0.5),
                                   rtol=1e-5, atol=1e-5)


# ---- KV cache writes and paged attention -------------------------------------------------------

def test_kv_write_touches_only_the_mapped_slots():
    rng = np.random.default_rng(2)
    NB, BS, Hkv, D = 5, 3, 2, 6
    k_cache, v_cache = np.full((2, NB, BS, Hkv, D), np.nan, dtype=np.float32)
    slots = np.array([14, 0, 7, 8, 3], dtype=np.int32)                 # any order, across blocks
    k, v = randn(rng, 5, Hkv, D), randn(rng, 5, Hkv, D)
    kv_write_ref(k, v, k_cache, v_cache, slots)
    for cache, src in ((k_cache, k), (v_cache, v)):
        flat = cache.reshape(NB * BS, Hkv, D)
        np.testing.assert_array_equal(flat[slots], src)
        untouched = np.setdiff1d(np.arange(NB * BS), slots)
        assert np.isnan(flat[untouched]).all()


def test_kv_write_takes_k_and_v_from_the_fused_qkv():
    rng = np.random.default_rng(4)
    Hq, Hkv, D = 6, 2, 12
    config = make_config(Hq, Hkv, D)
    qkv = randn(rng, 4, (Hq + 2 * Hkv) * D)
    k_cache, v_cache = np.zeros((2, 3, 4, Hkv, D), dtype=np.float32)
    slots = np.array([11, 2, 5, 4], dtype=np.int32)
    kv_write(qkv, slots, k_cache, v_cache, config)
    heads = qkv.reshape(4, -1, D)
    np.testing.assert_array_equal(k_cache.reshape(-1, Hkv, D)[slots], heads[:, Hq:Hq + Hkv])
    np.testing.assert_array_equal(v_cache.reshape(-1, Hkv, D)[slots], heads[:, Hq + Hkv:])


def fill_paged_cache(rng, lengths, page_size, Hkv, D, spare_blocks=3):
    """Write random K/V for sequences of `lengths` into shuffled, non-contiguous pages of a cache
    poisoned with NaN (a read of any unwritten slot shows up in the output).
    Returns (k_cache, v_cache, page_tables [S, MB] padded with -1, keys, values per sequence)."""
    pages_per_seq = [-(-n // page_size) for n in lengths]
    num_pages = sum(pages_per_seq) + spare_blocks
    order = rng.permutation(num_pages)
    k_cache, v_cache = np.full((2, num_pages, page_size, Hkv, D), np.nan, dtype=np.float32)
    tables = np.full((len(lengths), max(pages_per_seq)), -1, dtype=np.int32)
    keys, values, taken = [], [], 0
    for s, (n, pages) in enumerate(zip(lengths, pages_per_seq)):
        tables[s, :pages] = order[taken:taken + pages]
        taken += pages
        pos = np.arange(n)
        slots = tables[s][pos // page_size] * page_size + pos % page_size
        k, v = randn(rng, n, Hkv, D), randn(rng, n, Hkv, D)
        kv_write_ref(k, v, k_cache, v_cache, slots)
        keys.append(k)
        values.append(v)
    return k_cache, v_cache, tables, keys, values


@settings(max_examples=30, deadline=None)
@given(heads=st.sampled_from(HEADS), page_size=st.sampled_from([1, 3, 4, 16]),
       lengths=st.lists(st.integers(1, 37), min_size=1, max_size=4), seed=st.integers(0, 2**16))
def test_paged_attention_equals_causal_attention(heads, page_size, lengths, seed):
    """Every position of every sequence, rows shuffled across sequences, pages shuffled in the pool."""
    Hq, Hkv = heads
    D = 8
    rng = np.random.default_rng(seed)
    k_cache, v_cache, tables, keys, values = fill_paged_cache(rng, lengths, page_size, Hkv, D)
    queries = [randn(rng, n, Hq, D) for n in lengths]                  # [n, Hq, D] per sequence
    expected = [causal_attention_ref(q, k, v, D ** -0.5) for q, k, v in zip(queries, keys, values)]
    rows = [(s, p) for s, n in enumerate(lengths) for p in range(n)]
    rows = [rows[i] for i in rng.permutation(len(rows))]
    seq_idx = np.array([s for s, _ in rows], dtype=np.int32)
    positions = np.array([p for _, p in rows], dtype=np.int32)
    q = np.stack([queries[s][p] for s, p in rows])                     # [R, Hq, D]
    out = paged_attention_ref(q, k_cache, v_cache, tables, seq_idx, positions, D ** -0.5)
    np.testing.assert_allclose(out, np.stack([expected[s][p] for s, p in rows]), rtol=1e-5, atol=1e-6)

    # the dispatcher reads q from a fused QKV buffer (its k/v columns are ignored: the cache holds K/V)
    config = make_config(Hq, Hkv, D)
    qkv = np.concatenate([q.reshape(len(rows), -1), randn(rng, len(rows), 2 * Hkv * D)], axis=1)
    np.testing.assert_array_equal(
        paged_attention(qkv, k_cache, v_cache, tables, seq_idx, positions, config, max_context=64),
        out.reshape(len(rows), -1))


def test_paged_attention_against_loops_in_decode_shape():
    """One row per sequence at its last position (a decode step), GQA 4, odd head size."""
    rng = np.random.default_rng(11)
    Hq, Hkv, D, BS = 8, 2, 6, 5
    lengths = [13, 1, 26, 5]
    k_cache, v_cache, tables, keys, values = fill_paged_cache(rng, lengths, BS, Hkv, D)
    q = randn(rng, len(lengths), Hq, D)
    positions = np.array(lengths, dtype=np.int32) - 1
    out = paged_attention_ref(q, k_cache, v_cache, tables, np.arange(4, dtype=np.int32), positions, D ** -0.5)
    np.testing.assert_allclose(out, attention_rows(q, keys, values, lengths, D ** -0.5), rtol=1e-5, atol=1e-6)


# ---- bf16 on the host --------------------------------------------------------------------------

def bf16_value(bits16: np.ndarray) -> np.ndarray:
    """float64 value of bf16 patterns, reading 0x7F80/0xFF80 as +-2^128: the next step after the
    largest finite bf16, which is what round-to-nearest compares against before overflowing."""
    with np.errstate(invalid="ignore"):                                 # NaN patterns (never picked)
        values = bf16_to_f32(bits16).astype(np.float64)
    return np.where((bits16 & 0x7FFF) == 0x7F80, np.copysign(2.0 ** 128, values), values)


def bf16_oracle(f32_bits: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even by comparing the two bf16 neighbours of each (non-NaN) float32."""
    x = f32_bits.view(np.float32).astype(np.float64)
    toward_zero = (f32_bits >> 16).astype(np.uint16)                   # truncation
    away = toward_zero + np.uint16(1)                                   # next bf16 away from zero
    exact = (f32_bits & 0xFFFF) == 0
    d_lo, d_hi = np.abs(x - bf16_value(toward_zero)), np.abs(bf16_value(away) - x)
    pick_away = (d_hi < d_lo) | ((d_hi == d_lo) & (toward_zero & 1 == 1))
    return np.where(exact, toward_zero, np.where(pick_away, away, toward_zero)).astype(np.uint16)


def not_nan(bits: np.ndarray) -> np.ndarray:
    return bits[~np.isnan(bits.view(np.float32))]


def test_f32_to_bf16_on_every_top_half_and_the_critical_low_halves():
    """All 65536 top halves x low halves {0, just below a tie, tie, just above, max}."""
    tops = np.arange(2 ** 16, dtype=np.uint32) << np.uint32(16)
    bits = not_nan((tops[:, None] | np.array([0, 0x7FFF, 0x8000, 0x8001, 0xFFFF], dtype=np.uint32)).ravel())
    np.testing.assert_array_equal(f32_to_bf16(bits.view(np.float32)), bf16_oracle(bits))


@settings(max_examples=200, deadline=None)
@given(bits=st.integers(0, 2 ** 32 - 1))
def test_f32_to_bf16_random_bits(bits):
    b = np.array([bits], dtype=np.uint32)
    if np.isnan(b.view(np.float32))[0]:
        assert f32_to_bf16(b.view(np.float32))[0] == 0x7FC0
    else:
        assert f32_to_bf16(b.view(np.float32))[0] == bf16_oracle(b)[0]


@pytest.mark.parametrize("f32_bits,bf16_bits", [
    (0x3F808000, 0x3F80),   # 1 + half an ulp: tie, 0x3F80 is even -> down
    (0x3F818000, 0x3F82),   # tie with odd 0x3F81 -> up to even
    (0x3F808001, 0x3F81),   # just above the tie -> up
    (0x7F7FFFFF, 0x7F80),   # float32 max rounds past the largest bf16 -> inf
    (0x7F7F8000, 0x7F80),   # tie at the top, odd mantissa -> up -> inf
    (0x7F7F7FFF, 0x7F7F),   # just below that tie -> largest finite bf16
    (0xFF7FFFFF, 0xFF80),   # -> -inf
    (0x7F800000, 0x7F80), (0xFF800000, 0xFF80),   # infinities stay
    (0x80000000, 0x8000),   # -0 keeps its sign
    (0x00008000, 0x0000), (0x00018000, 0x0002),   # ties among subnormals
])
def test_f32_to_bf16_named_cases(f32_bits, bf16_bits):
    assert f32_to_bf16(np.array([f32_bits], dtype=np.uint32).view(np.float32))[0] == bf16_bits


def test_f32_to_bf16_nan_is_canonical_quiet_nan():
    nans = np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FFFFFFF, 0xFFFFFFFF, 0x7FBFFFFF],
                    dtype=np.uint32)
    out = f32_to_bf16(nans.view(np.float32))
    np.testing.assert_array_equal(out, 0x7FC0)
    assert np.isnan(bf16_to_f32(out)).all()


def test_bf16_to_f32_is_exact_on_all_65536_patterns():
    bits = np.arange(2 ** 16, dtype=np.uint16)
    values = bf16_to_f32(bits)
    assert values.dtype == np.float32
    np.testing.assert_array_equal(values.view(np.uint32), bits.astype(np.uint32) << 16)
    is_nan = np.isnan(values)
    assert is_nan.sum() == 2 * 127                                      # exponent 255, mantissa != 0
    np.testing.assert_array_equal(f32_to_bf16(values)[~is_nan], bits[~is_nan])
    np.testing.assert_array_equal(round_to_bf16(values[~is_nan]), values[~is_nan])


def test_f32_to_bf16_matches_torch_fixture():
    """torch's bits for non-NaN inputs (stored by make_model_fixtures.py). For NaN torch itself is
    not consistent (0x7FC0 from its scalar path, 0xFFFF from its vectorized CPU path); the engine
    always writes 0x7FC0, tested above."""
    with np.load(FIXTURES / "model_oracle_bf16_torch.npz") as f:
        f32_bits, expected = f["f32_bits"], f["bf16_bits"]
    assert len(f32_bits) > 10000
    np.testing.assert_array_equal(f32_to_bf16(f32_bits.view(np.float32)), expected)


@needs_transformers
def test_f32_to_bf16_matches_torch_live():
    import torch
    rng = np.random.default_rng(99)
    bits = not_nan(rng.integers(0, 2 ** 32, size=200_000, dtype=np.uint64).astype(np.uint32))
    x = bits.view(np.float32)
    expected = torch.from_numpy(x.copy()).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(f32_to_bf16(x), expected)


# ---- backend choice ----------------------------------------------------------------------------

def test_resolve_backend_numpy():
    b = resolve_backend("numpy")
    assert b.name == "numpy" and b.xp is np and not b.is_gpu and b.reason
    assert resolve_backend(b) is b


@pytest.mark.nogpu   # with a GPU, auto picks CuPy
def test_resolve_backend_auto_falls_back_to_numpy_with_a_reason():
    b = resolve_backend("auto")
    assert b.name == "numpy" and b.xp is np
    assert b.reason == cupy_unavailable_reason() and len(b.reason) > 20
    assert b.reason in b.describe()


@pytest.mark.nogpu
def test_resolve_backend_cupy_raises_with_the_reason():
    with pytest.raises(BackendError) as info:
        resolve_backend("cupy")
    assert cupy_unavailable_reason() in str(info.value)


@pytest.mark.gpu
def test_resolve_backend_auto_picks_cupy_on_a_gpu():
    b = resolve_backend("auto")
    assert b.name == "cupy" and b.is_gpu and b.reason is None


@pytest.mark.parametrize("name", ["torch", "", "CUPY", "gpu", None, 0])
def test_resolve_backend_rejects_unknown_names(name):
    with pytest.raises(ValueError):
        resolve_backend(name)
