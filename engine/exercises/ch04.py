"""Chapter 04 exercises: RMSNorm, its fused residual add, and the per-thread sums of the kernel."""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from engine.exercises import call_learner
from engine.exercises.ch03 import compare_array, describe, run_array_checks
from engine.ops.rmsnorm import add_rmsnorm_ref, rmsnorm_ref

EPS = 1e-5


def _rows(seed: int):
    """(x, w, eps): ordinary rows, tiny rows (where eps matters), an all-zero row, big rows, odd H."""
    rng = np.random.default_rng(seed)
    for T, H, scale, eps in ((4, 8, 1.0, EPS), (3, 576, 3.0, EPS), (5, 72, 1e-3, EPS), (2, 33, 1e-3, 1e-6),
                             (6, 2048, 50.0, EPS), (1, 7, 1.0, 1e-2)):
        x = (rng.standard_normal((T, H), dtype=np.float32) * np.float32(scale)).astype(np.float32)
        if T > 2:
            x[1] = 0.0
        w = (1.0 + 0.3 * rng.standard_normal(H, dtype=np.float32)).astype(np.float32)
        yield x, w, eps


_HINTS = [
    ("eps is added outside the square root: use sqrt(mean(x^2) + eps)",
     lambda x, w, eps: x / (np.sqrt(np.mean(x * x, -1, keepdims=True)) + np.float32(eps)) * w),
    ("the weight w is missing", lambda x, w, eps: rmsnorm_ref(x, np.ones_like(w), eps)),
    ("the mean is subtracted: that is LayerNorm, RMSNorm only divides by the root mean square",
     lambda x, w, eps: rmsnorm_ref(x - x.mean(-1, keepdims=True), w, eps)),
    ("you divided by sqrt(sum(x^2)): RMSNorm uses the mean of the squares",
     lambda x, w, eps: x / np.sqrt(np.sum(x * x, -1, keepdims=True) + np.float32(eps)) * w),
    ("the mean was taken over the tokens (axis 0) instead of the hidden dimension (axis -1)",
     lambda x, w, eps: x / np.sqrt(np.mean(x * x, 0, keepdims=True) + np.float32(eps)) * w),
]


def check_rmsnorm(fn: Callable) -> bool:
    """fn(x [T, H], w [H], eps) -> x / sqrt(mean(x^2 over H) + eps) * w, row by row."""
    cases = [((x, w, eps), rmsnorm_ref(x, w, eps)) for x, w, eps in _rows(0)]
    return run_array_checks("rmsnorm", fn, cases, rtol=1e-4, atol=1e-5, hints=_HINTS)


def check_add_rmsnorm(fn: Callable) -> bool:
    """fn(residual, delta, w, eps): residual += delta in place, return rmsnorm(residual)."""
    title = "add_rmsnorm"
    rng = np.random.default_rng(1)
    count = 0
    for x, w, eps in _rows(2):
        delta = rng.standard_normal(x.shape, dtype=np.float32)
        want_residual = x.copy()
        want = add_rmsnorm_ref(want_residual, delta, w, eps)
        residual = x.copy()
        call = f"{getattr(fn, '__name__', 'fn')}{describe((residual, delta, w, eps))}"
        ok, got = call_learner(title, call, fn, residual, delta.copy(), w.copy(), eps)
        if not ok:
            return False
        if not np.allclose(residual, want_residual, rtol=1e-5, atol=1e-6):
            untouched = np.array_equal(residual, x)
            print(f"[x] {title}: {call} did not update the residual in place"
                  + (" (it is unchanged: write `residual += delta`, not `residual = residual + delta`)" if untouched else ""))
            return False
        if not compare_array(title, call, got, want, 1e-4, 1e-5):
            return False
        count += 1
    print(f"[OK] {title}: all {count} cases pass (and the residual is updated in place)")
    return True


def thread_partial_sums_ref(row: np.ndarray, threads: int) -> np.ndarray:
    """What each thread of rmsnorm.cu holds before the block reduction: sum of x[i]^2, i = thread (mod threads)."""
    padded = np.zeros(-(-row.size // threads) * threads, dtype=np.float64)
    padded[:row.size] = row
    return (padded.reshape(-1, threads) ** 2).sum(axis=0)


def check_thread_partial_sums(fn: Callable) -> bool:
    """fn(row [H], threads) -> [threads]: entry i is the sum of row[j]**2 for j = i, i + threads, ..."""
    rng = np.random.default_rng(3)
    cases = []
    for H, threads in ((8, 4), (576, 160), (2048, 512), (72, 32), (33, 64), (1, 32)):
        row = rng.standard_normal(H).astype(np.float32)
        cases.append(((row, threads), thread_partial_sums_ref(row, threads)))
    hints = [("you summed contiguous chunks; the kernel's thread i takes every `threads`-th element from i",
              lambda row, threads: np.array([np.sum(c.astype(np.float64) ** 2) for c in np.array_split(row, threads)]))]
    return run_array_checks("thread_partial_sums", fn, cases, rtol=1e-5, atol=1e-6, hints=hints)


# ----------------------------------------------------------------------------------------------
# GPU track: RMSNorm's block reduction as a CUDA kernel (kernels_cu/exercises/rmsnorm.cu)
# ----------------------------------------------------------------------------------------------

def _rmsnorm_kernel_case(rng, T: int, H: int, scale: float, eps: float, threads: int):
    from engine.exercises.cuda_check import Case, f32_values
    x = f32_values(rng, (T, H), scale)                             # [T, H]
    if T > 2:
        x[1] = 0.0                                                 # an all-zero row: only eps keeps it finite
    w = (1.0 + 0.3 * rng.standard_normal(H, dtype=np.float32)).astype(np.float32)
    with np.errstate(all="ignore"):
        hints = [(text, wrong(x, w, eps)) for text, wrong in _HINTS]
    return Case(f"T={T} H={H} |x|~{scale:g} eps={eps:g}, {threads} threads", (T,), threads, {"x": x, "w": w},
                lambda d: (d["x"], d["w"], d["out"], np.int32(H), np.float32(eps)), "bf16",
                rmsnorm_ref(x, w, eps), hints, nbytes=T * H * (4 + 2))


def _rmsnorm_kernel_cases():
    rng = np.random.default_rng(40)
    return [_rmsnorm_kernel_case(rng, *c) for c in
            ((3, 577, 3.0, EPS, 32), (4, 8, 1e-3, EPS, 32), (5, 72, 1e-3, EPS, 64), (2, 33, 1e-3, 1e-6, 160),
             (6, 2048, 50.0, EPS, 256), (1, 7, 1.0, 1e-2, 32), (37, 4099, 1.0, EPS, 1024), (3, 576, 1e-3, EPS, 1024))]


def check_rmsnorm_kernel(source=None) -> bool | None:
    """GPU track: your rmsnorm kernel (default: kernels_cu/exercises/rmsnorm.cu; or a path, or the CUDA
    source text) against the reference, with the likely mistake named and its GB/s."""
    from engine.exercises.cuda_check import Exercise, check_kernel
    timing = lambda: _rmsnorm_kernel_case(np.random.default_rng(41), 2047, 2048, 1.0, EPS, 512)  # noqa: E731
    return check_kernel(Exercise("rmsnorm kernel", "rmsnorm.cu", "rmsnorm", "rmsnorm", _rmsnorm_kernel_cases,
                                 timing), source)
