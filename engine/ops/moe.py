"""Appendix (mixture of experts): Qwen3-MoE's sparse MLP, a router and `num_experts` SwiGLU experts.

Per token x [H], on a sparse layer:
    logits = x @ router^T                        [E]
    p      = softmax(logits)                     over all E experts
    top    = the k largest p (ties: the lower expert index first; torch.topk leaves ties unspecified)
    w      = p[top] / sum(p[top])                only when norm_topk_prob; else p[top] as they are
    out    = sum_j w_j * down_e( silu(gate_e(x)) * up_e(x) ),  e = top_j
transformers' Qwen3MoeTopKRouter in this order: softmax over all E first, top-k of the probabilities,
then the renormalisation. (Softmax of the k logits alone gives the same weights as the
renormalised probabilities, but not the same weights without renormalisation.)

CPU (the references, float32): one pass over the experts that were chosen, each on its tokens.

GPU (kernels_cu/moe.cu), five launches per layer whatever E is, none per expert:
    router logits   linear() (cuBLAS, or the GEMV at decode)       [T, E] fp32
    moe_route       softmax + top-k + renormalise, a warp per token  weights, experts [T, k]
    moe_group       a counting sort of the T*k (token, expert) pairs by expert: per-expert offsets,
                    the token of each grouped row, the grouped row of each pair, and a list of
                    row tiles (expert, first row) of at most MOE_TILE_M rows of one expert each
    moe_expert_gemm x 2   every tile of every expert in one launch (gate_up, then down after
                    swiglu); a tile reads only its own expert's rows of W. At decode (T*k rows
                    over few experts) only the chosen experts' weights are read at all
    moe_combine     out[t] = sum_j w[t, j] * y[row of (t, j)], in j order (deterministic: no atomics)
Everything stays on the device, sized by T alone (the tile count is read by the kernels, not by the
host), so a decode step with a sparse layer can still be captured as a CUDA graph.
"""
from __future__ import annotations

import numpy as np

from engine.backend import is_device_array, load_kernel
from engine.formats.config import ConfigError, LlamaConfig, MoeSettings
from engine.ops.linear import linear, linear_ref
from engine.ops.swiglu import swiglu
from engine.plugins import OVERRIDES, PluginError, to_host

# Launch constants of kernels_cu/moe.cu (its #ifndef defaults repeat them; tests/test_kernels_compile.py
# checks that they agree)
MOE_TILE_M = 16          # grouped rows of one expert per tile (the rows a block computes)
MOE_TILE_N = 64          # output columns per block
MOE_MAX_EXPERTS = 1024   # the routing and grouping kernels keep a value per expert in shared memory
GROUP_THREADS = 1024     # one block sorts every (token, expert) pair of the step
GEMM_THREADS = 16 * MOE_TILE_M   # the kernel's layout: 16 threads per grouped row of a tile


def softmax_ref(logits: np.ndarray) -> np.ndarray:
    """Row-wise softmax in float32, the largest logit subtracted first (exp never overflows)."""
    z = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return z / z.sum(axis=-1, keepdims=True)


def router_ref(logits: np.ndarray, k: int, norm_topk_prob: bool) -> tuple[np.ndarray, np.ndarray]:
    """logits [T, E] float32 -> (weights [T, k] float32, experts [T, k] int32), each row's experts in
    order of decreasing probability, ties to the lower index (a stable sort of -p)."""
    probs = softmax_ref(logits.astype(np.float32))                          # [T, E]
    experts = np.argsort(-probs, axis=-1, kind="stable")[:, :k].astype(np.int32)
    weights = np.take_along_axis(probs, experts, axis=-1)                   # [T, k]
    if norm_topk_prob:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return weights.astype(np.float32), experts


def experts_ref(h: np.ndarray, weights: np.ndarray, experts: np.ndarray, gate_up: np.ndarray,
                down: np.ndarray) -> np.ndarray:
    """h [T, H], weights/experts [T, k], gate_up [E, 2I, H], down [E, H, I] -> [T, H] float32: each
    chosen expert runs once on all the tokens that chose it (in expert order, as transformers does)."""
    out = np.zeros((h.shape[0], down.shape[1]), dtype=np.float32)          # [T, H]
    for e in np.unique(experts):
        rows, slot = np.nonzero(experts == e)       # a token picks an expert at most once: rows distinct
        y = linear_ref(swiglu(linear_ref(h[rows], gate_up[e])), down[e])    # [n_e, H]
        out[rows] += weights[rows, slot, None] * y
    return out


def moe_ref(h: np.ndarray, router: np.ndarray, gate_up: np.ndarray, down: np.ndarray, k: int,
            norm_topk_prob: bool) -> np.ndarray:
    """The whole sparse MLP of one layer: h [T, H] float32 -> [T, H] float32."""
    weights, experts = router_ref(linear_ref(h, router), k, norm_topk_prob)
    return experts_ref(h, weights, experts, gate_up, down)


def check_gpu_moe(config: LlamaConfig) -> None:
    """Refuse, before any weight is read, a mixture of experts the GPU kernels cannot run."""
    if config.moe is not None and config.moe.num_experts > MOE_MAX_EXPERTS:
        raise ConfigError(f"config.json: num_experts={config.moe.num_experts}: the GPU backend's expert "
                          f"kernels take at most {MOE_MAX_EXPERTS} experts (the NumPy backend runs it)")


# ------------------------------------------------------------------------------------------------
# The op the forward pass calls

