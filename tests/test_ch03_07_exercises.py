"""The chapter 03-07 checkers accept a correct solution, reject the usual mistakes with the right hint,
and report an unattempted exercise as such. The solutions here are written from the math, like a
learner would, not imported from the engine."""
from __future__ import annotations

import math

import numpy as np
import pytest
from helpers.exercises import accepts, not_attempted, rejects, verdict  # noqa: E402

from engine.exercises import ch03, ch04, ch05, ch06, ch07

# ----------------------------------------------------------------------------- chapter 03

def embed(ids, table):
    return np.stack([table[i] for i in ids])


def one_hot(ids, vocab_size):
    out = np.zeros((len(ids), vocab_size), dtype=np.float32)
    out[np.arange(len(ids)), ids] = 1.0
    return out


def cosine_similarity(rows):
    norms = np.sqrt((rows.astype(np.float64) ** 2).sum(axis=1))
    return (rows @ rows.T) / np.outer(norms, norms)


def gather_thread_indices(t, thread, H, threads):
    if H % 2:
        return list(range(t * H + thread, t * H + H, threads))
    out = []
    for pair in range(thread, H // 2, threads):
        out += [t * H + 2 * pair, t * H + 2 * pair + 1]
    return out


def test_ch03_checkers(capsys):
    accepts(ch03.check_embedding, embed, capsys)
    rejects(ch03.check_embedding, lambda ids, table: table[ids - 1], capsys, "off-by-one")
    rejects(ch03.check_embedding, lambda ids, table: table[ids][:, :-1], capsys, "shape")
    accepts(ch03.check_one_hot, one_hot, capsys)
    rejects(ch03.check_one_hot, lambda ids, V: one_hot(ids, V).T, capsys, "shape")
    accepts(ch03.check_cosine_similarity, cosine_similarity, capsys)
    rejects(ch03.check_cosine_similarity, lambda rows: rows @ rows.T, capsys, "norms")
    accepts(ch03.check_gather_thread_indices, gather_thread_indices, capsys)
    rejects(ch03.check_gather_thread_indices, lambda t, th, H, n: list(range(t * H + th, t * H + H, n)), capsys)


def test_unattempted_and_crashing_exercises_are_reported(capsys):
    assert ch03.check_embedding(not_attempted) is False
    assert verdict(capsys).startswith("[ ] embedding: not attempted yet")
    assert ch03.check_embedding(lambda ids, table: 1 / 0) is False
    assert "raised ZeroDivisionError" in verdict(capsys)
    assert ch03.check_gather_thread_indices(not_attempted) is False
    assert verdict(capsys).startswith("[ ]")
    assert ch04.check_add_rmsnorm(not_attempted) is False
    assert verdict(capsys).startswith("[ ]")


# ----------------------------------------------------------------------------- chapter 04

def rmsnorm(x, w, eps):
    ms = (x.astype(np.float64) ** 2).mean(axis=-1, keepdims=True)
    return (x / np.sqrt(ms + eps) * w).astype(np.float32)


def add_rmsnorm(residual, delta, w, eps):
    residual += delta
    return rmsnorm(residual, w, eps)


def test_ch04_checkers(capsys):
    accepts(ch04.check_rmsnorm, rmsnorm, capsys)
    rejects(ch04.check_rmsnorm, lambda x, w, eps: x / (np.sqrt((x * x).mean(-1, keepdims=True)) + eps) * w,
            capsys, "outside the square root")
    with np.errstate(all="ignore"):
        rejects(ch04.check_rmsnorm, lambda x, w, eps: x / np.sqrt((x * x).mean(-1, keepdims=True)) * w, capsys, "NaN")
    rejects(ch04.check_rmsnorm, lambda x, w, eps: rmsnorm(x - x.mean(-1, keepdims=True), w, eps), capsys, "LayerNorm")
    rejects(ch04.check_rmsnorm, lambda x, w, eps: rmsnorm(x, np.ones_like(w), eps), capsys, "weight")
    accepts(ch04.check_add_rmsnorm, add_rmsnorm, capsys)
    rejects(ch04.check_add_rmsnorm, lambda r, d, w, eps: rmsnorm(r + d, w, eps), capsys, "in place")
    rejects(ch04.check_add_rmsnorm, lambda r, d, w, eps: (r.__iadd__(d), rmsnorm(d, w, eps))[1], capsys)
    accepts(ch04.check_thread_partial_sums,
            lambda row, n: np.array([sum(float(v) ** 2 for v in row[i::n]) for i in range(n)]), capsys)
    rejects(ch04.check_thread_partial_sums,
            lambda row, n: np.array([float((c.astype(np.float64) ** 2).sum()) for c in np.array_split(row, n)]),
            capsys, "contiguous chunks")


# ----------------------------------------------------------------------------- chapter 05

def rope_frequencies(head_dim, theta):
    return np.array([1.0 / theta ** (2 * i / head_dim) for i in range(head_dim // 2)], dtype=np.float32)


def llama3_scale(inv_freq, factor, low_freq_factor, high_freq_factor, original_max):
    out = []
    for f in inv_freq.astype(np.float64):
        wavelen = 2 * math.pi / f
        if wavelen < original_max / high_freq_factor:
            out.append(f)
        elif wavelen > original_max / low_freq_factor:
            out.append(f / factor)
        else:
            smooth = (original_max / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            out.append((1 - smooth) * f / factor + smooth * f)
    return np.array(out, dtype=np.float32)


def rope(x, positions, cos, sin):
    half = x.shape[-1] // 2
    c, s = cos[positions][:, None], sin[positions][:, None]
    rotated_half = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * np.concatenate([c, c], -1) + rotated_half * np.concatenate([s, s], -1)


def interleaved_to_half(w, n_heads):
    D = w.shape[0] // n_heads
    order = [h * D + j for h in range(n_heads) for j in list(range(0, D, 2)) + list(range(1, D, 2))]
    return w[order]


def test_ch05_checkers(capsys):
    accepts(ch05.check_rope_frequencies, rope_frequencies, capsys)
    rejects(ch05.check_rope_frequencies, lambda D, t: 1 / rope_frequencies(D, t), capsys, "wavelengths")
    accepts(ch05.check_llama3_scale_frequencies, llama3_scale, capsys)
    rejects(ch05.check_llama3_scale_frequencies, lambda f, factor, *rest: f / factor, capsys, "only the long")
    rejects(ch05.check_llama3_scale_frequencies,
            lambda f, factor, low, high, orig: np.where(2 * np.pi / f > orig / low, f / factor, f), capsys, "blended")
    accepts(ch05.check_rope, rope, capsys)
    rejects(ch05.check_rope, ch05.rope_interleaved, capsys, "interleaved")
    rejects(ch05.check_rope, lambda x, p, cos, sin: rope(x, p, cos, -sin), capsys, "wrong way")
    rejects(ch05.check_rope, lambda x, p, cos, sin: rope(x, np.arange(len(p)), cos, sin), capsys, "positions[t]")
    accepts(ch05.check_interleaved_to_half, interleaved_to_half, capsys)
    rejects(ch05.check_interleaved_to_half, lambda w, n: interleaved_to_half(w, 1), capsys, "per head")


def test_interleaved_to_half_turns_one_rope_layout_into_the_other():
    """The permutation the chapter teaches is the one that makes the two layouts agree."""
    rng = np.random.default_rng(0)
    n_heads, D, H, T = 3, 16, 20, 6
    w = rng.standard_normal((n_heads * D, H), dtype=np.float32)
    x = rng.standard_normal((T, H), dtype=np.float32)
    cos, sin = ch05.rope_tables(ch05._config(D, 10000.0), 32)
    pos = np.arange(T)
    meta = ch05.rope_interleaved((x @ w.T).reshape(T, n_heads, D), pos, cos, sin)
    hf = rope((x @ interleaved_to_half(w, n_heads).T).reshape(T, n_heads, D), pos, cos, sin)
    # the same vectors, their coordinates listed in the other order: dot products agree
    np.testing.assert_allclose(np.einsum("thd,shd->hts", meta, meta), np.einsum("thd,shd->hts", hf, hf), rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------- chapter 06

def softmax(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def causal_attention(q, k, v, scale):
    T, Hq, D = q.shape
    r = Hq // k.shape[1]
    out = np.zeros_like(q)
    for h in range(Hq):
        for t in range(T):
            scores = np.array([q[t, h] @ k[s, h // r] * scale for s in range(t + 1)])
            out[t, h] = softmax(scores) @ v[: t + 1, h // r]
    return out


def test_ch06_checkers(capsys):
    accepts(ch06.check_softmax, softmax, capsys)
    with np.errstate(all="ignore"):
        rejects(ch06.check_softmax, lambda x: np.exp(x) / np.exp(x).sum(-1, keepdims=True), capsys, "NaN")
    accepts(ch06.check_kv_head_of, lambda h, nq, nkv: h // (nq // nkv), capsys)
    rejects(ch06.check_kv_head_of, lambda h, nq, nkv: h % nkv, capsys)
    accepts(ch06.check_causal_attention, causal_attention, capsys)
    rejects(ch06.check_causal_attention,
            lambda q, k, v, s: ch06._repeat_kv_attention(q, k, v, s, lambda h, nq, nkv: h % nkv), capsys, "h % n_kv")
    rejects(ch06.check_causal_attention, ch06._no_mask, capsys, "causal mask")
    rejects(ch06.check_causal_attention, lambda q, k, v, s: causal_attention(q, k, v, 1.0), capsys, "scale")
    accepts(ch06.check_kv_bytes_per_token, lambda L, h, d, b: 2 * L * h * d * b, capsys)
    rejects(ch06.check_kv_bytes_per_token, lambda L, h, d, b: L * h * d * b, capsys)


# ----------------------------------------------------------------------------- chapter 07

def silu(x):
    return x / (1 + np.exp(-x))


def swiglu(gate_up):
    I = gate_up.shape[-1] // 2
    return silu(gate_up[:, :I]) * gate_up[:, I:]


def decoder_layer(x, lw, config, positions, cos, sin):
    """Written with the learner's own pieces above, not with engine.ops."""
    T, eps = x.shape[0], config.rms_norm_eps
    Hq, Hkv, D = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    heads = (rmsnorm(x, lw.input_norm, eps) @ lw.qkv.T).reshape(T, Hq + 2 * Hkv, D)
    q = rope(heads[:, :Hq], positions, cos, sin)
    k = rope(heads[:, Hq:Hq + Hkv], positions, cos, sin)
    v = heads[:, Hq + Hkv:]
    x = x + causal_attention(q, k, v, D ** -0.5).reshape(T, -1) @ lw.o.T
    return x + swiglu(rmsnorm(x, lw.post_norm, eps) @ lw.gate_up.T) @ lw.down.T


def top_k_probs(logits, k):
    ids = np.argsort(logits)[::-1][:k]
    p = np.exp(logits.astype(np.float64) - logits.max())
    return ids, (p / p.sum())[ids]


def test_ch07_checkers(capsys):
    accepts(ch07.check_silu, silu, capsys)
    rejects(ch07.check_silu, lambda x: 1 / (1 + np.exp(-x)), capsys, "sigmoid")
    accepts(ch07.check_swiglu, swiglu, capsys)
    rejects(ch07.check_swiglu, lambda gu: silu(gu[:, 0::2]) * gu[:, 1::2], capsys, "interleaved")
    rejects(ch07.check_swiglu, lambda gu: swiglu(np.concatenate(np.split(gu, 2, -1)[::-1], -1)), capsys, "up instead")
    accepts(ch07.check_decoder_layer, decoder_layer, capsys)
    rejects(ch07.check_decoder_layer, lambda *a: ch07.decoder_layer_ref(*a, rope=False), capsys, "RoPE")
    rejects(ch07.check_decoder_layer, ch07._no_residual, capsys, "residual")
    accepts(ch07.check_top_k_probs, top_k_probs, capsys)
    rejects(ch07.check_top_k_probs, lambda lg, k: (top_k_probs(lg, k)[0], softmax(np.sort(lg)[::-1][:k])),
            capsys, "renormalized")


@pytest.mark.parametrize("preset", ["tiny", "tiny-mqa", "tiny-mha-untied"])
def test_decoder_layer_reference_rebuilds_the_model(preset):
    """The checker's reference layer, stacked, is the engine's forward pass (so the hints are meaningful)."""
    m = ch07._tiny_model(preset)
    ids = np.arange(9, dtype=np.int32) * 7 % m.config.vocab_size
    pos = np.arange(len(ids), dtype=np.int32)
    x = m.weights.embed[ids].astype(np.float32)
    for lw in m.weights.layers:
        x = ch07.decoder_layer_ref(x, lw, m.config, pos, m.cos, m.sin)
    logits = rmsnorm(x, m.weights.norm, m.config.rms_norm_eps) @ m.weights.lm_head.T
    np.testing.assert_allclose(logits, m.logits(ids), rtol=1e-4, atol=1e-4)
