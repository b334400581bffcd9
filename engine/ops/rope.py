"""Chapter 05: rotary position embeddings (RoPE) in Hugging Face's rotate-half layout.

A head vector x of size D is split in halves (x1, x2); pair i rotates by the angle pos * inv_freq[i]:
    y1 = x1 * cos - x2 * sin,    y2 = x2 * cos + x1 * sin.
The cos/sin tables are computed once for the context in use (the model's max_context, never the
config's max_position_embeddings, which can be 10**7), in float32 the way transformers does
(NumPy's and torch's float32 pow can differ by an ulp for some frequencies), and both backends
rotate by the same tables. Positions are always passed in explicitly: a decode step or a packed
batch mixes tokens at many absolute positions.

The Qwen families change what goes into the rotation (appendix: model families): Qwen2 adds a bias
to q, k and v; Qwen3 RMS-normalizes every q and k head (weights [D]) before rotating it; Qwen3.5's
full-attention layers normalize too and rotate only the first rotary_dim dimensions of each head
(rope_qk_norm_partial). On the GPU each happens inside the same pass over qkv (kernels_cu/rope.cu:
rope_qkv_bias_norm).
"""
from __future__ import annotations

import math

import numpy as np

from engine.backend import is_device_array, load_kernel
from engine.checks import is_int
from engine.formats.config import LlamaConfig
from engine.ops.rmsnorm import rmsnorm_ref
from engine.plugins import OVERRIDES, checked_result, to_backend, to_host


