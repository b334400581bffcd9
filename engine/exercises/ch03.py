"""Chapter 03 exercises: the embedding gather.

`run_array_checks` sets the one checker loop (engine.exercises.check_cases) up for answers that are
arrays (chapters 03-07): equal to the engine's result within a tolerance.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import numpy as np

from engine.exercises import Hint, check_cases
from engine.ops.embedding import embedding_ref


def describe(args: Sequence) -> str:
    """Short description of a call's arguments: arrays by dtype and shape, the rest by value."""
    parts = []
    for a in args:
        if isinstance(a, np.ndarray):
            parts.append(f"{a.dtype}{list(a.shape)}")
        elif hasattr(a, "__dataclass_fields__"):
            parts.append(type(a).__name__)
        else:
            parts.append(repr(a))
    return "(" + ", ".join(parts) + ")"


def _close(got: np.ndarray, want: np.ndarray, rtol: float, atol: float) -> bool:
    # NaN matches NaN: a reference answer is finite, but a mistake's answer (a fully masked row) may
    # not be, and a learner's NaNs in the same places are that mistake
    return got.shape == want.shape and bool(np.allclose(got, want, rtol=rtol, atol=atol, equal_nan=True))


def array_mismatch(got, want: np.ndarray, rtol: float, atol: float) -> str | None:
    """None when `got` is `want` within tolerance, else why not (shape, NaN, the worst value)."""
    try:
        got = np.asarray(got, dtype=np.float64 if want.dtype.kind == "f" else want.dtype)
    except (TypeError, ValueError) as e:
        return f"returned something that is not an array of numbers ({e})"
    if got.shape != want.shape:
        return f"returned shape {got.shape}, expected {want.shape}"
    if _close(got, want, rtol, atol):
        return None
    if want.dtype.kind == "f" and not np.all(np.isfinite(got)) and np.all(np.isfinite(want)):
        return f"returned {int(np.sum(~np.isfinite(got)))} NaN/inf value(s)"
    with np.errstate(invalid="ignore"):
        err = np.abs(got - want.astype(np.float64))
    i = np.unravel_index(int(np.nanargmax(err)), err.shape) if np.any(np.isfinite(err)) else (0,) * got.ndim
    return f"is wrong: at index {tuple(int(j) for j in i)} got {got[i]:.6g}, expected {want[i]:.6g}"


def compare_array(title: str, call: str, got, want: np.ndarray, rtol: float, atol: float) -> bool:
    """For checkers with a loop of their own: print why `got` is not `want` and return False, else True."""
    reason = array_mismatch(got, want, rtol, atol)
    if reason is not None:
        print(f"[x] {title}: {call} {reason}")
    return reason is None


def run_array_checks(title: str, fn: Callable, cases: Iterable[tuple[tuple, np.ndarray]], *,
                     rtol: float = 1e-5, atol: float = 1e-6, hints: Sequence[Hint] = ()) -> bool:
    """check_cases for answers that are arrays: equal within a tolerance, each call on a copy of its
    arguments, a failure shown by dtype and shape with the worst value. `hints` name common mistakes."""
    def quiet(mistake):
        def run(*args):
            with np.errstate(all="ignore"):
                return mistake(*args)
        return run

    return check_cases(title, fn, cases, copy_args=True,
                       same=lambda got, want: array_mismatch(got, want, rtol, atol) is None,
                       explain=lambda got, want: array_mismatch(got, want, rtol, atol),
                       hints=[(text, quiet(mistake)) for text, mistake in hints],
                       label=lambda f, args: f"{getattr(f, '__name__', 'fn')}{describe(args)}")


# ----------------------------------------------------------------------------- the gather

def _tables(seed: int):
    """(ids, table) pairs: odd sizes, repeated ids, the first and last row, a single token."""
    rng = np.random.default_rng(seed)
    for V, H, T in ((11, 8, 5), (397, 72, 17), (50, 33, 1), (1000, 64, 64), (7, 5, 20)):
        table = rng.standard_normal((V, H), dtype=np.float32)
        ids = rng.integers(0, V, T).astype(np.int32)
        ids[0] = V - 1
        if T > 2:
            ids[1], ids[2] = 0, ids[0]        # the last row twice
        yield ids, table


def check_embedding(fn: Callable) -> bool:
    """fn(ids [T] int, table [V, H] float32) -> [T, H]: row ids[t] of the table for each token."""
    cases = [((ids, table), embedding_ref(ids, table)) for ids, table in _tables(0)]
    hints = [("an off-by-one: token ids start at 0, row 0 is token 0", lambda ids, table: table[ids - 1])]
    return run_array_checks("embedding", fn, cases, rtol=0, atol=0, hints=hints)


