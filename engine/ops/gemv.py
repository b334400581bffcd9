"""Chapter 14: the decode projections as a GEMV, at the speed of memory.

A decode step multiplies a few rows of activations (T = 1..8, one per sequence of the batch) by
every weight matrix W [N, K]. The arithmetic is tiny; the time is reading W once: N * K * 2 bytes at
copy bandwidth is the floor (Llama-3.2-1B reads ~2.5 GB of weights per step, ~0.6 ms on an H200).
cuBLAS is tuned for large GEMMs and leaves part of the bandwidth unused at these shapes; the kernel
kernels_cu/gemv.cu reads each byte of W once with 16-byte loads, many of them in flight, and lets
the tensor cores do the multiply (all 8 rows for the price of one; sm_80+). Its layout is described
at the top of the .cu file.

`linear()` (engine/ops/linear.py) routes 1 <= T <= GEMV_MAX_ROWS here when the switch is on. The
NumPy reference is linear_ref: out = x @ W^T.
"""
from __future__ import annotations

import numpy as np

from engine.backend import load_kernel, sm_count, tensor_cores_usable

# The kernel's launch constants, passed to it as -D defines (its .cu file repeats them as defaults for a
# plain nvcc build; tests/test_kernels_compile.py checks that the two agree).
GEMV_MAX_ROWS = 8     # rows of x per launch: the n = 8 of mma.m16n8k16
NWARPS = 16           # most warps per block (the block's warps split K); sizes the launch bounds
UNROLL = 4            # k-blocks per main-loop step: 3 UNROLL 16-byte loads in flight per thread
# Fixed by the kernel's layout (kernels_cu/gemv.cu), used here to size the grid:
TILE_N = 16           # output columns per block (16 rows of W: the M of the mma)
KBLOCK = 32           # k per warp per main-loop k-block
WARPS_PER_SM = 32     # resident warps the kernel's launch bounds leave registers for (64 each)


class GemvInputError(ValueError):
    """Operands that the GEMV kernel cannot take (dtype, shape, layout, too many rows)."""


def launch_geometry(N: int, K: int, sms: int) -> tuple[int, int]:
    """(blocks, warps per block) for out [T, N] = x [T, K] @ W[N, K]^T on a GPU with `sms` SMs.

    One block per 16 output columns. A wide W (lm_head, gate_up) has blocks enough to fill every
    SM with a warp each; a narrow one (o, down: 128 blocks for 132 SMs) would leave most warp slots
    empty, so its blocks get more warps, which split K between them, as long as each warp keeps at
    least one main-loop step (UNROLL k-blocks) of its own.
    """
    tiles = -(-N // TILE_N)
    kblocks = -(-K // KBLOCK)
    warps = 1
    while warps < NWARPS and tiles * warps < WARPS_PER_SM * sms and kblocks >= 2 * warps * UNROLL:
        warps *= 2
    return tiles, warps


def row_stride(a, name: str, itemsize: int, error: type[GemvInputError] = GemvInputError, what: str = "gemv") -> int:
    """Row stride in elements of a 2-D view whose rows are contiguous (`error` names `what` otherwise)."""
    if a.ndim != 2 or a.strides[1] != itemsize or a.strides[0] < 0 or a.strides[0] % itemsize:
        raise error(f"{what}: {name} must be 2-D with contiguous rows, got shape {a.shape} strides {a.strides}")
    return a.strides[0] // itemsize


def float_output(out, T: int, N: int, error: type[GemvInputError] = GemvInputError, what: str = "gemv"):
    """The fp32 [T, N] output of a GEMV: `out` checked, or a new array from CuPy's current allocator."""
    import cupy as cp
    if out is None:
        return cp.empty((T, N), dtype=cp.float32)
    if out.dtype != np.float32 or out.shape != (T, N):
        raise error(f"{what}: out must be float32 {(T, N)}, got {out.dtype} {out.shape}")
    return out


def gemv(x, w, out=None):
    """out [T, N] fp32 = x [T, K] @ w[N, K]^T on the GPU, x and w bf16 (uint16 bits), 1 <= T <= 8.

    Views with a row stride are fine; the 16-byte-load kernel runs when K % 8 == 0 and every row
    starts 16-byte aligned, the element-load one otherwise (same results). `out`, if given, is
    overwritten. Graph-capturable: no host sync, the output comes from CuPy's current allocator.
    """
    import cupy as cp
    if x.dtype != np.uint16 or w.dtype != np.uint16:
        raise GemvInputError(f"gemv: x and w must be bf16 bits (uint16), got {x.dtype} and {w.dtype}")
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1]:
        raise GemvInputError(f"gemv: shapes do not chain: x{x.shape} w{w.shape} (want [T, K] and [N, K])")
    T, K = x.shape
    N = w.shape[0]
    device = cp.cuda.Device().id
    if not tensor_cores_usable(device):
        raise GemvInputError("gemv: needs an sm_80+ GPU (bf16 mma.sync); linear() uses cuBLAS below that")
    if not 1 <= T <= GEMV_MAX_ROWS:
        raise GemvInputError(f"gemv: takes 1 to {GEMV_MAX_ROWS} rows of x, got {T}")
    out = float_output(out, T, N)
    if N == 0 or K == 0:
        out.fill(0)                   # an empty sum (nothing at all when N == 0)
        return out
    ldx, ldw, ldo = row_stride(x, "x", 2), row_stride(w, "w", 2), row_stride(out, "out", 4)
    aligned = (K % 8 == 0 and ldx % 8 == 0 and ldw % 8 == 0
               and x.data.ptr % 16 == 0 and w.data.ptr % 16 == 0)
    blocks, warps = launch_geometry(N, K, sm_count(device))
    kernel = load_kernel("gemv", "gemv_bf16" if aligned else "gemv_bf16_unaligned",
                         GEMV_MAX_ROWS=GEMV_MAX_ROWS, NWARPS=NWARPS, UNROLL=UNROLL)
    kernel((blocks,), (32 * warps,),
           (x, np.int64(ldx), w, np.int64(ldw), out, np.int64(ldo), np.int32(T), np.int32(N), np.int32(K)),
           shared_mem=0 if warps == 1 else 32 * 16 * warps)       # one float4 per thread of warps 1..
    return out


def supported(x, w, out=None) -> bool:
    """Whether linear() may hand x @ w^T to gemv(): bf16 operands, 1..GEMV_MAX_ROWS rows, an fp32
    output (or none), sm_80+. Cheap: it runs for every projection of every step."""
    import cupy as cp
    return (x.dtype == np.uint16 and w.dtype == np.uint16 and x.ndim == 2 and w.ndim == 2
            and 1 <= x.shape[0] <= GEMV_MAX_ROWS and (out is None or out.dtype == np.float32)
            and tensor_cores_usable(cp.cuda.Device().id))
