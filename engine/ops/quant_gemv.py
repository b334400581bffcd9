"""Chapter 18: quantized projections on the GPU, int4 and int8 weights read at the speed of memory.

A weight-only quantized projection (engine/ops/quantization.py: the layout and the NumPy references)
stores W [N, K] as packed codes q with a scale s and a zero point z per group of G inputs; it
computes out = x @ W^T with W = (q - z) * s. A decode step (a few rows of x) is a pass over the
weights, so reading K * bits / 8 bytes per row instead of bf16's 2 K is the whole point: int4 reads
about a quarter of the bytes. The kernels (kernels_cu/quant_gemv.cu, whose header describes them):

  * `quant_mma_int4` / `_int8` (sm_80+, 1 <= T <= QMMA_MAX_ROWS): the layout of the bf16 GEMV
    (engine/ops/gemv.py) with the unpacking in front of the tensor cores: each lane streams 16-byte
    chunks of two weight rows, turns them into bf16 pairs in registers (two int4 values per
    instruction) and feeds them to mma.m16n8k16 with x; W in bf16 (the scale rounded to bf16 first),
    fp32 accumulation, like the bf16 GEMV on the dequantized matrix.
  * `quant_gemv_int4` / `_int8` (any GPU, any layout, T <= QGEMV_MAX_ROWS per launch): one warp per
    output row on CUDA cores, fp32 throughout; it matches quant_linear_ref up to the order of the
    fp32 sums. It is what a learner's kernel (the chapter's exercise, the `quant_gemv` plug-in stage)
    replaces, and what runs where the tensor-core kernel cannot (unaligned views, pre-Ampere GPUs).
  * `dequantize_bf16` (the prefill path, T > QMMA_MAX_ROWS): W as a bf16 [N, K] matrix, bit for bit
    f32_to_bf16(dequantize_ref(qw)), for the cuBLAS GEMM (engine/backend.py matmul) to multiply.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from engine.backend import bf16_to_f32, f32_to_bf16, load_kernel, sm_count, tensor_cores_usable
from engine.ops.gemv import WARPS_PER_SM, GemvInputError, float_output, row_stride
from engine.ops.quantization import BITS, QuantizedWeight, unpack_ref
from engine.plugins import OVERRIDES

# The kernel's launch constants, passed to it as -D defines (its .cu file repeats them as defaults for a
# plain nvcc build; tests/test_kernels_compile.py checks that the two agree).
QGEMV_MAX_ROWS = 8    # rows of x per launch of the CUDA-core kernel
QGEMV_WARPS = 8       # output rows per block: one warp each
QGEMV_UNROLL = 4      # 16-byte chunks of a weight row in flight per lane
QMMA_WARPS = 16       # most warps per block of the tensor-core kernel (they split K)
QMMA_UNROLL = 4       # k-blocks of 16-byte loads in flight per lane (tensor-core kernel)
QMMA_MIN_BLOCKS = 1   # resident blocks of QMMA_WARPS warps its registers leave room for (launch bounds)
QMMA_STEPS = 2        # main-loop steps a warp keeps at least, when the launcher adds warps to split K
QMMA_MAX_ROWS = 16    # rows of x the tensor-core kernel takes: two mma tiles of 8
QMMA_TILE_N = 16      # output columns per block of the tensor-core kernel (the M of the mma)
CHUNK_BYTES = 16      # the kernels' vector load
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


def _defines() -> dict[str, int]:
    return {"QGEMV_MAX_ROWS": QGEMV_MAX_ROWS, "QGEMV_WARPS": QGEMV_WARPS, "QGEMV_UNROLL": QGEMV_UNROLL,
            "QMMA_WARPS": QMMA_WARPS, "QMMA_UNROLL": QMMA_UNROLL, "QMMA_MIN_BLOCKS": QMMA_MIN_BLOCKS}


def _chunked(x, qw: QuantizedWeight, ldx: int) -> bool:
    """Whether the 16-byte-chunk kernels can read these operands: whole chunks per qweight row, a chunk
    inside one group, 16-byte aligned rows of qweight and x."""
    qweight: Any = qw.qweight                          # a CuPy array (the dataclass types it as any array)
    per_chunk = CHUNK_BYTES * 8 // qw.bits            # values per 16-byte chunk: 32 (int4) or 16 (int8)
    return (qw.shape[1] % per_chunk == 0 and qw.group_size % per_chunk == 0 and qweight.data.ptr % CHUNK_BYTES == 0
            and ldx % 8 == 0 and x.data.ptr % 16 == 0)


def _tensor_core_path(chunked: bool, bits: int, device: int) -> bool:
    """The tensor-core kernel takes chunked operands on sm_80+, unless a learner's int4 kernel is plugged in."""
    return chunked and tensor_cores_usable(device) and not (bits == 4 and "quant_gemv" in OVERRIDES)


def uses_tensor_cores(x, qw: QuantizedWeight) -> bool:
    """Whether quant_gemv(x, qw) runs the tensor-core kernel (whose W is mma_weight_ref's, not
    dequantize_ref's)."""
    import cupy as cp
    ldx = row_stride(x, "x", 2, QuantGemvInputError, "quant_gemv")
    return _tensor_core_path(_chunked(x, qw, ldx), qw.bits, cp.cuda.Device().id)


