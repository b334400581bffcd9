"""Weight-only quantization (chapter 18): int8 and int4 weights with group-wise scales and zero points.

A projection's weight W [N, K] (N outputs, K inputs, nn.Linear's layout) is cut along K into groups of
G consecutive inputs; each (row, group) keeps a scale s and a zero point z, and each weight becomes an
integer q in [0, 2**bits):

    q = clip(round(w / s) + z, 0, 2**bits - 1)        w ~ (q - z) * s

(asymmetric: the group's min and max map to 0 and 2**bits - 1, so a group that is all positive wastes
no code). The engine's own layout, read by its kernels one row of W at a time:

    qweight  uint32 [N, K * bits / 32]   int4: word (n, j) holds q[n, 8j + i] in bits 4i..4i+3
                                         int8: word (n, j) holds q[n, 4j + i] in bits 8i..8i+7
                                         (the lowest bits hold the first input: little end first)
    scales   float16 [N, K / G]          (AWQ's type; a float32 copy of it dequantizes exactly)
    zeros    uint8   [N, K / G]          the zero point, in quantized units

AWQ checkpoints (AutoAWQ's GEMM format) store the transpose, packed along the outputs in an
interleaved order: `from_awq` unpacks them into this layout (awq_unpack_ref is the reference unpacker
written from the format's description). Everything here is NumPy: the references the GPU kernels
(kernels_cu/quant_gemv.cu) are checked against, and the CPU backend's path.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

BITS = (4, 8)
DEFAULT_GROUP_SIZE = 128
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)   # AWQ's nibble i of a word holds column AWQ_ORDER[i] of its 8


class QuantizationError(ValueError):
    """Settings or tensors that cannot describe a quantized weight (named in the message)."""


@dataclass
class QuantizedWeight:
    """One weight matrix W [N, K] in the engine's quantized layout (see the module docstring). On the GPU
    the three arrays live on the device; on the CPU they are NumPy arrays."""
    qweight: Any             # uint32 [N, K * bits // 32]
    scales: Any              # float16 [N, K // group_size]
    zeros: Any               # uint8 [N, K // group_size]
    bits: int
    group_size: int
    shape: tuple[int, int]   # (N, K)
    dense: Any = None        # CPU: the dequantized float32 [N, K], made on first use (engine/ops/linear.py)

    @property
    def nbytes(self) -> int:
        """Bytes a pass over the weight reads (packed values, scales and zero points)."""
        return int(self.qweight.nbytes + self.scales.nbytes + self.zeros.nbytes)

    @property
    def size(self) -> int:
        return self.shape[0] * self.shape[1]


def check_settings(bits: int, group_size: int, K: int) -> int:
    """The group size to use for K inputs (-1: one group per row); QuantizationError if unusable."""
    if bits not in BITS:
        raise QuantizationError(f"bits must be one of {BITS}, got {bits!r}")
    G = K if group_size == -1 else group_size
    per_word = 32 // bits
    if not isinstance(G, int) or G <= 0 or K % G or G % per_word:
        raise QuantizationError(f"group_size {group_size!r} must divide the {K} inputs of the weight and be a "
                                f"multiple of {per_word} ({bits}-bit values per 32-bit word), or -1")
    return G


# ---- packing --------------------------------------------------------------------------------------
def pack_ref(q: np.ndarray, bits: int) -> np.ndarray:
    """uint8 codes [N, K] -> uint32 [N, K * bits / 32], the first input in the lowest bits."""
    per_word = 32 // bits
    N, K = q.shape
    parts = q.reshape(N, K // per_word, per_word).astype(np.uint32)
    shifts = (np.arange(per_word, dtype=np.uint32) * bits)[None, None, :]
    return np.bitwise_or.reduce(parts << shifts, axis=2).astype(np.uint32)


def unpack_ref(qweight: np.ndarray, bits: int) -> np.ndarray:
    """uint32 [N, K * bits / 32] -> uint8 codes [N, K] (pack_ref's inverse)."""
    per_word = 32 // bits
    shifts = (np.arange(per_word, dtype=np.uint32) * bits)[None, None, :]
    codes = (qweight[:, :, None] >> shifts) & np.uint32((1 << bits) - 1)
    return codes.reshape(qweight.shape[0], -1).astype(np.uint8)


# ---- quantizing and dequantizing ------------------------------------------------------------------
def quantize_ref(w: np.ndarray, bits: int, group_size: int = DEFAULT_GROUP_SIZE) -> QuantizedWeight:
    """W [N, K] (float) -> its group-wise asymmetric quantization (round to nearest)."""
    N, K = w.shape
    G = check_settings(bits, group_size, K)
    top = (1 << bits) - 1
    groups = w.astype(np.float32).reshape(N, K // G, G)
    lo = np.minimum(groups.min(axis=2), 0.0)           # 0 stays representable (a zero point in range)
    hi = np.maximum(groups.max(axis=2), 0.0)
    scales = ((hi - lo) / top).astype(np.float16)
    scales[scales == 0] = np.float16(1.0)              # an all-zero group: any scale, q == z
    s = scales.astype(np.float32)
    zeros = np.clip(np.round(-lo / s), 0, top).astype(np.uint8)
    q = np.clip(np.round(groups / s[:, :, None]) + zeros[:, :, None], 0, top).astype(np.uint8)
    return QuantizedWeight(pack_ref(q.reshape(N, K), bits), scales, zeros, bits, G, (N, K))


def dequantize_ref(qw: QuantizedWeight) -> np.ndarray:
    """float32 W [N, K] = (q - z) * s, exactly (fp16 scales and small integers are exact in fp32)."""
    N, K = qw.shape
    G = qw.group_size
    q = unpack_ref(np.asarray(qw.qweight), qw.bits).astype(np.float32).reshape(N, K // G, G)
    z = np.asarray(qw.zeros).astype(np.float32)[:, :, None]
    s = np.asarray(qw.scales).astype(np.float32)[:, :, None]
    return ((q - z) * s).reshape(N, K)


def quant_linear_ref(x: np.ndarray, qw: QuantizedWeight) -> np.ndarray:
    """x [T, K] @ dequantize(W)^T -> [T, N] float32: what every quantized projection computes."""
    return x.astype(np.float32) @ dequantize_ref(qw).T


# ---- AWQ (AutoAWQ's GEMM format) ------------------------------------------------------------------
def awq_unpack_ref(packed: np.ndarray) -> np.ndarray:
    """AWQ int32 [R, C / 8] -> uint8 codes [R, C]: word (r, j) holds columns 8j .. 8j + 7, its nibble i
    (bits 4i..4i+3) being column 8j + AWQ_ORDER[i]. Written from the format's description, one column at
    a time (the readable version; from_awq uses the vectorized one)."""
    words = packed.astype(np.uint32)
    R, W = words.shape
    out = np.zeros((R, 8 * W), dtype=np.uint8)
    for j in range(W):
        for i, column in enumerate(AWQ_ORDER):
            out[:, 8 * j + column] = (words[:, j] >> np.uint32(4 * i)) & np.uint32(0xF)
    return out


def awq_pack(codes: np.ndarray) -> np.ndarray:
    """uint8 codes [R, C] -> AWQ int32 [R, C / 8] (awq_unpack_ref's inverse; writes test checkpoints):
    the engine's packing of each word's 8 columns taken in AWQ_ORDER."""
    R, C = codes.shape
    reordered = codes.reshape(R, C // 8, 8)[:, :, list(AWQ_ORDER)].reshape(R, C)
    return pack_ref(reordered, 4).view(np.int32)


def _awq_codes(packed: np.ndarray) -> np.ndarray:
    """The vectorized awq_unpack_ref: the engine's unpacking, then each word's nibbles put back in column order."""
    nibbles = unpack_ref(packed.astype(np.uint32), 4)                  # [R, C], word order
    R, C = nibbles.shape
    codes = np.empty_like(nibbles).reshape(R, C // 8, 8)
    codes[:, :, list(AWQ_ORDER)] = nibbles.reshape(R, C // 8, 8)
    return codes.reshape(R, C)


def from_awq(qweight: np.ndarray, qzeros: np.ndarray, scales: np.ndarray, group_size: int) -> QuantizedWeight:
    """An AWQ GEMM weight (qweight int32 [K, N/8], qzeros int32 [K/G, N/8], scales fp16 [K/G, N]) in the
    engine's layout: W [N, K] = (q - z) * s, as AutoAWQ's dequantization computes it."""
    qweight, qzeros, scales = np.asarray(qweight), np.asarray(qzeros), np.asarray(scales)
    if qweight.ndim != 2 or qzeros.ndim != 2 or scales.ndim != 2:
        raise QuantizationError("AWQ qweight, qzeros and scales must be 2-D")
    K, N = qweight.shape[0], 8 * qweight.shape[1]
    G = check_settings(4, group_size, K)
    if qzeros.shape != (K // G, N // 8) or scales.shape != (K // G, N):
        raise QuantizationError(f"AWQ shapes do not agree: qweight {qweight.shape}, qzeros {qzeros.shape}, "
                                f"scales {scales.shape} (group size {G})")
    codes = _awq_codes(qweight).T                                      # [N, K]
    zeros = np.ascontiguousarray(_awq_codes(qzeros).T)                # [N, K/G]
    return QuantizedWeight(pack_ref(np.ascontiguousarray(codes), 4), np.ascontiguousarray(scales.T.astype(np.float16)),
                           zeros, 4, G, (N, K))