def rope_inv_freq(config: LlamaConfig) -> np.ndarray:
    """[R/2] float32 inverse frequencies, with Llama 3 scaling when the config asks for it; R is the
    rotary dimension (the whole head_dim except for Qwen3.5's partial rotary embeddings)."""
    D = config.rotary_dim
    exponents = np.arange(0, D, 2, dtype=np.int64).astype(np.float32) / D                 # [D/2]
    inv_freq = (1.0 / (np.float32(config.rope_theta) ** exponents)).astype(np.float32)
    rs = config.rope_scaling
    if rs is None:
        return inv_freq
    # Llama 3: keep high frequencies, divide low ones by `factor`, blend smoothly in between.
    low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
    high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
    wavelen = (2 * math.pi / inv_freq).astype(np.float32)
    scaled = np.where(wavelen > low_wavelen, inv_freq / rs.factor, inv_freq).astype(np.float32)
    smooth = ((rs.original_max_position_embeddings / wavelen - rs.low_freq_factor)
              / (rs.high_freq_factor - rs.low_freq_factor)).astype(np.float32)
    smoothed = ((1 - smooth) * scaled / rs.factor + smooth * scaled).astype(np.float32)
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_tables(config: LlamaConfig, max_positions: int) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin: [max_positions, D/2] float32, angle = position * inv_freq (float32 product)."""
    if not is_int(max_positions) or max_positions < 1:
        raise ValueError(f"max_positions must be an integer >= 1, got {max_positions!r}")
    positions = np.arange(max_positions, dtype=np.float32)[:, None]     # [P, 1]
    angles = positions * rope_inv_freq(config)[None, :]                 # [P, D/2]
    return np.cos(angles), np.sin(angles)


def rope_ref(x: np.ndarray, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x [T, n_heads, D], positions [T] -> rotated copy [T, n_heads, D]."""
    half = x.shape[-1] // 2
    c = cos[positions][:, None, :]                                       # [T, 1, D/2]
    s = sin[positions][:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def rope_leading(x: np.ndarray, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x [T, n_heads, D] (NumPy) -> a copy with the first R = 2 * cos.shape[1] dimensions of each head
    rotated and the other D - R passed through (Qwen3.5's partial rotary embeddings; R = D is the
    ordinary RoPE). A learner's rope override, when one is active, does the rotation."""
    R = 2 * cos.shape[1]
    part = x[..., :R]
    plug = OVERRIDES.get("rope")
    if plug is not None:
        rotated = checked_result("rope", plug.require_function()(part.copy(), positions, cos, sin), part.shape)
    else:
        rotated = rope_ref(part, positions, cos, sin)
    return np.concatenate([rotated, x[..., R:]], axis=-1)


def qkv_bias_norm_ref(qkv, bias, q_norm, k_norm, config: LlamaConfig):
    """[T, (Hq + 2 Hkv) * D] -> a copy with the bias added (Qwen2) and each q and k head RMS-normalized
    (Qwen3), as transformers does before RoPE. Works on NumPy and CuPy arrays alike."""
    Hq, Hkv, D = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    out = qkv + bias if bias is not None else qkv.copy()
    if q_norm is not None:
        heads = out.reshape(out.shape[0], Hq + 2 * Hkv, D)                   # a view of out
        heads[:, :Hq] = rmsnorm_ref(heads[:, :Hq], q_norm, config.rms_norm_eps)
        heads[:, Hq:Hq + Hkv] = rmsnorm_ref(heads[:, Hq:Hq + Hkv], k_norm, config.rms_norm_eps)
    return out


def rope_qkv(qkv, positions, cos, sin, config: LlamaConfig, bias=None, q_norm=None, k_norm=None):
    """Rotate the q and k heads of a fused QKV projection output [T, (Hq + 2 Hkv) * D].

    bias [(Hq + 2 Hkv) * D] (Qwen2) is added first; q_norm, k_norm [D] (Qwen3) normalize each q / k
    head before the rotation. CPU: returns a float32 copy with q, k rotated. GPU: reads fp32, returns
    bf16 (uint16) with q, k rotated and v converted, the layout attention and the KV cache read.
    """
    Hq, Hkv, D = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    plug = OVERRIDES.get("rope")                 # your stage (engine/plugins.py), if one is active
    qwen = bias is not None or q_norm is not None
    if qwen and (plug is not None or not is_device_array(qkv)):
        qkv = qkv_bias_norm_ref(qkv, bias, q_norm, k_norm, config)     # unfused: then the plain rotation
        qwen = False
    if plug is not None and plug.fn is not None:
        return _rope_function(plug, qkv, positions, cos, sin, Hq + Hkv, D)
    if not is_device_array(qkv):
        if plug is not None:
            plug.require_function()
        T = qkv.shape[0]
        heads = qkv.reshape(T, Hq + 2 * Hkv, D)
        rotated = rope_ref(heads[:, :Hq + Hkv], np.asarray(positions), cos, sin)
        return np.concatenate([rotated, heads[:, Hq + Hkv:]], axis=1).reshape(T, -1)
    import cupy as cp
    T = qkv.shape[0]
    out = cp.empty(qkv.shape, dtype=cp.uint16)
    if T and qwen:
        unused = cos                              # a valid pointer for the arguments a flag switches off
        load_kernel("rope", "rope_qkv_bias_norm")(
            (T,), (128,), (qkv, unused if bias is None else bias, unused if q_norm is None else q_norm,
                           unused if k_norm is None else k_norm, positions, cos, sin, out, np.int32(Hq),
                           np.int32(Hkv), np.int32(D), np.int32(D), np.int64(qkv.shape[1]),
                           np.float32(config.rms_norm_eps), np.int32(bias is not None), np.int32(q_norm is not None)))
    elif T:
        kernel = plug.kernel() if plug is not None else load_kernel("rope", "rope_qkv")
        kernel((T,), (256,), (qkv, positions, cos, sin, out, np.int32(Hq + Hkv), np.int32(Hq + 2 * Hkv), np.int32(D)))
    return out


def _rope_function(plug, qkv, positions, cos, sin, n_rotated: int, D: int):
    """A NumPy rope override rotates the q and k heads ([T, Hq + Hkv, D]); v is passed through."""
    heads = to_host(qkv).reshape(qkv.shape[0], -1, D)                   # [T, Hq + 2Hkv, D]
    qk = heads[:, :n_rotated]
    rotated = checked_result("rope", plug.fn(qk.copy(), to_host(positions), to_host(cos), to_host(sin)), qk.shape)
    out = np.concatenate([rotated, heads[:, n_rotated:]], axis=1).reshape(qkv.shape[0], -1)
    return to_backend(out, qkv, bf16=True)


def rope_qk_norm_partial(qkvg, positions, cos, sin, config: LlamaConfig, q_norm, k_norm):
    """Qwen3.5's full-attention heads (appendix: linear attention): qkvg [T, ld] fp32 whose first
    (Hq + 2 Hkv) * D columns are the q, k and v heads (the query gate follows) -> [T, (Hq + 2 Hkv) * D]
    with each q and k head RMS-normalized (q_norm, k_norm [D]) and its first R = 2 * cos.shape[1]
    dimensions rotated, v passed through. CPU: float32. GPU: bf16, one pass (rope_qkv_bias_norm with
    R < D); with a learner's rope stage plugged in, the host path runs it (rope_leading)."""
    Hq, Hkv, D = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    n = (Hq + 2 * Hkv) * D
    T = qkvg.shape[0]
    if not is_device_array(qkvg) or "rope" in OVERRIDES:
        x = to_host(qkvg)[:, :n].reshape(T, Hq + 2 * Hkv, D)
        qk = np.concatenate([rmsnorm_ref(x[:, :Hq], to_host(q_norm), config.rms_norm_eps),
                             rmsnorm_ref(x[:, Hq:Hq + Hkv], to_host(k_norm), config.rms_norm_eps)], axis=1)
        qk = rope_leading(qk, to_host(positions), to_host(cos), to_host(sin))    # [T, Hq + Hkv, D]
        out = np.concatenate([qk.reshape(T, -1), x[:, Hq + Hkv:].reshape(T, -1)], axis=1)
        return to_backend(out, qkvg, bf16=True)
    import cupy as cp
    out = cp.empty((T, n), dtype=cp.uint16)
    if T:
        load_kernel("rope", "rope_qkv_bias_norm")(
            (T,), (128,), (qkvg, cos, q_norm, k_norm, positions, cos, sin, out, np.int32(Hq), np.int32(Hkv),
                           np.int32(D), np.int32(2 * cos.shape[1]), np.int64(qkvg.strides[0] // 4),
                           np.float32(config.rms_norm_eps), np.int32(0), np.int32(1)))
    return out
