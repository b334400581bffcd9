"""Chapter 06: causal grouped-query attention for a prompt (prefill, no cache).

GQA: Hq query heads share Hkv key/value heads, group size r = Hq / Hkv (r = 1 is MHA, r = Hq MQA).
Query head h reads KV head h // r. K and V are never repeated in memory: the reference reshapes
q to [T, Hkv, r, D]; the GPU path points cuBLAS at the right columns with strides.
"""
from __future__ import annotations

import numpy as np

from engine.backend import is_device_array, load_kernel, matmul
from engine.formats.config import LlamaConfig
from engine.ops.flash_attention import flash_attention_ref
from engine.ops.qkv_layout import split_qkv
from engine.plugins import OVERRIDES, checked_result, to_backend, to_host


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    e = np.exp(x - np.max(x, axis=axis, keepdims=True))
    return e / np.sum(e, axis=axis, keepdims=True)


def causal_attention_ref(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float) -> np.ndarray:
    """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D]; token t attends to tokens 0..t."""
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    qg = q.reshape(T, Hkv, Hq // Hkv, D)                                   # [T, Hkv, r, D]
    scores = np.einsum("tgrd,sgd->grts", qg, k) * np.float32(scale)       # [Hkv, r, T, T]
    scores = np.where(np.tril(np.ones((T, T), dtype=bool)), scores, -np.inf)
    out = np.einsum("grts,sgd->tgrd", softmax(scores), v)                 # [T, Hkv, r, D]
    return out.reshape(T, Hq, D).astype(np.float32, copy=False)


def prefill_attention(qkv, cu_seqlens: np.ndarray, config: LlamaConfig):
    """Causal self-attention of several prompts packed one after the other.

    qkv: [T, (Hq + 2Hkv) * D] after RoPE; cu_seqlens: host int array [S + 1] of sequence starts.
    Returns [T, Hq * D] (fp32 on CPU, bf16 on the GPU: the input of o_proj).

    This is the first rung of the ladder: on the GPU the whole [T, T] score matrix of every head
    goes through memory. The engine prefills with engine/ops/flash_attention.py (tiles, online
    softmax, no score matrix) and falls back to this kernel only on GPUs before sm_80. On the CPU
    both run the tiled NumPy reference, so that no T x T matrix is ever allocated.
    """
    scale = config.head_dim ** -0.5
    plug = OVERRIDES.get("attention")            # your stage (engine/plugins.py), if one is active
    if plug is not None and (plug.fn is not None or not is_device_array(qkv)):
        attend = plug.require_function()
        q, k, v = split_qkv(to_host(qkv), config)
        out = np.empty((qkv.shape[0], config.q_dim), dtype=np.float32)
        for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:]):
            one = checked_result("attention", attend(q[a:b], k[a:b], v[a:b], scale), q[a:b].shape)
            out[a:b] = one.reshape(b - a, -1)
        return to_backend(out, qkv, bf16=True)
    if not is_device_array(qkv):
        q, k, v = split_qkv(qkv, config)
        cu = np.asarray(cu_seqlens)
        positions = np.arange(qkv.shape[0]) - np.repeat(cu[:-1], np.diff(cu))
        return flash_attention_ref(q, k, v, cu, positions, scale).reshape(qkv.shape[0], -1)
    import cupy as cp
    out = cp.empty((qkv.shape[0], config.q_dim), dtype=cp.uint16)
    for a, b in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
        if b > a:
            _prefill_attention_gpu(qkv[a:b], out[a:b], config, scale, plug)
    return out


def _head_view(x, col0: int, n_kv: int, head_stride: int, D: int):
    """[T, cols] bf16 matrix -> [n_kv, T, D] view: KV group g starts at column col0 + g * head_stride."""
    from cupy.lib.stride_tricks import as_strided
    item = x.dtype.itemsize
    return as_strided(x[:, col0:], shape=(n_kv, x.shape[0], D), strides=(head_stride * item, x.strides[0], item))


def _prefill_attention_gpu(qkv, out, config: LlamaConfig, scale: float, plug=None):
    """One prompt: S = Q K^T (cuBLAS), P = causal softmax (kernel), O = P V (cuBLAS).

    Query heads are taken j = 0..r-1 at a time: heads {g*r + j} for all g form a batch with a fixed
    stride (r*D columns) whose KV head is g (stride D), so each cuBLAS call is a strided batch
    over the Hkv groups with no copy of K or V.
    """
    import cupy as cp
    T = qkv.shape[0]
    Hq, Hkv, D = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    r = Hq // Hkv
    k = _head_view(qkv, Hq * D, Hkv, D, D)                               # [Hkv, T, D]
    v = _head_view(qkv, (Hq + Hkv) * D, Hkv, D, D)                       # [Hkv, T, D]
    scores = cp.empty((Hkv, r, T, T), dtype=cp.float32)                  # head h = g*r + j
    probs = cp.empty((Hkv, r, T, T), dtype=cp.uint16)
    for j in range(r):
        matmul(_head_view(qkv, j * D, Hkv, r * D, D), k, scores[:, j], trans_b=True)
    threads = min(1024, max(32, 32 * ((T + 127) // 128)))
    softmax_kernel = plug.kernel() if plug is not None else load_kernel("attention", "causal_softmax")
    softmax_kernel((Hq * T,), (threads,), (scores, probs, np.int32(T), np.float32(scale)))
    for j in range(r):
        matmul(probs[:, j], v, _head_view(out, j * D, Hkv, r * D, D))
