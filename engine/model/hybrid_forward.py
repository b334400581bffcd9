"""The forward pass of Qwen3.5's hybrid layers (appendix: linear attention), NumPy backend.

A decoder layer is the Llama one (pre-norm, residual, SwiGLU MLP) with one of two token mixers:
  * linear_attention (Gated DeltaNet): one projection gives q, k, v (through a causal depthwise conv
    and SiLU), the output gate z, and b, a (the step size beta and the decay g of each value head);
    the gated delta rule runs per sequence (engine/ops/gated_delta.py): the chunked form for a
    prompt or a chunk of one, the recurrent step for a decode token; its output is RMS-normalised
    per head, multiplied by silu(z) and projected back;
  * full_attention: causal GQA whose q and k heads are RMS-normalised, rotated over their first
    rotary_dim dimensions only, and whose output is multiplied by sigmoid(gate) before o_proj. Its
    K/V go to the paged cache like any dense layer's (the cache holds only these layers).
What a linear layer remembers of a sequence is not per token but one fixed-size RecurrentState per
request (its conv inputs and its delta-rule state), carried from step to step by the model runner.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from engine.formats.config import HybridConfig
from engine.model.hybrid_weights import GatedAttentionLayer, LinearAttentionLayer
from engine.ops.embedding import embedding
from engine.ops.gated_delta import (
    causal_conv1d_ref,
    decay_log,
    gated_delta_chunked_ref,
    gated_delta_recurrent_ref,
    gated_rmsnorm_ref,
    sigmoid,
)
from engine.ops.kv_write import kv_write
from engine.ops.linear import linear
from engine.ops.rmsnorm import add_rmsnorm, rmsnorm, rmsnorm_ref
from engine.ops.rope import rope_leading
from engine.ops.swiglu import swiglu
from engine.plugins import OVERRIDES, PluginError, checked_result

CHUNK_SIZE = 64       # tokens per chunk of the chunked delta rule (transformers' and FLA's default)


@dataclass
class RecurrentState:
    """One request's memory in every linear_attention layer: for layer l (counted among the linear
    layers), conv[l] [K-1, C] holds the last K-1 inputs of its convolution and delta[l] [Hv, Dk, Dv]
    its delta-rule state (fp32); `tokens` counts the tokens it has taken in (the next one's position)."""

    conv: list[np.ndarray] = field(default_factory=list)
    delta: list[np.ndarray] = field(default_factory=list)
    tokens: int = 0

    @classmethod
    def empty(cls, cfg: HybridConfig) -> RecurrentState:
        n = len(cfg.layer_types) - len(cfg.full_attention_layers)
        K, C = cfg.linear_conv_kernel_dim, cfg.conv_dim
        Hv, Dk, Dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
        return cls([np.zeros((K - 1, C), np.float32) for _ in range(n)],
                   [np.zeros((Hv, Dk, Dv), np.float32) for _ in range(n)])

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.conv + self.delta)


def delta_rule(q, k, v, g, beta, state) -> tuple[np.ndarray, np.ndarray]:
    """The gated delta rule of one sequence: the recurrent step for a decode token, the chunked form for a
    prompt or a chunk of one; or the learner's function (engine.use_stage("gated_delta", fn))."""
    plug = OVERRIDES.get("gated_delta")
    if plug is not None:
        result = plug.require_function()(q, k, v, g, beta, state.copy())
        if not (isinstance(result, tuple) and len(result) == 2):
            raise PluginError("your gated_delta must return a pair (o [T, Hv, Dv], the new state [Hv, Dk, Dv])")
        return checked_result("gated_delta", result[0], v.shape), checked_result("gated_delta", result[1], state.shape)
    if q.shape[0] == 1:
        return gated_delta_recurrent_ref(q, k, v, g, beta, state)
    return gated_delta_chunked_ref(q, k, v, g, beta, state, chunk_size=CHUNK_SIZE)


