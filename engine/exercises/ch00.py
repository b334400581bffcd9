"""Chapter 00 exercises: launch arithmetic and bf16 rounding by hand.

Each checker prints the first input it gets wrong and, when the answer is a classic mistake's answer
(floor instead of ceiling, truncation instead of rounding, ...), names the mistake."""
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
    hints = [("n // threads_per_block rounds DOWN: the last partial block (and its elements) is missing; "
              "round up with (n + threads_per_block - 1) // threads_per_block", lambda n, tpb: n // tpb),
             ("n // threads_per_block + 1 adds a block even when n is a multiple of threads_per_block "
              "(that block would do nothing)", lambda n, tpb: n // tpb + 1)]
    return check_cases("blocks_for", fn, cases, hints=hints)


def check_grid_stride_indices(fn: Callable[[int, int, int], list[int]]) -> bool:
    """fn(thread, n, total_threads) -> the element indices that thread handles, in order."""
    cases = [((t, n, total), list(range(t, n, total)))
             for n, total in ((10, 8), (8, 8), (3, 8), (1000, 256), (0, 4), (257, 256))
             for t in sorted({0, 1, total // 2, total - 1})]
    hints = [("the loop runs while i <= n: element n does not exist (the test is i < n)",
              lambda t, n, total: list(range(t, n + 1, total))),
             ("a thread takes a contiguous chunk; in a grid-stride loop it takes every total_threads-th "
              "element, starting at its own index", lambda t, n, total: list(range(t * -(-n // total),
                                                                                   min(n, (t + 1) * -(-n // total))))),
             ("the stride is 1: each thread must step over all total_threads threads of the grid",
              lambda t, n, total: list(range(t, n))),
             ("the first index is 0 for every thread: thread t starts at element t",
              lambda t, n, total: list(range(0, n, total)))]
    return check_cases("grid_stride_indices", fn, cases, same=lambda got, want: list(got) == want, hints=hints)


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


def _nan_through_the_trick(x: float) -> int:
    """The round-to-nearest-even trick applied to a NaN as if it were a number (for NaN inputs only)."""
    if not math.isnan(x):
        raise ValueError("only NaN inputs show this mistake")
    bits = f32_bits(x)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF


def check_f32_to_bf16_bits(fn: Callable[[float], int]) -> bool:
    """fn(x) -> the 16-bit pattern of x rounded to bf16 (nearest, ties to even; NaN -> 0x7FC0)."""
    values = _tricky_floats()
    expected = f32_to_bf16(values)
    cases = [((float(x),), int(e)) for x, e in zip(values, expected)]
    hints = [("a NaN went through the rounding trick, which can carry its bits into infinity or change the "
              "NaN; return 0x7FC0 for every NaN", _nan_through_the_trick),
             ("the 16 dropped bits were cut off (truncation, round toward zero); round to nearest: "
              "(bits + 0x7FFF + last_kept_bit) >> 16", lambda x: f32_bits(x) >> 16),
             ("a tie (dropped bits exactly 0x8000) was rounded up; ties go to the even neighbour "
              "(the one whose last kept bit is 0)", lambda x: (f32_bits(x) + 0x8000) >> 16)]
    return check_cases("f32_to_bf16_bits", fn, cases, hints=hints)


def check_bf16_spacing(fn: Callable[[float], float]) -> bool:
    """fn(x) -> the gap between x (a positive normal bf16 value) and the next bf16 above it."""
    xs = [1.0, 1.5, 2.0, 3.0, 255.0, 256.0, 1000.0, 0.1015625, 2.0**-100, 3.0e38]
    # bf16 keeps 8 significant bits (7 stored + the implicit 1): the gap is 2**(exponent - 7).
    cases = [((x,), math.ldexp(1.0, math.frexp(x)[1] - 1 - 7)) for x in xs]
    hints = [("math.frexp(x) returns a mantissa in [0.5, 1), so its exponent is one more than e "
              "in 2^e <= x < 2^(e+1): subtract 1", lambda x: math.ldexp(1.0, math.frexp(x)[1] - 7)),
             ("that is 2^(e-8), half the gap: bf16 stores 7 mantissa bits, so neighbours are 2^(e-7) apart",
              lambda x: math.ldexp(1.0, math.frexp(x)[1] - 1 - 8)),
             ("that is float32's gap (23 mantissa bits); bf16 keeps 7", lambda x: math.ldexp(1.0, math.frexp(x)[1] - 1 - 23)),
             ("the gap is a power of two fixed for the whole binade, not x * 2^-7",
              lambda x: x * 2.0**-7)]
    return check_cases("bf16_spacing", fn, cases, hints=hints)
