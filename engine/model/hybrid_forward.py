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
What a linear layer remembers of a sequence is not per token but one fixed-size state per request
(its conv inputs and its delta-rule state), carried from step to step by the model runner: on the
CPU a RecurrentState of NumPy arrays; on the GPU a slot of two device pools (StatePools), which the
kernels of kernels_cu/gated_delta.cu read and update in place.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engine.backend import is_device_array
from engine.formats.config import HybridConfig
from engine.model.hybrid_weights import GatedAttentionLayer, LinearAttentionLayer
from engine.ops.embedding import embedding
from engine.ops.gated_delta import (
    attention_output_gate_gpu,
    causal_conv1d_gpu,
    causal_conv1d_ref,
    decay_log,
    gated_delta_chunked_ref,
    gated_delta_gpu,
    gated_delta_recurrent_ref,
    gated_rmsnorm_gpu,
    gated_rmsnorm_ref,
    gates_gpu,
    sigmoid,
)
from engine.ops.kv_write import kv_write
from engine.ops.linear import linear
from engine.ops.rmsnorm import add_rmsnorm, rmsnorm
from engine.ops.rope import rope_qk_norm_partial
from engine.ops.swiglu import swiglu
from engine.plugins import OVERRIDES, PluginError, checked_result, to_host

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


@dataclass
class StatePools:
    """GPU: the recurrent states of many sequences, one slot each, fp32 on the device:
    conv [L, N, K-1, C] and delta [L, N, Hv, Dk, Dv] for the L linear layers and N slots."""

    conv: Any
    delta: Any

    @classmethod
    def zeros(cls, cfg: HybridConfig, slots: int) -> StatePools:
        import cupy as cp
        L = len(cfg.layer_types) - len(cfg.full_attention_layers)
        K, C = cfg.linear_conv_kernel_dim, cfg.conv_dim
        Hv, Dk, Dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
        return cls(cp.zeros((L, slots, K - 1, C), cp.float32), cp.zeros((L, slots, Hv, Dk, Dv), cp.float32))

    @property
    def slots(self) -> int:
        return int(self.conv.shape[1])

    @property
    def nbytes(self) -> int:
        return int(self.conv.nbytes + self.delta.nbytes)

    def reset(self, slots) -> None:
        """Empty these slots (a sequence starting at position 0), in stream order on the device."""
        import cupy as cp
        index = cp.asarray(np.asarray(slots, dtype=np.int32))
        self.conv[:, index] = 0
        self.delta[:, index] = 0

    def save(self, slots) -> tuple:
        """Copies of these slots (device int32 [B]), for restore()."""
        return self.conv[:, slots].copy(), self.delta[:, slots].copy()

    def restore(self, slots, saved: tuple) -> None:
        self.conv[:, slots], self.delta[:, slots] = saved


@dataclass
class PooledStates:
    """A GPU batch's recurrent states: sequence s continues slot slots[s] of `pools` ([S] int32, on the
    host in a ForwardBatch, on the device in the forward pass)."""

    pools: StatePools
    slots: Any


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


def linear_attention_gpu(h, lw: LinearAttentionLayer, cfg: HybridConfig, cu_seqlens, cu_device, layer: int,
                         states: PooledStates):
    """The same mixer on the GPU: h bf16 [T, H] -> fp32 [T, H]. Sequence s continues slot states.slots[s]
    of the pools (updated in place by the kernels). cu_seqlens None: one token per sequence (a decode
    step, as CUDA graphs replay it); a batch of single tokens runs the recurrent kernel, anything
    else the chunked one."""
    C, Vd, Hv = cfg.conv_dim, cfg.linear_value_dim, cfg.linear_num_value_heads
    heads = (cfg.linear_num_key_heads, Hv, cfg.linear_key_head_dim, cfg.linear_value_head_dim)
    proj = linear(h, lw.in_proj)                                       # [T, C + Vd + 2 Hv] fp32
    g, beta = gates_gpu(proj, C + Vd + Hv, C + Vd, lw.A_log, lw.dt_bias)   # [T, Hv] each (a after b)
    conv = causal_conv1d_gpu(proj, lw.conv, states.pools.conv[layer], states.slots, cu_seqlens, cu_device)   # [T, C]
    if "gated_delta" in OVERRIDES:
        out = _learners_delta_rule(conv, g, beta, states.pools.delta[layer], states.slots, cu_seqlens, heads)
    else:
        decode = cu_seqlens is None or int(np.max(np.diff(cu_seqlens))) == 1
        out = gated_delta_gpu(conv, heads, g, beta, states.pools.delta[layer], states.slots, cu_seqlens,
                              chunked=not decode, cu_device=cu_device)   # [T, Hv * Dv]
    gated = gated_rmsnorm_gpu(out, proj[:, C:C + Vd], lw.norm, cfg.rms_norm_eps)   # [T, Vd] bf16
    return linear(gated, lw.out)