def mma_weight_ref(qw: QuantizedWeight) -> np.ndarray:
    """float32 W [N, K]: the bf16 matrix the tensor-core kernel multiplies, exactly. It forms q - z
    (exact), times the scale rounded to bf16 (an exact fp32 product of 9- and 8-bit significands),
    rounded once to bf16: within a bf16 rounding or two of dequantize_ref."""
    N, K = qw.shape
    G = qw.group_size
    q = unpack_ref(np.asarray(qw.qweight), qw.bits).astype(np.float32).reshape(N, K // G, G)
    z = np.asarray(qw.zeros).astype(np.float32)[:, :, None]                                 # [N, K/G, 1]
    s = bf16_to_f32(f32_to_bf16(np.asarray(qw.scales).astype(np.float32)))[:, :, None]      # [N, K/G, 1]
    return bf16_to_f32(f32_to_bf16(((q - z) * s).reshape(N, K)))


def mma_geometry(N: int, K: int, bits: int, sms: int) -> tuple[int, int]:
    """(blocks, warps per block) of the tensor-core kernel: one block per 16 output columns; a narrow W
    gets more warps (splitting K) until the SMs are full or a warp would have less than one main-loop
    step of its own (QMMA_UNROLL k-blocks of 4 chunks: 128 inputs at int4, 64 at int8). A small W has
    few bytes per SM to hide the memory latency with: every warp that can issue loads helps."""
    tiles = -(-N // QMMA_TILE_N)
    kblocks = -(-K // (4 * CHUNK_BYTES * 8 // bits))
    warps = 1
    while warps < QMMA_WARPS and tiles * warps < WARPS_PER_SM * sms and kblocks >= QMMA_STEPS * warps * QMMA_UNROLL:
        warps *= 2
    return tiles, warps


def quant_gemv(x, qw: QuantizedWeight, out=None):
    """out [T, N] fp32 = x [T, K] @ dequantize(qw)^T on the GPU, x bf16 (uint16 bits), 1 <= T <= 16.

    x may be a view with a row stride. The tensor-core kernel runs on sm_80+ when every qweight row
    is a whole number of 16-byte chunks, a chunk stays inside one group and x's rows are 16-byte
    aligned; the CUDA-core one otherwise, and whenever a `quant_gemv` override (engine/plugins.py) is
    active for int4 weights: the learner's kernel, launched as the engine launches its own. `out`, if
    given, is overwritten. Graph-capturable: no host sync, the output comes from CuPy's allocator.
    """
    import cupy as cp
    N, K, G = _check_weight(qw, "quant_gemv")
    if x.dtype != np.uint16 or x.ndim != 2 or x.shape[1] != K:
        raise QuantGemvInputError(f"quant_gemv: x must be bf16 bits (uint16) [T, {K}], got {x.dtype} {x.shape}")
    T = x.shape[0]
    if not 1 <= T <= QMMA_MAX_ROWS:
        raise QuantGemvInputError(f"quant_gemv: takes 1 to {QMMA_MAX_ROWS} rows of x, got {T} "
                                  "(more rows: dequantize_bf16, then a GEMM)")
    out = float_output(out, T, N, QuantGemvInputError, "quant_gemv")
    if N == 0 or K == 0:
        out.fill(0)                   # an empty sum (nothing at all when N == 0)
        return out
    ldx, ldo = (row_stride(a, name, size, QuantGemvInputError, "quant_gemv") for a, name, size in
                ((x, "x", 2), (out, "out", 4)))
    vec = _chunked(x, qw, ldx)
    device = cp.cuda.Device().id
    if _tensor_core_path(vec, qw.bits, device):
        blocks, warps = mma_geometry(N, K, qw.bits, sm_count(device))
        tiles = 1 if T <= 8 else 2
        kernel = load_kernel("quant_gemv", f"quant_mma_int{qw.bits}_x{8 * tiles}", **_defines())
        kernel((blocks,), (32 * warps,), (x, np.int64(ldx), qw.qweight, qw.scales, qw.zeros, out, np.int64(ldo),
                                           np.int32(T), np.int32(N), np.int32(K), np.int32(G)))
        return out
    plug = OVERRIDES.get("quant_gemv") if qw.bits == 4 else None   # your stage (engine/plugins.py), if active
    if plug is not None:
        kernel = plug.kernel(QGEMV_MAX_ROWS=QGEMV_MAX_ROWS, QGEMV_WARPS=QGEMV_WARPS, QGEMV_UNROLL=QGEMV_UNROLL)
    else:
        kernel = load_kernel("quant_gemv", f"quant_gemv_int{qw.bits}" + ("" if vec else "_unaligned"), **_defines())
    for t0 in range(0, T, QGEMV_MAX_ROWS):            # the CUDA-core kernel takes 8 rows per launch
        rows = min(QGEMV_MAX_ROWS, T - t0)
        kernel((-(-N // QGEMV_WARPS),), (32 * QGEMV_WARPS,),
               (x[t0:], np.int64(ldx), qw.qweight, qw.scales, qw.zeros, out[t0:], np.int64(ldo),
                np.int32(rows), np.int32(N), np.int32(K), np.int32(G)))
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
    kernel = load_kernel("quant_gemv", f"dequantize_bf16_int{qw.bits}", **_defines())
    kernel((-(-words // DEQUANT_THREADS),), (DEQUANT_THREADS,),
           (qw.qweight, qw.scales, qw.zeros, out, np.int32(N), np.int32(K), np.int32(G)))
    return out


def supported(x, qw: QuantizedWeight, out=None) -> bool:
    """Whether a projection may hand x @ dequantize(qw)^T to quant_gemv(): bf16 x with 1..QMMA_MAX_ROWS
    rows of K inputs, an fp32 output (or none). Cheap: it runs for every projection of every step."""
    return (x.dtype == np.uint16 and x.ndim == 2 and 1 <= x.shape[0] <= QMMA_MAX_ROWS
            and x.shape[1] == qw.shape[1] and qw.bits in BITS and (out is None or out.dtype == np.float32))