def moe(h, layer, settings: MoeSettings):
    """A sparse layer's MLP: h [T, H] (float32 on the CPU, bf16 bits on the GPU) and the layer's
    ExpertWeights -> [T, H] float32 on the backend."""
    logits = linear(h, layer.router)                                        # [T, E] fp32
    weights, experts = route(logits, settings.experts_per_token, settings.norm_topk_prob)
    if not is_device_array(h):
        return experts_ref(h, weights, experts, layer.gate_up, layer.down)
    return grouped_experts(h, weights, experts, layer.gate_up, layer.down)


def route(logits, k: int, norm_topk_prob: bool):
    """(weights [T, k] float32, experts [T, k] int32) on the logits' backend; the "moe_router" stage
    (engine/plugins.py) when one is active."""
    plug = OVERRIDES.get("moe_router")
    T, E = logits.shape
    if plug is not None and (plug.fn is not None or not is_device_array(logits)):
        weights, experts = _learner_route(plug.require_function(), to_host(logits), k, norm_topk_prob)
        if is_device_array(logits):
            import cupy as cp
            return cp.asarray(weights), cp.asarray(experts)
        return weights, experts
    if not is_device_array(logits):
        return router_ref(logits, k, norm_topk_prob)
    import cupy as cp
    weights, experts = cp.empty((T, k), dtype=cp.float32), cp.empty((T, k), dtype=cp.int32)
    if T:
        kernel = (plug.kernel(MOE_MAX_EXPERTS=MOE_MAX_EXPERTS) if plug is not None
                  else load_kernel("moe", "moe_route", MOE_MAX_EXPERTS=MOE_MAX_EXPERTS))
        kernel((T,), (32,), (logits, weights, experts, np.int32(E), np.int32(k), np.int32(norm_topk_prob)))
    return weights, experts


def _learner_route(fn, logits: np.ndarray, k: int, norm_topk_prob: bool):
    """The learner's router on host logits, its answer checked: (weights [T, k] float32, experts
    [T, k] int32 in [0, E)), else a PluginError saying what is wrong."""
    T, E = logits.shape
    got = fn(logits, k, norm_topk_prob)
    if not (isinstance(got, tuple) and len(got) == 2):
        raise PluginError("your moe_router must return a pair (weights [T, k], experts [T, k])")
    weights, experts = np.asarray(got[0], dtype=np.float32), np.asarray(got[1])
    if weights.shape != (T, k) or experts.shape != (T, k):
        raise PluginError(f"your moe_router returned shapes {weights.shape} and {experts.shape}; "
                          f"the model needs {(T, k)} for both")
    if not np.issubdtype(experts.dtype, np.integer) or (experts.size and not 0 <= experts.min() <= experts.max() < E):
        raise PluginError(f"your moe_router's experts must be integers in [0, {E})")
    return weights, experts.astype(np.int32)


def tile_bound(rows: int, num_experts: int) -> int:
    """The most row tiles `rows` grouped rows can make over `num_experts` experts: each expert's
    rows are cut in tiles of MOE_TILE_M, so at most one partial tile per expert; and never more
    tiles than rows (each tile holds at least one)."""
    return min(rows, -(-rows // MOE_TILE_M) + num_experts)


def grouped_experts(h, weights, experts, gate_up, down):
    """GPU: h bf16 [T, H], weights fp32 / experts int32 [T, k], gate_up bf16 [E, 2I, H], down bf16
    [E, H, I] -> fp32 [T, H]. The launches are in the module docstring; no host sync."""
    import cupy as cp
    T, k = experts.shape
    E, two_i, H = gate_up.shape
    R = T * k                                     # grouped rows: one per (token, chosen expert)
    out = cp.empty((T, H), dtype=cp.float32)
    if R == 0:
        return out
    tiles = tile_bound(R, E)
    offsets = cp.empty(E + 1, dtype=cp.int32)     # expert e owns grouped rows offsets[e]:offsets[e+1]
    row_token = cp.empty(R, dtype=cp.int32)       # the token of each grouped row
    pair_row = cp.empty(R, dtype=cp.int32)        # the grouped row of pair t*k + j
    tile_expert, tile_start = cp.empty(tiles, dtype=cp.int32), cp.empty(tiles, dtype=cp.int32)
    num_tiles = cp.empty(1, dtype=cp.int32)
    load_kernel("moe", "moe_group", MOE_TILE_M=MOE_TILE_M, MOE_MAX_EXPERTS=MOE_MAX_EXPERTS)(
        (1,), (GROUP_THREADS,),
        (experts, np.int32(R), np.int32(k), np.int32(E), offsets, row_token, pair_row,
         tile_expert, tile_start, num_tiles))
    gemm = load_kernel("moe", "moe_expert_gemm", MOE_TILE_M=MOE_TILE_M, MOE_TILE_N=MOE_TILE_N)
    tiling = (tile_expert, tile_start, offsets, num_tiles)

    def grouped_linear(x, gather: bool, w):      # x [*, K] bf16, w [E, N, K] bf16 -> [R, N] fp32
        N, K = w.shape[1], w.shape[2]
        y = cp.empty((R, N), dtype=cp.float32)
        gemm((tiles, -(-N // MOE_TILE_N)), (GEMM_THREADS,),
             (x, row_token, np.int32(gather), w, *tiling, y, np.int32(N), np.int32(K)))
        return y

    act = swiglu(grouped_linear(h, True, gate_up))     # [R, I] bf16; x rows gathered from the tokens
    y = grouped_linear(act, False, down)               # [R, H] fp32; act is in grouped order already
    load_kernel("moe", "moe_combine")((T,), (256,), (y, pair_row, weights, out, np.int32(k), np.int32(H)))
    return out
