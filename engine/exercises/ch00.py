"""Chapter 00 exercises: launch arithmetic and bf16 rounding by hand."""
from __future__ import annotations

import math
import struct
from collections.abc import Callable

import numpy as np

from engine.backend import f32_to_bf16
from engine.exercises import check_cases

# ----------------------------------------------------------------------------- launch arithmetic

def check_blocks_for(fn: Callable[[int, int], int]) -> bool:
    """fn(n, threads_per_block) -> fewest blocks so that every element gets a thread."""
    cases = [((n, tpb), -(-n // tpb)) for n in (1, 255, 256, 257, 1000, 576, 49152, 10**9 + 7)
             for tpb in (32, 128, 256, 1024)]
    return check_cases("blocks_for", fn, cases)


def check_grid_stride_indices(fn: Callable[[int, int, int], list[int]]) -> bool:
    """fn(thread, n, total_threads) -> the element indices that thread handles, in order."""
    cases = [((t, n, total), list(range(t, n, total)))
             for n, total in ((10, 8), (8, 8), (3, 8), (1000, 256), (0, 4), (257, 256))
             for t in sorted({0, 1, total // 2, total - 1})]
    return check_cases("grid_stride_indices", fn, cases, same=lambda got, want: list(got) == want)


# ----------------------------------------------------------------------------- bf16

def f32_bits(x: float) -> int:
    """The 32-bit pattern of x rounded to float32."""
    return struct.unpack("<I", struct.pack("<f", x))[0]


def _tricky_floats() -> np.ndarray:
    """Ties, carries into the exponent, overflow to inf, subnormals, signed zeros, NaN."""
    patterns = [0x3F808000, 0x3F818000, 0x3F80_8001, 0x3F80_7FFF, 0x3FFF_8000, 0x7F7F_8000,
                0x7F7F_FFFF, 0x0000_0001, 0x0000_8000, 0x0001_8000, 0x8000_0000, 0x7F80_0000,
                0xFF80_0000, 0x7FC0_0000, 0xBF80_8000, 0xC1A4_0000]
    rng = np.random.default_rng(0)
    random = rng.integers(0, 2**32, 3000, dtype=np.uint64).astype(np.uint32)
    return np.concatenate([np.array(patterns, np.uint32), random]).view(np.float32)


def check_f32_to_bf16_bits(fn: Callable[[float], int]) -> bool:
    """fn(x) -> the 16-bit pattern of x rounded to bf16 (nearest, ties to even; NaN -> 0x7FC0)."""
    values = _tricky_floats()
    expected = f32_to_bf16(values)
    cases = [((float(x),), int(e)) for x, e in zip(values, expected)]
    return check_cases("f32_to_bf16_bits", fn, cases)


def check_bf16_spacing(fn: Callable[[float], float]) -> bool:
    """fn(x) -> the gap between x (a positive normal bf16 value) and the next bf16 above it."""
    xs = [1.0, 1.5, 2.0, 3.0, 255.0, 256.0, 1000.0, 0.1015625, 2.0**-100, 3.0e38]
    # bf16 keeps 8 significant bits (7 stored + the implicit 1): the gap is 2**(exponent - 7).
    cases = [((x,), math.ldexp(1.0, math.frexp(x)[1] - 1 - 7)) for x in xs]
    return check_cases("bf16_spacing", fn, cases)