def linear_attention(h: np.ndarray, lw: LinearAttentionLayer, cfg: HybridConfig, cu_seqlens: np.ndarray,
                     layer: int, states: list[RecurrentState]) -> np.ndarray:
    """h [T, H] (normalised) -> the Gated DeltaNet mixer's output [T, H]. Sequence s continues from
    states[s] (its conv and delta state of this linear layer, updated in place)."""
    T = h.shape[0]
    Hk, Dk = cfg.linear_num_key_heads, cfg.linear_key_head_dim
    Hv, Dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
    C, Vd = cfg.conv_dim, cfg.linear_value_dim
    proj = linear(h, lw.in_proj)                                       # [T, C + Vd + 2 Hv]
    mixed, z, b, a = np.split(proj, [C, C + Vd, C + Vd + Hv], axis=1)
    beta, g = sigmoid(b), decay_log(a, lw.A_log, lw.dt_bias)           # [T, Hv] each
    out = np.empty((T, Hv, Dv), dtype=np.float32)
    for s, (s0, s1) in enumerate(zip(cu_seqlens[:-1], cu_seqlens[1:], strict=True)):   # per sequence
        state = states[s]
        conv, state.conv[layer] = causal_conv1d_ref(mixed[s0:s1], lw.conv, state.conv[layer])      # [n, C]
        q, k, v = np.split(conv, [Hk * Dk, 2 * Hk * Dk], axis=1)
        args = (q.reshape(-1, Hk, Dk), k.reshape(-1, Hk, Dk), v.reshape(-1, Hv, Dv), g[s0:s1], beta[s0:s1],
                state.delta[layer])
        out[s0:s1], state.delta[layer] = delta_rule(*args)
    gated = gated_rmsnorm_ref(out, z.reshape(T, Hv, Dv), lw.norm, cfg.rms_norm_eps)
    return linear(gated.reshape(T, Vd), lw.out)


def gated_attention(h: np.ndarray, lw: GatedAttentionLayer, cfg: HybridConfig, pos: np.ndarray,
                    cos: np.ndarray, sin: np.ndarray, attend, k_cache=None, v_cache=None, slots=None) -> np.ndarray:
    """h [T, H] -> the full-attention mixer's output [T, H]: q/k norms, partial RoPE, the batch's K/V
    written to the cache at `slots` (with a cache), causal GQA (attend), the output gate."""
    T = h.shape[0]
    Hq, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    qkvg = linear(h, lw.qkvg)                                          # [T, 2 Hq D + 2 Hkv D]
    q, k, v, gate = np.split(qkvg, [cfg.q_dim, cfg.q_dim + cfg.kv_dim, cfg.q_dim + 2 * cfg.kv_dim], axis=1)
    qk = np.concatenate([rmsnorm_ref(q.reshape(T, Hq, D), lw.q_norm, cfg.rms_norm_eps),
                         rmsnorm_ref(k.reshape(T, Hkv, D), lw.k_norm, cfg.rms_norm_eps)], axis=1)   # [T, Hq + Hkv, D]
    qk = rope_leading(qk, pos, cos, sin)                               # the first rotary_dim dims of each head
    qkv = np.concatenate([qk.reshape(T, -1), v], axis=1)              # the dense layers' layout: q | k | v
    if k_cache is not None:
        kv_write(qkv, slots, k_cache, v_cache, cfg)
    return linear(attend(qkv, k_cache, v_cache) * sigmoid(gate), lw.o)


def hybrid_logits(cfg: HybridConfig, weights, ids: np.ndarray, pos: np.ndarray, cu_seqlens: np.ndarray,
                  cos: np.ndarray, sin: np.ndarray, attend, cache=None, slots=None,
                  states: list[RecurrentState] | None = None, logits_rows=None) -> np.ndarray:
    """Logits [R, V] of packed sequences. attend(qkv, k_cache, v_cache) is the model's attention for this
    batch; with a cache, the full layers' K/V are written at `slots` and states[s] is sequence s's
    recurrent state (None: fresh sequences, states thrown away after the pass)."""
    if states is None:
        states = [RecurrentState.empty(cfg) for _ in range(len(cu_seqlens) - 1)]
    # the layers replace a state's arrays (never write into them) in working copies, committed once the
    # whole pass has run: a pass that fails leaves every request's state as it was
    work = [RecurrentState(list(s.conv), list(s.delta), s.tokens) for s in states]
    x = embedding(ids, weights.embed)                                  # [T, H] residual stream
    h = rmsnorm(x, weights.layers[0].input_norm, cfg.rms_norm_eps)
    full = linear_index = 0
    for i, lw in enumerate(weights.layers):
        if isinstance(lw, LinearAttentionLayer):
            mixed = linear_attention(h, lw, cfg, cu_seqlens, linear_index, work)
            linear_index += 1
        else:
            kc, vc = cache.layer(full) if cache is not None else (None, None)   # the cache holds full layers only
            mixed = gated_attention(h, lw, cfg, pos, cos, sin, attend, kc, vc, slots)
            full += 1
        h = add_rmsnorm(x, mixed, lw.post_norm, cfg.rms_norm_eps)
        down = linear(swiglu(linear(h, lw.gate_up)), lw.down)
        next_norm = weights.layers[i + 1].input_norm if i + 1 < len(weights.layers) else weights.norm
        h = add_rmsnorm(x, down, next_norm, cfg.rms_norm_eps)
    for state, done, n in zip(states, work, np.diff(cu_seqlens), strict=True):
        state.conv, state.delta, state.tokens = done.conv, done.delta, done.tokens + int(n)
    if logits_rows is not None:
        h = h[logits_rows]
    return linear(h, weights.lm_head)
