"""Chapter 05 exercises: RoPE frequencies, Llama 3 scaling, the rotation, and the layout permutation."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np

from engine.exercises.ch03 import run_array_checks
from engine.formats.config import RopeScaling, config_from_dict
from engine.model.random_model import PRESETS
from engine.ops.rope import rope_inv_freq, rope_ref, rope_tables

_BASE = config_from_dict(PRESETS["tiny"])


def _config(head_dim: int, theta: float, scaling: RopeScaling | None = None):
    return replace(_BASE, head_dim=head_dim, rope_theta=float(theta), rope_scaling=scaling)


def check_rope_frequencies(fn: Callable) -> bool:
    """fn(head_dim, theta) -> float32 [head_dim / 2]: inv_freq[i] = theta ** (-2i / head_dim)."""
    cases = [((D, theta), rope_inv_freq(_config(D, theta)))
             for D, theta in ((2, 10000.0), (8, 10000.0), (64, 10000.0), (64, 100000.0), (64, 500000.0), (128, 1e6))]
    hints = [("the exponent uses i / head_dim instead of 2i / head_dim",
              lambda D, theta: (1.0 / theta ** (np.arange(D // 2) / D)).astype(np.float32)),
             ("these are the wavelengths theta ** (2i / head_dim), not the inverse frequencies",
              lambda D, theta: (theta ** (np.arange(0, D, 2) / D)).astype(np.float32))]
    return run_array_checks("rope_frequencies", fn, cases, rtol=1e-5, atol=0, hints=hints)


# (head_dim, theta, factor, low_freq_factor, high_freq_factor, original_max_position_embeddings)
LLAMA3_CASES = ((64, 500000.0, 32.0, 1.0, 4.0, 8192),      # Llama 3.2 1B/3B
                (128, 500000.0, 8.0, 1.0, 4.0, 8192),      # Llama 3.1 8B/70B
                (16, 10000.0, 8.0, 1.0, 4.0, 64),          # the "tiny" test preset
                (64, 10000.0, 4.0, 2.0, 8.0, 256))


def check_llama3_scale_frequencies(fn: Callable) -> bool:
    """fn(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_position_embeddings) -> scaled inv_freq."""
    cases = []
    for D, theta, factor, low, high, original in LLAMA3_CASES:
        scaling = (factor, low, high, original)
        rs = RopeScaling(*scaling)
        inv_freq = rope_inv_freq(_config(D, theta))
        cases.append(((inv_freq, *scaling), rope_inv_freq(_config(D, theta, rs))))
    hints = [("every frequency was divided by factor: only the long wavelengths (> original / low_freq_factor) are",
              lambda f, factor, *rest: (f / factor).astype(np.float32)),
             ("the medium band is not blended: frequencies between the two wavelength bounds need the smooth mix",
              lambda f, factor, low, high, orig: np.where(2 * np.pi / f > orig / low, f / factor, f).astype(np.float32))]
    return run_array_checks("llama3_scale_frequencies", fn, cases, rtol=1e-5, atol=0, hints=hints)


def rope_interleaved(x, positions, cos, sin):
    """The other layout (GPT-J, Meta's original Llama code): pairs are (x[2i], x[2i+1])."""
    c, s = cos[positions][:, None, :], sin[positions][:, None, :]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = x1 * c - x2 * s
    out[..., 1::2] = x2 * c + x1 * s
    return out


def check_rope(fn: Callable) -> bool:
    """fn(x [T, n_heads, D], positions [T], cos [P, D/2], sin [P, D/2]) -> x rotated, rotate-half layout."""
    rng = np.random.default_rng(0)
    cases = []
    for T, n_heads, D, theta, pos in ((3, 1, 4, 10000.0, [0, 1, 2]), (5, 6, 16, 10000.0, [7, 3, 3, 0, 200]),
                                      (4, 9, 64, 100000.0, [100, 101, 102, 103]),
                                      (6, 2, 128, 500000.0, [5, 480, 31, 0, 64, 9])):
        cos, sin = rope_tables(_config(D, theta), 512)
        x = rng.standard_normal((T, n_heads, D), dtype=np.float32)
        positions = np.array(pos, dtype=np.int32)
        cases.append(((x, positions, cos, sin), rope_ref(x, positions, cos, sin)))
    hints = [("the interleaved layout (pairs x[2i], x[2i+1]); Hugging Face Llama pairs x[i] with x[i + D/2]",
              rope_interleaved),
             ("the rotation goes the wrong way (the sign of sin is flipped)",
              lambda x, p, cos, sin: rope_ref(x, p, cos, -sin)),
             ("row t was rotated by angle t, not by its position positions[t]",
              lambda x, p, cos, sin: rope_ref(x, np.arange(len(p)), cos, sin))]
    return run_array_checks("rope", fn, cases, rtol=1e-4, atol=1e-5, hints=hints)


def interleaved_to_half_ref(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Rows of a q/k projection [n_heads * D, H]: within each head, even rows first, then odd rows."""
    rows, H = w.shape
    D = rows // n_heads
    return w.reshape(n_heads, D // 2, 2, H).transpose(0, 2, 1, 3).reshape(rows, H)


def check_interleaved_to_half(fn: Callable) -> bool:
    """fn(w [n_heads * D, H], n_heads) -> w with each head's rows reordered 0, 2, 4, ..., 1, 3, 5, ..."""
    rng = np.random.default_rng(1)
    cases = []
    for n_heads, D, H in ((1, 4, 3), (2, 8, 5), (9, 64, 576), (3, 16, 7)):
        w = rng.standard_normal((n_heads * D, H), dtype=np.float32)
        cases.append(((w, n_heads), interleaved_to_half_ref(w, n_heads)))
    hints = [("the whole matrix was reordered as one head; the permutation is per head",
              lambda w, n: interleaved_to_half_ref(w, 1)),
             ("that is the inverse permutation (half -> interleaved)",
              lambda w, n: w.reshape(n, 2, -1, w.shape[1]).transpose(0, 2, 1, 3).reshape(w.shape))]
    return run_array_checks("interleaved_to_half", fn, cases, rtol=0, atol=0, hints=hints)


# ----------------------------------------------------------------------------------------------
# GPU track: RoPE on the fused QKV row as a CUDA kernel (kernels_cu/exercises/rope.cu)
# ----------------------------------------------------------------------------------------------

def _rope_kernel_case(rng, Hq: int, Hkv: int, D: int, T: int, threads: int, P: int = 512):
    from engine.exercises.cuda_check import Case, f32_values
    from engine.ops.rope import rope_qkv
    cfg = replace(_config(D, 10000.0), num_attention_heads=Hq, num_key_value_heads=Hkv)
    cos, sin = rope_tables(cfg, P)                                   # [P, D/2] each
    qkv = f32_values(rng, (T, (Hq + 2 * Hkv) * D))                   # [T, (Hq + 2Hkv) * D]
    positions = rng.integers(0, P, T).astype(np.int32)               # [T]

    def rotated(pos=positions, c=cos, s=sin, rotate=rope_ref, heads=Hq + Hkv):
        x = qkv.reshape(T, Hq + 2 * Hkv, D)
        return np.concatenate([rotate(x[:, :heads], pos, c, s), x[:, heads:]], axis=1).reshape(T, -1)

    hints = [("the interleaved layout (pairs x[2i], x[2i+1]); Hugging Face Llama pairs x[i] with x[i + D/2]",
              rotated(rotate=rope_interleaved)),
             ("the rotation goes the wrong way (the sign of sin is flipped)", rotated(s=-sin)),
             ("row t was rotated by angle t, not by its position positions[t]",
              rotated(pos=np.arange(T) % P)),
             ("the v heads were rotated too: only the first Hq + Hkv heads (q and k) rotate",
              rotated(heads=Hq + 2 * Hkv))]
    return Case(f"Hq={Hq} Hkv={Hkv} D={D} T={T}, {threads} threads", (T,), threads,
                {"qkv": qkv, "positions": positions, "cos": cos, "sin": sin},
                lambda d: (d["qkv"], d["positions"], d["cos"], d["sin"], d["out"], np.int32(Hq + Hkv),
                           np.int32(Hq + 2 * Hkv), np.int32(D)),
                "bf16", rope_qkv(qkv, positions, cos, sin, cfg), hints, nbytes=qkv.size * (4 + 2),
                regions=[((Hq + Hkv) * D, "the v heads (they are copied, not rotated)")])


def _rope_kernel_cases():
    rng = np.random.default_rng(50)
    return [_rope_kernel_case(rng, *c) for c in
            ((3, 1, 16, 5, 64), (9, 3, 64, 37, 256), (4, 4, 128, 1, 64), (6, 2, 32, 17, 64), (32, 8, 64, 129, 256))]


def check_rope_kernel(source=None) -> bool | None:
    """GPU track: your rope_qkv kernel (default: kernels_cu/exercises/rope.cu; or a path, or the CUDA
    source text) against the reference, with the likely mistake named and its GB/s."""
    from engine.exercises.cuda_check import Exercise, check_kernel
    timing = lambda: _rope_kernel_case(np.random.default_rng(51), 32, 8, 64, 2047, 256, 4096)  # noqa: E731
    return check_kernel(Exercise("rope kernel", "rope.cu", "rope_qkv", "rope", _rope_kernel_cases, timing), source)
