"""Appendix (linear attention): the Gated DeltaNet token mixer of Qwen3.5's `linear_attention` layers.

Instead of attending over every earlier token, a linear-attention head keeps a fixed-size state
S [Dk, Dv] (a matrix that maps keys to values) and updates it once per token. Gated DeltaNet's update:

    S <- exp(g) * S                         gating: forget a little of everything (g <= 0)
    S <- S + beta * k (v - k^T S)^T         the delta rule: move k's prediction k^T S towards v
    o  = q^T S                              read the state with the query

with q and k L2-normalised (and q scaled by 1/sqrt(Dk)), beta = sigmoid(b) in (0, 1) the step size,
and g = -exp(A_log) * softplus(a + dt_bias) the log of the decay. Decode runs this recurrence one
token at a time; prefill runs the same math chunk by chunk, where most of the work becomes matrix
products (gated_delta_chunked_ref). Before the mixer, q, k and v pass through a causal depthwise
convolution over the last K tokens and a SiLU (causal_conv1d_ref): its state is the last K-1 inputs.

Heads: q and k have Hk heads, v has Hv (a multiple of Hk); value head h reads key head h // (Hv / Hk),
as transformers' repeat_interleave does. Everything here is float32 NumPy (the state stays fp32 on
every backend: it sums a whole sequence of updates).
"""
from __future__ import annotations

import numpy as np

from engine.backend import load_kernel
from engine.ops.swiglu import silu

L2_EPS = 1e-6     # transformers' (and the FLA library's) l2norm: x / sqrt(sum(x^2) + eps)


class GatedDeltaShapeError(ValueError):
    """Inputs of a gated delta op whose shapes do not fit together."""


# ---------------------------------------------------------------------------------------------
# The causal depthwise convolution (+ SiLU) in front of the mixer

def causal_conv1d_ref(x: np.ndarray, weight: np.ndarray, state: np.ndarray | None = None
                      ) -> tuple[np.ndarray, np.ndarray]:
    """x [T, C], weight [C, K], state [K-1, C] (the K-1 inputs before x; None: zeros, a fresh sequence)
    -> (silu(conv) [T, C], the new state [K-1, C]: the last K-1 inputs of state + x).

    out[t, c] = sum_j weight[c, j] * window[t + j, c], window = state then x: weight[c, K-1] multiplies
    the current token (PyTorch's conv1d is a cross-correlation, padded with K-1 zeros on the left)."""
    T, C = x.shape
    K = weight.shape[1]
    if weight.shape[0] != C or (state is not None and state.shape != (K - 1, C)):
        raise GatedDeltaShapeError(f"causal_conv1d: x {x.shape}, weight {weight.shape}, state "
                                   f"{None if state is None else state.shape} do not fit ([T, C], [C, K], [K-1, C])")
    if state is None:
        state = np.zeros((K - 1, C), dtype=np.float32)
    window = np.concatenate([state, x.astype(np.float32)], axis=0)          # [K-1+T, C]
    out = np.zeros((T, C), dtype=np.float32)
    for j in range(K):                                                       # K is 4: a short loop
        out += window[j:j + T] * weight[:, j]
    return silu(out), window[T:].copy()


def causal_conv1d_step_ref(x: np.ndarray, weight: np.ndarray, state: np.ndarray) -> np.ndarray:
    """One decode token: x [C] -> silu(conv) [C]; `state` [K-1, C] is shifted in place (oldest row out,
    x in). The same numbers as causal_conv1d_ref on a sequence of one token."""
    window = np.concatenate([state, x[None, :].astype(np.float32)], axis=0)   # [K, C]
    out = (window * weight.T).sum(axis=0)
    state[:] = window[1:]
    return silu(out)


# ---------------------------------------------------------------------------------------------
# Gates and normalisation

def softplus(x: np.ndarray) -> np.ndarray:
    """log(1 + exp(x)), without overflow; linear above 20 like torch.nn.functional.softplus."""
    return np.where(x > 20.0, x, np.log1p(np.exp(np.minimum(x, 20.0)))).astype(np.float32)