def _learners_delta_rule(conv, g, beta, pool, slots, cu_seqlens, heads) -> Any:
    """A learner's gated_delta stage (a NumPy function) inside the GPU model: each sequence's inputs and
    its state of this layer come to the host, run through delta_rule, and go back to the pool."""
    import cupy as cp
    Hk, Hv, Dk, Dv = heads
    T = conv.shape[0]
    x, g_h, beta_h, slots_h = to_host(conv), to_host(g), to_host(beta), to_host(slots)
    cu = np.arange(T + 1) if cu_seqlens is None else np.asarray(cu_seqlens)
    out = np.empty((T, Hv, Dv), dtype=np.float32)
    for s, (s0, s1) in enumerate(zip(cu[:-1], cu[1:], strict=True)):
        q, k, v = np.split(x[s0:s1], [Hk * Dk, 2 * Hk * Dk], axis=1)
        out[s0:s1], state = delta_rule(q.reshape(-1, Hk, Dk), k.reshape(-1, Hk, Dk), v.reshape(-1, Hv, Dv),
                                       g_h[s0:s1], beta_h[s0:s1], pool[int(slots_h[s])].get())
        pool[int(slots_h[s])] = cp.asarray(state)
    return cp.asarray(out.reshape(T, Hv * Dv))


def gated_attention(h, lw: GatedAttentionLayer, cfg: HybridConfig, pos, cos, sin, attend, k_cache=None,
                    v_cache=None, slots=None):
    """h [T, H] -> the full-attention mixer's output [T, H]: q/k norms, partial RoPE, the batch's K/V
    written to the cache at `slots` (with a cache), causal GQA (attend), the output gate. Both backends
    (bf16 between the kernels on the GPU)."""
    qkvg = linear(h, lw.qkvg)                                          # [T, 2 Hq D + 2 Hkv D] fp32
    qkv = rope_qk_norm_partial(qkvg, pos, cos, sin, cfg, lw.q_norm, lw.k_norm)   # [T, (Hq + 2 Hkv) D]: q | k | v
    if k_cache is not None:
        kv_write(qkv, slots, k_cache, v_cache, cfg)
    gate = qkvg[:, cfg.q_dim + 2 * cfg.kv_dim:]                        # [T, Hq D]
    attn = attend(qkv, k_cache, v_cache)                               # [T, Hq D]
    gated = attention_output_gate_gpu(attn, gate) if is_device_array(attn) else attn * sigmoid(gate)
    return linear(gated, lw.o)


def hybrid_logits(cfg: HybridConfig, weights, ids, pos, cu_seqlens, cos, sin, attend, cache=None, slots=None,
                  states=None, logits_rows=None, cu_device=None):
    """Logits [R, V] of packed sequences. attend(qkv, k_cache, v_cache) is the model's attention for this
    batch; with a cache, the full layers' K/V are written at `slots`. states: sequence s's recurrent
    state, a list of RecurrentState (CPU) or a PooledStates (GPU); None: fresh sequences whose states
    are thrown away after the pass. cu_seqlens (host) None: one token per sequence (a GPU decode step);
    cu_device: the same on the device."""
    gpu = is_device_array(weights.embed)
    if gpu:
        if states is None:
            import cupy as cp
            S = len(cu_seqlens) - 1
            states = PooledStates(StatePools.zeros(cfg, S), cp.arange(S, dtype=cp.int32))
        work = states              # the kernels update the pools in place
    else:
        if states is None:
            states = [RecurrentState.empty(cfg) for _ in range(len(cu_seqlens) - 1)]
        # the layers replace a state's arrays (never write into them) in working copies, committed once
        # the whole pass has run: a pass that fails leaves every request's state as it was
        work = [RecurrentState(list(s.conv), list(s.delta), s.tokens) for s in states]
    x = embedding(ids, weights.embed)                                  # [T, H] residual stream
    h = rmsnorm(x, weights.layers[0].input_norm, cfg.rms_norm_eps)
    full = linear_index = 0
    for i, lw in enumerate(weights.layers):
        if isinstance(lw, LinearAttentionLayer):
            if gpu:
                mixed = linear_attention_gpu(h, lw, cfg, cu_seqlens, cu_device, linear_index, work)
            else:
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
    if not gpu:
        for state, done, n in zip(states, work, np.diff(cu_seqlens), strict=True):
            state.conv, state.delta, state.tokens = done.conv, done.delta, done.tokens + int(n)
    if logits_rows is not None:
        h = h[logits_rows]
    return linear(h, weights.lm_head)
