"""The forward pass of Qwen3.5's hybrid layers (appendix: linear attention), NumPy backend, no cache.

A decoder layer is the Llama one (pre-norm, residual, SwiGLU MLP) with one of two token mixers:
  * linear_attention (Gated DeltaNet): one projection gives q, k, v (through a causal depthwise conv
    and SiLU), the output gate z, and b, a (the step size beta and the decay g of each value head);
    the gated delta rule runs per sequence (engine/ops/gated_delta.py, chunked: a prefill); its
    output is RMS-normalised per head, multiplied by silu(z) and projected back;
  * full_attention: causal GQA whose q and k heads are RMS-normalised, rotated over their first
    rotary_dim dimensions only, and whose output is multiplied by sigmoid(gate) before o_proj.
The recurrent state of a linear layer and the K/V of a full layer both start empty: this is the
full causal pass over fresh sequences (Model.logits). Serving with a cache needs a per-request
recurrent state beside the paged K/V, which the engine does not have yet.
"""
from __future__ import annotations

import numpy as np

from engine.formats.config import HybridConfig
from engine.model.hybrid_weights import GatedAttentionLayer, LinearAttentionLayer
from engine.ops.attention import prefill_attention
from engine.ops.embedding import embedding
from engine.ops.gated_delta import (
    causal_conv1d_ref,
    decay_log,
    gated_delta_chunked_ref,
    gated_rmsnorm_ref,
    sigmoid,
)
from engine.ops.linear import linear
from engine.ops.rmsnorm import add_rmsnorm, rmsnorm, rmsnorm_ref
from engine.ops.rope import rope_ref
from engine.ops.swiglu import swiglu

CHUNK_SIZE = 64       # tokens per chunk of the chunked delta rule (transformers' and FLA's default)


def linear_attention(h: np.ndarray, lw: LinearAttentionLayer, cfg: HybridConfig, cu_seqlens: np.ndarray
                     ) -> np.ndarray:
    """h [T, H] (normalised) -> the Gated DeltaNet mixer's output [T, H], each sequence from an empty state."""
    T = h.shape[0]
    Hk, Dk = cfg.linear_num_key_heads, cfg.linear_key_head_dim
    Hv, Dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
    C, Vd = cfg.conv_dim, cfg.linear_value_dim
    proj = linear(h, lw.in_proj)                                       # [T, C + Vd + 2 Hv]
    mixed, z, b, a = np.split(proj, [C, C + Vd, C + Vd + Hv], axis=1)
    beta, g = sigmoid(b), decay_log(a, lw.A_log, lw.dt_bias)           # [T, Hv] each
    out = np.empty((T, Hv, Dv), dtype=np.float32)
    for s0, s1 in zip(cu_seqlens[:-1], cu_seqlens[1:], strict=True):   # conv and recurrence: per sequence
        conv, _ = causal_conv1d_ref(mixed[s0:s1], lw.conv)             # [n, C]
        q, k, v = np.split(conv, [Hk * Dk, 2 * Hk * Dk], axis=1)
        out[s0:s1], _ = gated_delta_chunked_ref(q.reshape(-1, Hk, Dk), k.reshape(-1, Hk, Dk), v.reshape(-1, Hv, Dv),
                                                g[s0:s1], beta[s0:s1], None, CHUNK_SIZE)
    gated = gated_rmsnorm_ref(out, z.reshape(T, Hv, Dv), lw.norm, cfg.rms_norm_eps)
    return linear(gated.reshape(T, Vd), lw.out)


def gated_attention(h: np.ndarray, lw: GatedAttentionLayer, cfg: HybridConfig, pos: np.ndarray,
                    cu_seqlens: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """h [T, H] -> the full-attention mixer's output [T, H]: q/k norms, partial RoPE, causal GQA, output gate."""
    T = h.shape[0]
    Hq, Hkv, D, r = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rotary_dim
    qkvg = linear(h, lw.qkvg)                                          # [T, 2 Hq D + 2 Hkv D]
    q, k, v, gate = np.split(qkvg, [cfg.q_dim, cfg.q_dim + cfg.kv_dim, cfg.q_dim + 2 * cfg.kv_dim], axis=1)
    q = rmsnorm_ref(q.reshape(T, Hq, D), lw.q_norm, cfg.rms_norm_eps)
    k = rmsnorm_ref(k.reshape(T, Hkv, D), lw.k_norm, cfg.rms_norm_eps)
    q[..., :r] = rope_ref(q[..., :r], pos, cos, sin)                   # the other D - r dims pass through
    k[..., :r] = rope_ref(k[..., :r], pos, cos, sin)
    qkv = np.concatenate([q.reshape(T, -1), k.reshape(T, -1), v], axis=1)
    attn = prefill_attention(qkv, cu_seqlens, cfg)                     # [T, Hq D]
    return linear(attn * sigmoid(gate), lw.o)


def hybrid_logits(cfg: HybridConfig, weights, ids: np.ndarray, pos: np.ndarray, cu_seqlens: np.ndarray,
                  cos: np.ndarray, sin: np.ndarray, logits_rows=None) -> np.ndarray:
    """Logits [R, V] of fresh packed sequences (every sequence starts at position 0)."""
    x = embedding(ids, weights.embed)                                  # [T, H] residual stream
    h = rmsnorm(x, weights.layers[0].input_norm, cfg.rms_norm_eps)
    for i, lw in enumerate(weights.layers):
        if isinstance(lw, LinearAttentionLayer):
            mixed = linear_attention(h, lw, cfg, cu_seqlens)
        else:
            mixed = gated_attention(h, lw, cfg, pos, cu_seqlens, cos, sin)
        h = add_rmsnorm(x, mixed, lw.post_norm, cfg.rms_norm_eps)
        down = linear(swiglu(linear(h, lw.gate_up)), lw.down)
        next_norm = weights.layers[i + 1].input_norm if i + 1 < len(weights.layers) else weights.norm
        h = add_rmsnorm(x, down, next_norm, cfg.rms_norm_eps)
    if logits_rows is not None:
        h = h[logits_rows]
    return linear(h, weights.lm_head)