def check_one_hot(fn: Callable) -> bool:
    """fn(ids [T], vocab_size) -> float32 [T, V] with a single 1 per row, at column ids[t]."""
    cases = [((ids, table.shape[0]), np.eye(table.shape[0], dtype=np.float32)[ids]) for ids, table in _tables(1)]
    return run_array_checks("one_hot", fn, cases, rtol=0, atol=0)


def cosine_similarity_ref(rows: np.ndarray) -> np.ndarray:
    unit = rows / np.linalg.norm(rows, axis=-1, keepdims=True)
    return unit @ unit.T


def check_cosine_similarity(fn: Callable) -> bool:
    """fn(rows [n, H]) -> [n, n]: cos of the angle between every pair of rows."""
    rng = np.random.default_rng(2)
    cases = []
    for n, H in ((2, 3), (5, 8), (13, 576), (1, 4)):
        rows = rng.standard_normal((n, H), dtype=np.float32) * rng.uniform(0.1, 10, (n, 1)).astype(np.float32)
        cases.append(((rows,), cosine_similarity_ref(rows)))
    parallel = np.array([[1.0, 2.0, 3.0], [2.0, 4.0, 6.0], [-1.0, -2.0, -3.0]], dtype=np.float32)
    cases.append(((parallel,), cosine_similarity_ref(parallel)))
    hints = [("you forgot to divide by the norms (plain dot products)", lambda rows: rows @ rows.T)]
    return run_array_checks("cosine_similarity", fn, cases, rtol=1e-4, atol=1e-5, hints=hints)


# ----------------------------------------------------------------------------- the kernel's layout

def gather_thread_indices_ref(t: int, thread: int, H: int, threads: int) -> list[int]:
    """Flat indices of out[T, H] that thread `thread` of block `t` writes in embedding.cu, in order."""
    row = t * H
    if H % 2:
        return [row + i for i in range(thread, H, threads)]
    return [row + 2 * i + k for i in range(thread, H // 2, threads) for k in (0, 1)]


def check_gather_thread_indices(fn: Callable[[int, int, int, int], list]) -> bool:
    """fn(t, thread, H, threads) -> the flat indices of out that this thread writes, in order."""
    cases = [((t, thread, H, threads), gather_thread_indices_ref(t, thread, H, threads))
             for H, threads in ((576, 128), (2048, 128), (72, 128), (33, 32), (7, 32), (300, 64))
             for t in (0, 3) for thread in sorted({0, 1, 31, threads - 1})]
    return check_cases("gather_thread_indices", fn, cases, same=lambda got, want: list(got) == want)


# ----------------------------------------------------------------------------------------------
# GPU track: the embedding gather as a CUDA kernel (kernels_cu/exercises/embedding.cu)
# ----------------------------------------------------------------------------------------------

def _embedding_kernel_case(rng, V: int, H: int, T: int, threads: int):
    from engine.exercises.cuda_check import Case, bf16_values
    table_bits, table = bf16_values(rng, (V, H))                  # [V, H]
    ids = rng.integers(0, V, T).astype(np.int32)                 # [T]
    flat = table.reshape(-1)
    hints = [("row t of the table was read instead of row ids[t]", table[np.arange(T) % V]),
             ("the row offset is missing its * H: table[ids[t] + i] instead of table[ids[t] * H + i]",
              flat[(ids[:, None] + np.arange(H)[None, :]) % flat.size])]
    return Case(f"V={V} H={H} T={T}, {threads} threads", (T,), threads, {"ids": ids, "table": table_bits},
                lambda d: (d["ids"], d["table"], d["out"], np.int32(V), np.int32(H)), "f32", embedding_ref(ids, table),
                hints, exact=True, nbytes=T * H * (2 + 4))


def _embedding_kernel_cases():
    rng = np.random.default_rng(30)
    return [_embedding_kernel_case(rng, V, H, T, threads) for V, H, T, threads in
            ((1001, 577, 37, 128), (50, 3, 5, 32), (7, 64, 1, 96), (3000, 2048, 129, 128), (100, 1000, 20, 1024))]


def check_embedding_kernel(source=None) -> bool | None:
    """GPU track: your embedding_gather kernel (default: kernels_cu/exercises/embedding.cu; or a path,
    or the CUDA source text) against the reference, with the likely mistake named and its GB/s."""
    from engine.exercises.cuda_check import Exercise, check_kernel
    timing = lambda: _embedding_kernel_case(np.random.default_rng(31), 32000, 2048, 2047, 128)  # noqa: E731
    return check_kernel(Exercise("embedding kernel", "embedding.cu", "embedding_gather", "embedding",
                                 _embedding_kernel_cases, timing), source)
