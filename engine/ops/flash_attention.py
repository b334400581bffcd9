"""Prefill attention without a T x T score matrix: tiles and an online softmax (FlashAttention-2).

Queries are cut into tiles; each tile meets the keys of its causal range one key tile at a time,
keeping per query row a running max m, a running sum l and an unnormalized output O:
    S = q K_tile^T * scale,  m' = max(m, rowmax S),  P = exp(S - m'),
    l' = l exp(m - m') + rowsum P,  O' = O exp(m - m') + P V_tile,   and at the end O / l.
Memory is a tile of scores, linear in the length instead of quadratic.

Query row i of sequence s (rows cu_seqlens[s]:cu_seqlens[s+1]) sits at absolute position
positions[i] and attends to that sequence's keys at positions 0..positions[i]. The keys come
  * from the rows of the batch itself (a fresh prompt: positions start at 0), or
  * from the paged KV cache through page tables (a chunk of a prompt whose earlier tokens, or a
    cached prefix, are already in the cache; the chunk's own K/V are written there first).
Positions increase along each sequence. The CPU path is the NumPy reference below (float32); the
GPU path is kernels_cu/flash_attention.cu on the tensor cores (sm_80+, head_dim 16/32/64/128).
"""
from __future__ import annotations

import numpy as np

from engine.backend import is_device_array, load_kernel, tensor_cores_usable
from engine.formats.config import LlamaConfig
from engine.ops.qkv_layout import split_qkv

# The kernel's launch constants, passed to it as -D defines (its .cu file repeats them as defaults for a
# plain nvcc build; tests/test_kernels_compile.py checks that the two agree).
NWARPS = 4                   # warps per CTA; each owns 16 query rows (the M of mma.m16n8k16)
BLOCK_M = 16 * NWARPS        # query rows per CTA
BLOCK_N = 64                 # keys per shared-memory tile
KERNEL_HEAD_DIMS = (16, 32, 64, 128)

# The NumPy reference's tiles: bigger than the kernel's, since each tile costs Python overhead.
REF_BLOCK_Q = 256
REF_BLOCK_K = 512


class FlashAttentionInputError(ValueError):
    """The sequences, positions or page tables handed to flash attention do not fit together."""


def _check_layout(T: int, cu_seqlens: np.ndarray, positions: np.ndarray, paged: bool) -> None:
    if cu_seqlens.ndim != 1 or len(cu_seqlens) < 2 or cu_seqlens[0] != 0 or cu_seqlens[-1] != T \
            or np.any(np.diff(cu_seqlens) < 0):
        raise FlashAttentionInputError(f"cu_seqlens must rise from 0 to {T} (the number of rows), got {cu_seqlens}")
    if positions.shape != (T,):
        raise FlashAttentionInputError(f"positions must have one entry per row ({T}), got shape {positions.shape}")
    if T and positions.min() < 0:
        raise FlashAttentionInputError("positions must be >= 0")
    starts = cu_seqlens[:-1][np.diff(cu_seqlens) > 0]
    if not paged and np.any(positions[starts] != 0):
        raise FlashAttentionInputError("without a KV cache every sequence must start at position 0")


