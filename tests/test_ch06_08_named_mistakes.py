"""The classic mistakes of chapters 06-08, written the way a learner writes them, get a verdict that
names the mistake: the causal mask off by one or without its diagonal, the GQA head mapping h % n_kv,
adding the residual before the norm, and dropping tokens tied at the top-p boundary."""
from __future__ import annotations

import numpy as np
from helpers.exercises import accepts, rejects
from test_ch03_07_exercises import causal_attention, rmsnorm, rope, swiglu

from engine.exercises import ch06, ch07, ch08


def _attention(q, k, v, scale, mask_of, guard_empty_rows=False):
    """Causal GQA attention with the mask a learner wrote: mask_of(T) is True where a key is hidden."""
    T, Hq, D = q.shape
    r = Hq // k.shape[1]
    kk, vv = np.repeat(k, r, axis=1), np.repeat(v, r, axis=1)
    s = np.einsum("thd,shd->hts", q, kk) * scale
    s[:, mask_of(T)] = -np.inf
    with np.errstate(invalid="ignore"):
        e = np.exp(s - s.max(-1, keepdims=True))
        p = e / e.sum(-1, keepdims=True)
    if guard_empty_rows:
        p = np.nan_to_num(p)
    return np.einsum("hts,shd->thd", p, vv)


def test_causal_mask_mistakes_are_named(capsys):
    accepts(ch06.check_causal_attention,
            lambda q, k, v, s: _attention(q, k, v, s, lambda T: np.triu(np.ones((T, T), bool), k=1)), capsys)
    diagonal = lambda T: np.triu(np.ones((T, T), bool), k=0)          # noqa: E731  hides s >= t, itself too
    rejects(ch06.check_causal_attention, lambda q, k, v, s: _attention(q, k, v, s, diagonal), capsys,
            "excludes the diagonal")
    rejects(ch06.check_causal_attention, lambda q, k, v, s: _attention(q, k, v, s, diagonal, guard_empty_rows=True),
            capsys, "excludes the diagonal")
    one_ahead = lambda T: np.triu(np.ones((T, T), bool), k=2)         # noqa: E731  lets t see t + 1
    rejects(ch06.check_causal_attention, lambda q, k, v, s: _attention(q, k, v, s, one_ahead), capsys,
            "off by one")


def test_gqa_head_mapping_mistakes_are_named(capsys):
    rejects(ch06.check_kv_head_of, lambda h, nq, nkv: h % nkv, capsys, "round-robin")
    rejects(ch06.check_kv_head_of, lambda h, nq, nkv: h // nkv, capsys, "group size")


def _layer(x, lw, config, positions, cos, sin, order):
    T, eps = x.shape[0], config.rms_norm_eps
    Hq, Hkv, D = config.num_attention_heads, config.num_key_value_heads, config.head_dim

    def attention(h):
        heads = (h @ lw.qkv.T).reshape(T, Hq + 2 * Hkv, D)
        q, k = rope(heads[:, :Hq], positions, cos, sin), rope(heads[:, Hq:Hq + Hkv], positions, cos, sin)
        return causal_attention(q, k, heads[:, Hq + Hkv:], D ** -0.5).reshape(T, -1) @ lw.o.T

    def mlp(h):
        return swiglu(h @ lw.gate_up.T) @ lw.down.T

    if order == "add before norm":
        x = rmsnorm(x + attention(x), lw.input_norm, eps)
        return rmsnorm(x + mlp(x), lw.post_norm, eps)
    h = rmsnorm(x, lw.input_norm, eps)
    x = h + attention(h)                       # the residual taken from the normalized x
    h = rmsnorm(x, lw.post_norm, eps)
    return h + mlp(h)


def test_norm_order_mistakes_are_named(capsys):
    rejects(ch07.check_decoder_layer, lambda *a: _layer(*a, order="add before norm"), capsys, "added before the norm")
    rejects(ch07.check_decoder_layer, lambda *a: _layer(*a, order="residual from norm"), capsys,
            "added to the normalized x")


def test_top_p_ties_are_named(capsys):
    def first_n(probs, top_p):
        order = np.argsort(-probs, kind="stable")
        n = int(np.searchsorted(np.cumsum(probs[order]), top_p))
        keep = np.zeros(len(probs), dtype=bool)
        keep[order[:n + 1]] = True
        return keep
    rejects(ch08.check_top_p_keep, first_n, capsys, "tied")
