"""Chapter 01 exercises: reading a safetensors file by hand."""
from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from engine.backend import bf16_to_f32
from engine.exercises import check_cases


def check_read_header_length(fn: Callable[[bytes], int]) -> bool:
    """fn(first_8_bytes) -> N, the header length (an unsigned 64-bit little-endian integer)."""
    rng = np.random.default_rng(1)
    raw = [bytes([0x58, 0, 0, 0, 0, 0, 0, 0]), bytes([0, 1, 0, 0, 0, 0, 0, 0]),
           b"\xff" * 8, bytes(8)] + [rng.bytes(8) for _ in range(200)]
    cases = [((b,), sum(byte << (8 * i) for i, byte in enumerate(b))) for b in raw]
    return check_cases("read_header_length", fn, cases)


def check_tensor_file_range(fn: Callable[[int, list[int]], tuple[int, int]]) -> bool:
    """fn(header_length, data_offsets) -> (start, stop): the tensor's bytes in the whole file."""
    cases = [((n, [b, e]), (8 + n + b, 8 + n + e))
             for n in (0, 88, 4096, 123456) for b, e in ((0, 0), (0, 24), (24, 1176), (10**9, 10**9 + 2))]
    return check_cases("tensor_file_range", fn, [(args, tuple(want)) for args, want in cases],
                      same=lambda got, want: tuple(got) == want)


def _same_float(got, want) -> bool:
    """Equal values, NaN equal to NaN, and -0.0 distinguished from 0.0."""
    if math.isnan(want):
        return isinstance(got, float) and math.isnan(got)
    return got == want and math.copysign(1.0, got) == math.copysign(1.0, want)


def check_bf16_bits_to_float(fn: Callable[[int], float]) -> bool:
    """fn(bits) -> the value of a 16-bit bf16 pattern, for all 65536 patterns."""
    bits = np.arange(2**16, dtype=np.uint16)
    cases = [((int(b),), float(v)) for b, v in zip(bits, bf16_to_f32(bits))]
    return check_cases("bf16_bits_to_float", fn, cases, same=_same_float)


def _first_overlap(ranges: dict[str, tuple[int, int]]):
    ordered = sorted(ranges.items(), key=lambda item: item[1])
    for (a, (_, a_end)), (b, (b_begin, _)) in zip(ordered, ordered[1:]):
        if b_begin < a_end:
            return (a, b)
    return None


def check_find_overlap(fn: Callable[[dict], tuple[str, str] | None]) -> bool:
    """fn({name: (begin, end)}) -> the names of the first overlapping neighbours, else None.

    Neighbours in offset order (sorted by begin, then end); "overlap" means the later one starts
    before the earlier one ends.
    """
    hand_made = [
        {"embed": (0, 8), "norm": (8, 12)},
        {"norm": (8, 12), "embed": (0, 10)},
        {"q": (0, 4), "k": (4, 8), "v": (6, 10), "o": (10, 14)},
        {"a": (0, 4), "b": (2, 3)},
        {"a": (0, 4), "empty": (4, 4), "b": (4, 6)},
        {"a": (0, 4), "empty": (2, 2)},
        {},
    ]
    rng = np.random.default_rng(2)
    generated = []
    for _ in range(200):
        sizes = rng.integers(0, 6, rng.integers(2, 7))
        ends = np.cumsum(sizes)
        ranges = {f"t{i}": (int(e - s), int(e)) for i, (s, e) in enumerate(zip(sizes, ends))}
        if rng.random() < 0.7:  # pull one tensor back into its predecessor
            i = int(rng.integers(1, len(sizes)))
            begin, end = ranges[f"t{i}"]
            shift = int(rng.integers(1, 4))
            ranges[f"t{i}"] = (max(0, begin - shift), max(0, end - shift))
        generated.append(ranges)
    cases = [((dict(r),), _first_overlap(r)) for r in hand_made + generated]
    return check_cases("find_overlap", fn, cases, same=lambda got, want: (
        got is None if want is None else got is not None and set(got) == set(want)))