def flash_attention_ref(q: np.ndarray, k: np.ndarray, v: np.ndarray, cu_seqlens, positions, scale: float,
                        page_tables=None, block_q: int = REF_BLOCK_Q, block_k: int = REF_BLOCK_K) -> np.ndarray:
    """Tiled causal attention with the online softmax, float32.

    q [T, Hq, D]; positions [T]; cu_seqlens [S + 1].
    Without page_tables: k, v [T, Hkv, D], key j of sequence s is row cu_seqlens[s] + j.
    With page_tables [S, MP]: k, v are caches [NP, PS, Hkv, D], key j of sequence s is at page
    page_tables[s, j // PS], offset j % PS.
    Returns [T, Hq, D]. The largest temporary is one tile of scores [block_q * Hq / Hkv, block_k].
    """
    T, Hq, D = q.shape
    Hkv = k.shape[-2]
    r = Hq // Hkv
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    pos = np.asarray(positions, dtype=np.int64)
    _check_layout(T, cu, pos, page_tables is not None)
    k_rows, v_rows = k.reshape(-1, Hkv, D), v.reshape(-1, Hkv, D)     # [N, Hkv, D] views
    page_size = k.shape[1] if page_tables is not None else 0        # 0: no pages, keys are batch rows
    out = np.empty((T, Hq, D), dtype=np.float32)                      # viewed below as [T, Hkv, r, D]
    out_groups = out.reshape(T, Hkv, r, D)
    for s in range(len(cu) - 1):
        for q0 in range(int(cu[s]), int(cu[s + 1]), block_q):
            q1 = min(q0 + block_q, int(cu[s + 1]))
            n = q1 - q0
            row_pos = np.repeat(pos[q0:q1], r)                            # [n * r]: rows ordered (token, head)
            kv_len = int(pos[q1 - 1]) + 1
            for g in range(Hkv):                                          # one KV head and its r query heads
                qg = (q[q0:q1, g * r:(g + 1) * r] * np.float32(scale)).reshape(n * r, D)
                m = np.full(n * r, -np.inf, dtype=np.float32)             # running max
                l = np.zeros(n * r, dtype=np.float32)                     # running sum
                acc = np.zeros((n * r, D), dtype=np.float32)              # unnormalized output
                for k0 in range(0, kv_len, block_k):                      # key 0 first: every row sees it
                    key_pos = np.arange(k0, min(k0 + block_k, kv_len))
                    if page_tables is None:
                        rows = cu[s] + key_pos
                    else:
                        rows = page_tables[s][key_pos // page_size].astype(np.int64) * page_size + key_pos % page_size
                    scores = qg @ k_rows[rows, g].T                       # [n * r, nk]
                    if key_pos[-1] > row_pos[0]:                          # the tile reaches past some row
                        scores[key_pos[None, :] > row_pos[:, None]] = -np.inf
                    m_new = np.maximum(m, scores.max(axis=1))
                    alpha = np.exp(m - m_new)                             # 0 on the first tile
                    p = np.exp(scores - m_new[:, None], out=scores)       # P, in place of the scores
                    l = l * alpha + p.sum(axis=1)
                    acc *= alpha[:, None]
                    acc += p @ v_rows[rows, g]
                    m = m_new
                out_groups[q0:q1, g] = (acc / l[:, None]).reshape(n, r, D)
    return out


def kernel_supports(config: LlamaConfig) -> bool:
    """Whether the CUDA kernel runs this shape on this GPU: bf16 mma.sync needs sm_80 (Ampere) or
    newer, and the tiles are specialized for head_dim 16/32/64/128. Otherwise the model falls back
    to the chapter 06 (cuBLAS + causal softmax) and chapter 11 (paged) kernels."""
    import cupy
    return config.head_dim in KERNEL_HEAD_DIMS and tensor_cores_usable(cupy.cuda.Device().id)


def flash_attention(qkv, cu_seqlens, positions, config: LlamaConfig, k_cache=None, v_cache=None, page_tables=None,
                    *, cu_seqlens_device=None):
    """Causal attention of the packed sequences of qkv [T, (Hq + 2Hkv) * D] (after RoPE) -> [T, Hq * D].

    cu_seqlens: host int array [S + 1]. positions: [T] on the backend's device. With page_tables
    [S, MP] (device) the keys and values are read from k_cache/v_cache [NP, PS, Hkv, D] (the
    batch's own K/V already written there); without, from qkv (every sequence starts at 0).
    CPU: float32 NumPy reference. GPU: the kernel, bf16 out; `cu_seqlens_device` saves an upload
    when the caller already has cu_seqlens on the GPU (one per forward pass instead of per layer).
    """
    scale = config.head_dim ** -0.5
    T = qkv.shape[0]
    cu_host = np.asarray(cu_seqlens, dtype=np.int32)
    paged = page_tables is not None
    if not is_device_array(qkv):
        q, k, v = split_qkv(qkv, config)
        if paged:
            k, v = k_cache, v_cache
        out = flash_attention_ref(q, k, v, cu_host, positions, scale, np.asarray(page_tables) if paged else None)
        return out.reshape(T, -1)
    import cupy as cp
    Hq, Hkv, D = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    out = cp.empty((T, Hq * D), dtype=cp.uint16)
    lengths = np.diff(cu_host)
    if T == 0:
        return out
    if cu_seqlens_device is None:
        cu_seqlens_device = cp.asarray(cu_host)
    if paged:
        k_src, v_src, kv_stride, k_col, v_col = k_cache, v_cache, Hkv * D, 0, 0
        tables, max_pages, page_size = page_tables, page_tables.shape[1], k_cache.shape[1]
    else:
        k_src = v_src = qkv
        kv_stride, k_col, v_col = qkv.shape[1], Hq * D, (Hq + Hkv) * D
        tables, max_pages, page_size = cu_seqlens_device, 0, 1        # unused by the PAGED 0 kernel
    grid = (Hq, int(-(-lengths.max() // BLOCK_M)), len(lengths))     # (head, query tile, sequence)
    kernel = load_kernel("flash_attention", "flash_attention", HEAD_DIM=D, NWARPS=NWARPS, BLOCK_N=BLOCK_N,
                         PAGED=int(paged))
    kernel(grid, (32 * NWARPS,),
           (qkv, np.int64(qkv.shape[1]), k_src, v_src, np.int64(kv_stride), np.int32(k_col), np.int32(v_col),
            cu_seqlens_device, positions, tables, np.int32(max_pages), np.int32(page_size),
            np.int32(Hq // Hkv), np.float32(scale * np.log2(np.e)), out, np.int64(Hq * D)))
    return out