def sigmoid(x: np.ndarray) -> np.ndarray:
    """1 / (1 + exp(-x)); exp(-x) may overflow to inf for x < -88, which gives the right 0."""
    with np.errstate(over="ignore"):
        return (np.float32(1.0) / (np.float32(1.0) + np.exp(-x))).astype(np.float32)


def decay_log(a: np.ndarray, A_log: np.ndarray, dt_bias: np.ndarray) -> np.ndarray:
    """a [T, Hv] (in_proj_a x), A_log [Hv], dt_bias [Hv] -> g [T, Hv] = -exp(A_log) * softplus(a + dt_bias):
    the log of the per-token decay of each head's state (<= 0, so exp(g) is in (0, 1])."""
    return (-np.exp(A_log.astype(np.float32)) * softplus(a + dt_bias)).astype(np.float32)


def l2norm(x: np.ndarray) -> np.ndarray:
    """Each vector along the last axis divided by its length (eps inside the root, as transformers)."""
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + np.float32(L2_EPS))


def gated_rmsnorm_ref(x: np.ndarray, z: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x, z [..., Dv], weight [Dv] -> rmsnorm(x) * weight * silu(z): the mixer's output gate (Qwen3.5's
    RMSNormGated: normalise first, then gate; the weight is used as stored, no 1 + w)."""
    variance = np.mean(x * x, axis=-1, keepdims=True)
    return x / np.sqrt(variance + np.float32(eps)) * weight * silu(z)


def _prepare(q, k, v, g, beta, state):
    """Check shapes; return q, k repeated to the Hv value heads and L2-normalised (q also scaled by
    1/sqrt(Dk)), all [T, Hv, D] float32, and the state [Hv, Dk, Dv] (a float32 copy, or zeros)."""
    T, Hk, Dk = k.shape
    Hv, Dv = v.shape[1:]
    if (q.shape != k.shape or v.shape[0] != T or g.shape != (T, Hv) or beta.shape != (T, Hv)
            or Hv % Hk or (state is not None and state.shape != (Hv, Dk, Dv))):
        raise GatedDeltaShapeError(
            f"gated delta rule: q {q.shape}, k {k.shape}, v {v.shape}, g {g.shape}, beta {beta.shape}, state "
            f"{None if state is None else state.shape} do not fit (q, k [T, Hk, Dk]; v [T, Hv, Dv] with Hv a "
            "multiple of Hk; g, beta [T, Hv]; state [Hv, Dk, Dv])")
    repeat = Hv // Hk
    q = np.repeat(l2norm(q.astype(np.float32)), repeat, axis=1) * np.float32(Dk ** -0.5)
    k = np.repeat(l2norm(k.astype(np.float32)), repeat, axis=1)
    S = np.zeros((Hv, Dk, Dv), dtype=np.float32) if state is None else state.astype(np.float32, copy=True)
    return q, k, v.astype(np.float32), S


# ---------------------------------------------------------------------------------------------
# The recurrent form: one token at a time (decode)

def gated_delta_step_ref(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
                         state: np.ndarray) -> np.ndarray:
    """One token of one sequence. q, k [Hv, Dk] (already normalised, repeated to the value heads, q
    scaled), v [Hv, Dv], g, beta [Hv]; state [Hv, Dk, Dv] float32, updated in place -> o [Hv, Dv]."""
    state *= np.exp(g)[:, None, None]                                   # gate: decay the whole state
    predicted = np.einsum("hk,hkv->hv", k, state)                       # what the state says k maps to
    delta = (v - predicted) * beta[:, None]                             # [Hv, Dv] the correction
    state += k[:, :, None] * delta[:, None, :]                          # rank-1 write: k delta^T
    return np.einsum("hk,hkv->hv", q, state)                            # read with the query


def gated_delta_recurrent_ref(q, k, v, g, beta, state=None) -> tuple[np.ndarray, np.ndarray]:
    """q, k [T, Hk, Dk] (raw: normalised here), v [T, Hv, Dv], g, beta [T, Hv], state [Hv, Dk, Dv] or None
    -> (o [T, Hv, Dv], the state after the last token). The definition, one token at a time."""
    q, k, v, S = _prepare(q, k, v, g, beta, state)
    out = np.empty_like(v)
    for t in range(v.shape[0]):
        out[t] = gated_delta_step_ref(q[t], k[t], v[t], g[t], beta[t], S)
    return out, S


# ---------------------------------------------------------------------------------------------
# The chunked form: the same numbers, mostly matrix products (prefill)

def solve_unit_lower(A: np.ndarray, B: np.ndarray) -> np.ndarray:
    """X with (I + A) X = B for strictly lower-triangular A [..., C, C], B [..., C, D]: forward
    substitution, one row per step (row i needs rows < i), every chunk and head at once."""
    X = B.copy()
    for i in range(1, A.shape[-1]):
        X[..., i, :] -= np.einsum("...j,...jd->...d", A[..., i, :i], X[..., :i, :])
    return X


def gated_delta_chunked_ref(q, k, v, g, beta, state=None, chunk_size: int = 64
                            ) -> tuple[np.ndarray, np.ndarray]:
    """The same result as gated_delta_recurrent_ref, computed chunk by chunk (transformers'
    torch_chunk_gated_delta_rule; the WY / UT form of the DeltaNet paper).

    Inside a chunk of C tokens, with G_i = g_1 + ... + g_i the cumulative log decay from its start:
    the C delta-rule writes depend on each other only through a unit lower-triangular system
    (I + A) U = beta * V, A[i, j] = beta_i (k_i . k_j) exp(G_i - G_j) for j < i, solved once per chunk.
    Then, with S the state entering the chunk,
        V_new = U - W S                                (W solves the same system for beta k exp(G))
        O     = (Q exp(G)) S + mask(Q K^T exp(G_i - G_j)) V_new
        S    <- exp(G_C) S + (K exp(G_C - G))^T V_new
    Only the last line walks from chunk to chunk; everything else is a [C, C] or [C, D] matrix
    product, which is what tensor cores are for. Every exponent is <= 0: nothing overflows.
    The sequence is padded to whole chunks with tokens that change nothing (k = v = beta = g = 0)."""
    if chunk_size < 1:
        raise GatedDeltaShapeError(f"chunk_size must be >= 1, got {chunk_size}")
    q, k, v, S = _prepare(q, k, v, g, beta, state)
    T, Hv, Dk = k.shape
    C = chunk_size
    pad = -T % C
    N = (T + pad) // C

    def chunks(x):       # [T, Hv, ...] -> [N, Hv, C, ...], padded with zeros
        x = np.concatenate([x, np.zeros((pad, *x.shape[1:]), dtype=np.float32)])
        return x.reshape(N, C, Hv, *x.shape[2:]).swapaxes(1, 2)

    Q, K, V = chunks(q), chunks(k), chunks(v)                   # [N, Hv, C, D]
    B = chunks(beta.astype(np.float32))                         # [N, Hv, C]
    G = np.cumsum(chunks(g.astype(np.float32)), axis=-1)        # [N, Hv, C] cumulative log decay
    causal = np.tril(np.ones((C, C), dtype=bool))               # j <= i
    decay = np.exp(np.where(causal, G[..., :, None] - G[..., None, :], -np.inf))   # [N, Hv, C, C]
    A = np.where(np.tril(causal, -1), (B[..., None] * K) @ K.swapaxes(-1, -2) * decay, 0.0)
    U = solve_unit_lower(A, np.concatenate([B[..., None] * V, B[..., None] * K * np.exp(G)[..., None]], -1))
    U, W = U[..., :V.shape[-1]], U[..., V.shape[-1]:]          # [N, Hv, C, Dv], [N, Hv, C, Dk]
    intra = (Q @ K.swapaxes(-1, -2)) * decay                    # [N, Hv, C, C] within-chunk attention
    Q_decayed = Q * np.exp(G)[..., None]
    K_to_end = K * np.exp(G[..., -1:] - G)[..., None]
    out = np.empty_like(U)
    for n in range(N):                                          # the only walk: chunk to chunk
        v_new = U[n] - W[n] @ S
        out[n] = Q_decayed[n] @ S + intra[n] @ v_new
        S = S * np.exp(G[n, :, -1])[:, None, None] + K_to_end[n].swapaxes(-1, -2) @ v_new
    return out.swapaxes(1, 2).reshape(N * C, Hv, -1)[:T], S.astype(np.float32)


# ---------------------------------------------------------------------------------------------
# The CUDA kernels (kernels_cu/gated_delta.cu) on CuPy arrays, float32. A batch of S packed sequences
# (cu_seqlens [S + 1] on the host) and each sequence's slot (slots [S] int32 on the device) in a pool
# of states, updated in place: conv_pool [slots, K-1, C], delta_pool [slots, Hv, Dk, Dv].

GPU_MAX_HEAD_DIM = 128      # kernels_cu/gated_delta.cu: GDN_MAX_D (shared-memory tiles of that width)
GPU_MAX_CONV_WIDTH = 8      # CONV_MAX_K (the window lives in registers)
GDN_THREADS = 128           # threads per block of the conv and delta kernels (4 warps)


def check_gpu_gated_delta(config) -> None:
    """A hybrid model whose linear layers the kernels cannot take is refused when it is loaded on the GPU."""
    from engine.formats.config import ConfigError, HybridConfig
    if not isinstance(config, HybridConfig):
        return
    if max(config.linear_key_head_dim, config.linear_value_head_dim) > GPU_MAX_HEAD_DIM \
            or config.linear_conv_kernel_dim > GPU_MAX_CONV_WIDTH:
        raise ConfigError(f"{config.model_type}: the Gated DeltaNet kernels take head dims up to {GPU_MAX_HEAD_DIM} "
                          f"and a conv width up to {GPU_MAX_CONV_WIDTH}, the model has {config.linear_key_head_dim}/"
                          f"{config.linear_value_head_dim} and {config.linear_conv_kernel_dim} (load it with "
                          "backend='numpy')")


def _packed(cu_seqlens, T: int, cu_device=None):
    """(S, cu_seqlens [S + 1] int32 on the device) of a batch of T tokens. cu_seqlens: on the host
    (checked), or None for T sequences of one token each (a decode step, also inside a CUDA graph);
    cu_device: the same array already on the device (a forward pass copies it once for every layer)."""
    import cupy as cp
    if cu_seqlens is None:
        return T, cp.arange(T + 1, dtype=cp.int32) if cu_device is None else cu_device
    cu = np.asarray(cu_seqlens)
    if cu.ndim != 1 or cu.size < 2 or cu[0] != 0 or np.any(np.diff(cu) < 1):
        raise GatedDeltaShapeError(f"cu_seqlens must start at 0 and give every sequence at least one token, got {cu}")
    return int(cu.size - 1), cp.asarray(cu.astype(np.int32)) if cu_device is None else cu_device


def gates_gpu(proj, a_col: int, b_col: int, A_log, dt_bias):
    """proj [T, ld] fp32 (a at columns a_col.., b at b_col..) -> (g, beta) [T, Hv], as decay_log and sigmoid."""
    import cupy as cp
    T, Hv = proj.shape[0], A_log.shape[0]
    g, beta = cp.empty((T, Hv), cp.float32), cp.empty((T, Hv), cp.float32)
    if T:
        load_kernel("gated_delta", "gdn_gates")((min(-(-T * Hv // 256), 65535),), (256,),
                                                (proj, np.int64(proj.strides[0] // 4), np.int32(a_col), np.int32(b_col),
                                                 A_log, dt_bias, g, beta, np.int32(T), np.int32(Hv)))
    return g, beta


def causal_conv1d_gpu(x, weight, conv_pool, slots, cu_seqlens, cu_device=None):
    """x [T, ld] fp32 whose first C columns are the channels, weight [C, K] -> silu(conv) [T, C]; each
    sequence continues from its slot of conv_pool [slots, K-1, C] and leaves its last K-1 inputs there
    (cu_seqlens, cu_device: as _packed)."""
    import cupy as cp
    C, K = weight.shape
    if K > GPU_MAX_CONV_WIDTH or conv_pool.shape[1:] != (K - 1, C) or x.shape[1] < C:
        raise GatedDeltaShapeError(f"causal_conv1d_gpu: x {x.shape}, weight {weight.shape}, conv_pool "
                                   f"{conv_pool.shape} do not fit (K <= {GPU_MAX_CONV_WIDTH})")
    S, cu = _packed(cu_seqlens, x.shape[0], cu_device)
    out = cp.empty((x.shape[0], C), cp.float32)
    load_kernel("gated_delta", "causal_conv1d_silu")((-(-C // GDN_THREADS), S), (GDN_THREADS,),
                                                     (x, np.int64(x.strides[0] // 4), weight, conv_pool, conv_pool,
                                                      slots, cu, out, np.int32(C), np.int32(K)))
    return out


def gated_delta_gpu(qkv, heads: tuple[int, int, int, int], g, beta, delta_pool, slots, cu_seqlens,
                    chunked: bool = True, cu_device=None):
    """qkv [T, ld] fp32 (q heads, k heads, v heads: the conv's output), heads = (Hk, Hv, Dk, Dv),
    g, beta [T, Hv] -> o [T, Hv * Dv]; each sequence continues from its slot of delta_pool
    [slots, Hv, Dk, Dv] and leaves its state there. chunked: the prefill kernel; else token by token
    (decode). cu_seqlens, cu_device: as _packed."""
    import cupy as cp
    Hk, Hv, Dk, Dv = heads
    if max(Dk, Dv) > GPU_MAX_HEAD_DIM or Hv % Hk or delta_pool.shape[1:] != (Hv, Dk, Dv):
        raise GatedDeltaShapeError(f"gated_delta_gpu: heads {heads}, delta_pool {delta_pool.shape} do not fit "
                                   f"(Dk, Dv <= {GPU_MAX_HEAD_DIM}; Hv a multiple of Hk)")
    S, cu = _packed(cu_seqlens, qkv.shape[0], cu_device)
    out = cp.empty((qkv.shape[0], Hv * Dv), cp.float32)
    name = "gated_delta_chunked" if chunked else "gated_delta_recurrent"
    load_kernel("gated_delta", name)((Hv, S), (GDN_THREADS,),
                                     (qkv, np.int64(qkv.strides[0] // 4), g, beta, delta_pool, delta_pool, slots, cu,
                                      out, np.int32(Hk), np.int32(Hv), np.int32(Dk), np.int32(Dv)))
    return out


def gated_rmsnorm_gpu(o, z, weight, eps: float):
    """o [T, Hv * Dv] fp32, z [T, ld] fp32 (a column slice: the gate heads), weight [Dv] ->
    bf16 [T, Hv * Dv] = gated_rmsnorm_ref per head: out_proj's input."""
    import cupy as cp
    T, Dv = o.shape[0], weight.shape[0]
    Hv = o.shape[1] // Dv
    out = cp.empty((T, Hv * Dv), cp.uint16)
    if T:
        warps = GDN_THREADS // 32
        load_kernel("gated_delta", "gated_rmsnorm_silu")((min(-(-T * Hv // warps), 65535),), (GDN_THREADS,),
                                                         (o, z, np.int64(z.strides[0] // 4), weight, out, np.int32(T),
                                                          np.int32(Hv), np.int32(Dv), np.float32(eps)))
    return out


def attention_output_gate_gpu(attn, gate):
    """attn bf16 [T, n], gate [T, ld] fp32 (a column slice of n gate values per row) -> bf16 [T, n] =
    attn * sigmoid(gate): what Qwen3.5's full-attention layers feed o_proj."""
    import cupy as cp
    T, n = attn.shape
    out = cp.empty((T, n), cp.uint16)
    if T:
        load_kernel("gated_delta", "attention_output_gate")((min(-(-T * n // 256), 65535),), (256,),
                                                            (attn, gate, np.int64(gate.strides[0] // 4), out,
                                                             np.int32(T), np.int32(n)))
    return out
