"""Chapter 18: quantized projections on the GPU, int4 and int8 weights read at the speed of memory.

A weight-only quantized projection (engine/ops/quantization.py: the layout and the NumPy references)
stores W [N, K] as packed codes q with a scale s and a zero point z per group of G inputs; it
computes out = x @ W^T with W = (q - z) * s. A decode step (T = 1..8 rows) is a pass over the
weights, so reading K * bits / 8 bytes per row instead of bf16's 2 K is the whole point: int4 reads
about a quarter of the bytes. Two kernels (kernels_cu/quant_gemv.cu, whose header describes them):

  * `quant_gemv` (1 <= T <= QGEMV_MAX_ROWS): one warp per output row streams its packed words with
    16-byte loads, unpacks them in registers and multiplies by x, fp32 throughout; it matches
    quant_linear_ref up to the order of the fp32 sums.
  * `dequantize_bf16` (the prefill path, T > QGEMV_MAX_ROWS): W as a bf16 [N, K] matrix, bit for bit
    f32_to_bf16(dequantize_ref(qw)), for the cuBLAS GEMM (engine/backend.py matmul) to multiply.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from engine.backend import load_kernel
from engine.ops.gemv import GemvInputError, float_output, row_stride
from engine.ops.quantization import BITS, QuantizedWeight

# The kernel's launch constants, passed to it as -D defines (its .cu file repeats them as defaults for a
# plain nvcc build; tests/test_kernels_compile.py checks that the two agree).
QGEMV_MAX_ROWS = 8    # rows of x per launch (the decode batch)
QGEMV_WARPS = 8       # output rows per block: one warp each
QGEMV_UNROLL = 4      # 16-byte chunks of a weight row in flight per lane
CHUNK_BYTES = 16      # the kernel's vector load
DEQUANT_THREADS = 256


class QuantGemvInputError(GemvInputError):
    """Operands that the quantized GEMV or dequantize kernels cannot take (dtype, shape, layout, rows)."""


def _check_weight(qw: QuantizedWeight, what: str) -> tuple[int, int, int]:
    """(N, K, G) of a device QuantizedWeight whose three arrays have the engine layout, contiguous."""
    if qw.bits not in BITS:
        raise QuantGemvInputError(f"{what}: bits must be one of {BITS}, got {qw.bits!r}")
    N, K = qw.shape
    G = qw.group_size
    per_word = 32 // qw.bits
    if G <= 0 or K % G or G % per_word:
        raise QuantGemvInputError(f"{what}: group size {G} must divide K = {K} and be a multiple of {per_word}")
    want = {"qweight": (np.uint32, (N, K // per_word)), "scales": (np.float16, (N, K // G)),
            "zeros": (np.uint8, (N, K // G))}
    for name, (dtype, shape) in want.items():
        a = getattr(qw, name)
        if a.dtype != dtype or tuple(a.shape) != shape or not a.flags.c_contiguous:
            raise QuantGemvInputError(f"{what}: {name} must be a contiguous {np.dtype(dtype).name} {shape}, got "
                                      f"{a.dtype} {tuple(a.shape)}{'' if a.flags.c_contiguous else ' (strided)'}")
    return N, K, G


def quant_gemv(x, qw: QuantizedWeight, out=None):
    """out [T, N] fp32 = x [T, K] @ dequantize(qw)^T on the GPU, x bf16 (uint16 bits), 1 <= T <= 8.

    x may be a view with a row stride. The 16-byte-load kernel runs when every qweight row is a
    whole number of 16-byte chunks, a chunk stays inside one group and x's rows are 16-byte aligned;
    the word-at-a-time one otherwise (the same sums in another order). `out`, if given, is
    overwritten. Graph-capturable: no host sync, the output comes from CuPy's current allocator.
    """
    N, K, G = _check_weight(qw, "quant_gemv")
    if x.dtype != np.uint16 or x.ndim != 2 or x.shape[1] != K:
        raise QuantGemvInputError(f"quant_gemv: x must be bf16 bits (uint16) [T, {K}], got {x.dtype} {x.shape}")
    T = x.shape[0]
    if not 1 <= T <= QGEMV_MAX_ROWS:
        raise QuantGemvInputError(f"quant_gemv: takes 1 to {QGEMV_MAX_ROWS} rows of x, got {T} "
                                  "(more rows: dequantize_bf16, then a GEMM)")
    out = float_output(out, T, N, QuantGemvInputError, "quant_gemv")
    if N == 0 or K == 0:
        out.fill(0)                   # an empty sum (nothing at all when N == 0)
        return out
    ldx, ldo = (row_stride(a, name, size, QuantGemvInputError, "quant_gemv") for a, name, size in
                ((x, "x", 2), (out, "out", 4)))
    qweight: Any = qw.qweight                          # a CuPy array (the dataclass types it as any array)
    per_chunk = CHUNK_BYTES * 8 // qw.bits            # values per 16-byte chunk: 32 (int4) or 16 (int8)
    vec = (K % per_chunk == 0 and G % per_chunk == 0 and qweight.data.ptr % CHUNK_BYTES == 0
           and ldx % 8 == 0 and x.data.ptr % 16 == 0)
    name = f"quant_gemv_int{qw.bits}" + ("" if vec else "_unaligned")
    kernel = load_kernel("quant_gemv", name, QGEMV_MAX_ROWS=QGEMV_MAX_ROWS, QGEMV_WARPS=QGEMV_WARPS,
                         QGEMV_UNROLL=QGEMV_UNROLL)
    kernel((-(-N // QGEMV_WARPS),), (32 * QGEMV_WARPS,),
           (x, np.int64(ldx), qw.qweight, qw.scales, qw.zeros, out, np.int64(ldo),
            np.int32(T), np.int32(N), np.int32(K), np.int32(G)))
    return out


def dequantize_bf16(qw: QuantizedWeight, out=None):
    """W [N, K] as bf16 bits (uint16) on the GPU: f32_to_bf16(dequantize_ref(qw)), bit for bit.

    `out`, if given, is a contiguous uint16 [N, K] array (a scratch matrix reused across layers).
    """
    import cupy as cp
    N, K, G = _check_weight(qw, "dequantize_bf16")
    if out is None:
        out = cp.empty((N, K), dtype=cp.uint16)
    elif out.dtype != np.uint16 or out.shape != (N, K) or not out.flags.c_contiguous:
        raise QuantGemvInputError(f"dequantize_bf16: out must be a contiguous uint16 {(N, K)}, got {out.dtype} "
                                  f"{out.shape}")
    words = N * K * qw.bits // 32
    if words == 0:
        return out
    kernel = load_kernel("quant_gemv", f"dequantize_bf16_int{qw.bits}", QGEMV_MAX_ROWS=QGEMV_MAX_ROWS,
                         QGEMV_WARPS=QGEMV_WARPS, QGEMV_UNROLL=QGEMV_UNROLL)
    kernel((-(-words // DEQUANT_THREADS),), (DEQUANT_THREADS,),
           (qw.qweight, qw.scales, qw.zeros, out, np.int32(N), np.int32(K), np.int32(G)))
    return out


def supported(x, qw: QuantizedWeight, out=None) -> bool:
    """Whether a projection may hand x @ dequantize(qw)^T to quant_gemv(): bf16 x with 1..QGEMV_MAX_ROWS
    rows of K inputs, an fp32 output (or none). Cheap: it runs for every projection of every step."""
    return (x.dtype == np.uint16 and x.ndim == 2 and 1 <= x.shape[0] <= QGEMV_MAX_ROWS
            and x.shape[1] == qw.shape[1] and qw.bits in BITS and (out is None or out.dtype == np.float32))
