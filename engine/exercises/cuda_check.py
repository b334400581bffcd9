"""The GPU track's checking loop: compile a learner's CUDA kernel, run it, name the likely mistake.

Every CUDA exercise (chapters 03, 04, 05, 07, 11) goes through `check_kernel`:
  1. the source (a file or text) is compiled by the engine's own loader (`backend.load_source`: same
     NVRTC options, `#include "common.cuh"` works, compile errors name the file and line);
  2. each case (awkward shapes: not powers of two, not multiples of the block size, tiny and large)
     launches it three times into an output poisoned with NaN bits and followed by a poisoned guard
     region, exactly as the engine launches its own kernel (same grid, block and arguments);
  3. `diagnose` compares with the NumPy reference at bf16 tolerance and reads the error pattern:
     writes into the guard (missing bounds check), poison left behind (unwritten elements), runs
     that differ (a race), row 0 right and the others wrong (wrong stride), rows swapped, or a match
     with a known mistaken formula (e.g. eps outside the square root);
  4. when every case passes, the learner's kernel and the engine's are timed with CUDA events on a
     large shape and their GB/s printed side by side.
On a machine without a usable GPU the same cases run on the CPU executor (engine/exercises/cuda_cpu):
the kernel is compiled for the GPU by NVRTC or nvcc (compile errors at the learner's line, no GPU
needed), then by the host C++ compiler against a header that provides threadIdx, shared memory, a
real __syncthreads and the warp shuffles, and each case's three launches run in a child process with
a time limit, in three different thread orders, into the same poisoned output and guard; `diagnose`
reads the result as it reads a GPU's. No speed is measured there: the verdict says so and shows
what the worked solution measured on a GPU (a recorded, dated run: engine/exercises/recorded/).
Without a host compiler the check is skipped with the reason and only that recording is shown.

`diagnose` works on plain NumPy arrays, so the classification is tested without a GPU.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from engine.backend import KERNELS_DIR, KernelCompileError, bf16_to_f32, cupy_unavailable_reason

EXERCISES_DIR = KERNELS_DIR / "exercises"
SOLUTIONS_DIR = EXERCISES_DIR / "solutions"
POISON = {"bf16": np.uint16(0xFFFF), "f32": np.uint32(0xFFFFFFFF)}   # NaN bits no kernel computes
BITS = {"bf16": np.uint16, "f32": np.uint32}
RTOL = 2.0 ** -7          # bf16 keeps 8 significant bits: 2 ulps of relative error
RUNS = 3                  # launches per case: results that differ between them reveal a race


@dataclass
class Case:
    """One launch of the kernel: inputs, launch shape, the expected output and known wrong answers."""

    label: str                                  # shown to the learner, e.g. "T=37 H=577, 128 threads"
    grid: tuple
    block: int
    inputs: dict                                # name -> host array (bf16 as uint16 bits)
    args: Callable[[dict], tuple]               # device arrays (+ "out") -> the kernel's argument tuple
    out_dtype: str                              # "bf16" | "f32"
    want: np.ndarray                            # [rows, cols] float32; NaN = must stay untouched
    hints: Sequence[tuple[str, np.ndarray]] = ()  # (mistake, what a kernel making it produces)
    defines: dict = field(default_factory=dict)   # -D constants (paged attention: HEAD_DIM, GROUP)
    exact: bool = False                         # a copy: every bit must match
    nbytes: int = 0                             # bytes moved (for GB/s; timing cases only)
    regions: Sequence[tuple[int, str]] = ()     # (first column, name) of the parts of a row, e.g. the v heads


@dataclass
class Exercise:
    title: str          # "rmsnorm kernel"
    file: str           # "rmsnorm.cu": the skeleton in kernels_cu/exercises/, solution in solutions/
    kernel: str         # the extern "C" name, the same as the engine's kernel
    stage: str          # the engine's kernels_cu/<stage>.cu, timed beside the learner's
    cases: Callable[[], list[Case]]
    timing: Callable[[], Case]


# ----------------------------------------------------------------------------------------------
# Reading the error pattern (NumPy only)
# ----------------------------------------------------------------------------------------------

def decode(bits: np.ndarray, dtype: str) -> np.ndarray:
    return bf16_to_f32(bits) if dtype == "bf16" else bits.view(np.float32)


def within(got: np.ndarray, want: np.ndarray, exact: bool) -> np.ndarray:
    """Elementwise: got equals want up to bf16 rounding (NaN compares unequal)."""
    if exact:
        return got == want
    scale = float(np.sqrt(np.mean(want[np.isfinite(want)] ** 2))) if np.isfinite(want).any() else 1.0
    with np.errstate(invalid="ignore"):
        return np.abs(got - want) <= RTOL * np.abs(want) + 1e-3 * scale


def diagnose(runs: Sequence[np.ndarray], dtype: str, want: np.ndarray,
             hints: Sequence[tuple[str, np.ndarray]] = (), exact: bool = False,
             regions: Sequence[tuple[int, str]] = ()) -> str | None:
    """None when the output is right, else the likely mistake in one sentence.

    runs: the raw output bits of repeated launches, each flat [rows*cols + guard] (output, then a
    guard region that must keep the poison); want: [rows, cols] float32, NaN where the kernel
    must not write.
    """
    poison = POISON[dtype]
    n = want.size
    first = runs[0]
    guard_hits = int(np.sum(first[n:] != poison))
    if guard_hits:
        return (f"missing bounds check: the kernel wrote {guard_hits} element(s) past the end of the output "
                "(threads whose index is beyond the tensor must not store: `if (i < n)`)")
    if any(not np.array_equal(first, r) for r in runs[1:]):
        changed = int(np.sum(np.any([first[:n] != r[:n] for r in runs[1:]], axis=0)))
        return (f"a race: {changed} element(s) change from one launch to the next with the same inputs: threads "
                "read shared memory before others finished writing it (a missing __syncthreads())")
    bits = first[:n].reshape(want.shape)
    got = decode(bits, dtype)
    unwritten = bits == poison
    must_write = ~np.isnan(want)
    stray = ~unwritten & ~must_write
    if stray.any():
        r, c = np.argwhere(stray)[0]
        return (f"wrong destination: {int(stray.sum())} element(s) written where nothing belongs (first at row {r}, "
                f"column {c}): the destination index or stride is wrong")
    missing = unwritten & must_write
    if missing.any():
        return _unwritten(missing, must_write, regions)
    ok = within(got, want, exact) | ~must_write
    if ok.all():
        return None
    for text, wrong in hints:
        if (within(got, np.asarray(wrong, np.float32), exact) | ~must_write).all():
            return f"it looks like {text}"
    if not np.isfinite(got[must_write]).all():
        k = int(np.sum(~np.isfinite(got) & must_write))
        return f"{k} output(s) are NaN or inf (computed, not the poison): a division by zero or a missing eps?"
    bad_rows = ~ok.all(axis=1)
    if want.shape[0] > 1 and not bad_rows[0] and bad_rows[1:].all():
        return ("wrong stride: row 0 is right but every other row is wrong: the offset of a row "
                "(e.g. blockIdx.x * H) or the row length used for it is wrong")
    swapped = _rows_from_elsewhere(got, want, bad_rows, exact)
    if swapped:
        return swapped
    r, c = np.argwhere(~ok)[0]
    return (f"wrong values: {int(np.sum(~ok))} of {int(must_write.sum())} elements are off, first at row {r}, "
            f"column {c}: got {got[r, c]:.5g}, expected {want[r, c]:.5g}")


def _unwritten(missing: np.ndarray, must_write: np.ndarray, regions: Sequence[tuple[int, str]] = ()) -> str:
    """Describe where the poison survived: everywhere, past a column, past a row, or scattered."""
    k, total = int(missing.sum()), int(must_write.sum())
    if k == total:
        return "unwritten elements: no output element was written (the poison survives everywhere)"
    rows, cols = missing.shape
    written_cols = np.flatnonzero((~missing & must_write).any(axis=0))
    c0 = int(written_cols.max()) + 1 if written_cols.size else 0
    if 0 < c0 < cols and missing[:, c0:][must_write[:, c0:]].all() and not missing[:, :c0].any():
        for start, name in regions:
            if start == c0:
                return (f"unwritten elements: columns {c0}.. of every row, {name}, were never written")
        return (f"unwritten elements: only the first {c0} of {cols} columns of each row were written: a thread "
                f"must loop over its row (i += blockDim.x), not handle one element")
    written_rows = np.flatnonzero((~missing & must_write).any(axis=1))
    r0 = int(written_rows.max()) + 1 if written_rows.size else 0
    if 0 < r0 < rows and missing[r0:][must_write[r0:]].all():
        return (f"unwritten elements: rows {r0}.. were never written (only the first {r0} of {rows}): the "
                "grid does not cover the tensor; loop with a grid stride (i += gridDim.x * blockDim.x)")
    r, c = np.argwhere(missing)[0]
    return (f"unwritten elements: {k} of {total} output elements still hold the poison (first at row {r}, "
            f"column {c}): some index is never reached")


def _rows_from_elsewhere(got, want, bad_rows, exact) -> str | None:
    """When each wrong row equals another row of the expected output: rows land in the wrong place."""
    bad = np.flatnonzero(bad_rows)
    if bad.size == 0 or want.shape[0] < 2:
        return None
    sources = []
    for r in bad[:8]:
        match = [j for j in range(want.shape[0]) if j != r and within(got[r], want[j], exact).all()]
        if not match:
            return None
        sources.append((int(r), match[0]))
    r, j = sources[0]
    return (f"rows land in the wrong place: row {r} holds what belongs in row {j}: "
            "the row index (which token, slot or head) is wrong")


# ----------------------------------------------------------------------------------------------
# The loop
# ----------------------------------------------------------------------------------------------

def read_source(source, exercise: Exercise) -> tuple[str, str]:
    """(text, name shown in errors): None = the skeleton file; a path; or the CUDA text itself."""
    if source is None:
        source = EXERCISES_DIR / exercise.file
    if isinstance(source, Path) or (isinstance(source, str) and "\n" not in source and source.endswith(".cu")):
        path = Path(source)
        if not path.is_file():
            raise FileNotFoundError(f"no CUDA source at {path}")
        shown = path.resolve().relative_to(KERNELS_DIR.parent) if KERNELS_DIR.parent in path.resolve().parents else path
        return path.read_text(), str(shown)
    return str(source), f"your_{exercise.file}"


def check_kernel(exercise: Exercise, source=None) -> bool | None:
    """Run the exercise's cases on the learner's kernel: True = all pass, False = a mistake was named
    (printed), None = skipped (no GPU and no CPU executor here: the recorded run of the solution is
    printed instead). Without a usable GPU the cases run on the CPU executor (`_check_on_cpu`)."""
    title = exercise.title
    reason = cupy_unavailable_reason()
    if reason is not None:
        return _check_on_cpu(exercise, source, reason)
    text, shown = read_source(source, exercise)
    cases = exercise.cases()
    failures = []      # (case, diagnosis)
    for case in cases:
        try:
            kernel = _compile(text, shown, exercise.kernel, case.defines)
        except (KernelCompileError, LookupError) as exc:
            print(f"[x] {title}: {exc}")
            return False
        runs, crash = _launch_runs(kernel, case)
        if crash is not None:
            print(f"[x] {title}: case {case.label}: the kernel crashed ({crash}): an index out of range, most "
                  "likely a missing bounds check or a wrong stride (restart the Python kernel: the CUDA "
                  "context cannot be used after an illegal address)")
            return False
        verdict = diagnose(runs, case.out_dtype, case.want, case.hints, case.exact, case.regions)
        if verdict is not None:
            failures.append((case, verdict))
    if failures:
        print(f"[x] {title}: {_summarize(failures, cases)}")
        return False
    print(f"[OK] {title}: all {len(cases)} cases pass (three launches each, poisoned output and guard)")
    _report_speed(exercise, text, shown)
    return True


def _check_on_cpu(exercise: Exercise, source, gpu_reason: str) -> bool | None:
    """check_kernel without a GPU: the GPU compile check, then every case on the CPU executor."""
    from engine.exercises.cuda_cpu import executor as cuda_cpu
    from engine.exercises.recorded import show_recorded
    title, name = exercise.title, exercise.file.removesuffix(".cu")
    why_not = cuda_cpu.unavailable_reason()
    if why_not is not None:
        print(f"[skipped] {title}: needs a CUDA GPU ({gpu_reason.rstrip('.')}) or the CPU executor ({why_not})")
        show_recorded(name)
        return None
    text, shown = read_source(source, exercise)
    cases = exercise.cases()
    tool, error = cuda_cpu.compile_for_gpu(text, shown, cases[0].defines)
    if error is not None:
        print(f"[x] {title}: {error}")
        return False
    failures, printed = [], None
    for case in cases:
        try:
            so = cuda_cpu.build(text, shown, exercise.kernel, case.defines)
        except LookupError as exc:
            print(f"[x] {title}: {exc}")
            return False
        except KernelCompileError as exc:
            if tool is None:       # the host compiler is the only judge here: its error is the learner's
                print(f"[x] {title}: {exc}\n     (no NVRTC or nvcc here: the host C++ compiler checked it against the "
                      "CPU executor's CUDA header; install NVIDIA's nvidia-cuda-nvrtc wheel for the GPU compiler's errors)")
                return False
            print(f"[skipped] {title}: it compiles for the GPU ({tool}), but the CPU executor cannot build it "
                  f"(it may use CUDA the executor does not emulate):\n{exc}")
            show_recorded(name)
            return None
        except cuda_cpu.CpuBuildError as exc:
            print(f"[skipped] {title}: {exc}")
            show_recorded(name)
            return None
        outcome = cuda_cpu.run_case(so, exercise.kernel, case, RUNS, POISON[case.out_dtype], BITS[case.out_dtype])
        if outcome.printed and printed is None:
            printed = (case.label, outcome.printed)
        if outcome.crash is not None:
            print(f"[x] {title}: case {case.label}: {outcome.crash}")
            print(ON_CPU)
            _show_printed(printed)
            return False
        verdict = diagnose(outcome.runs, case.out_dtype, case.want, case.hints, case.exact, case.regions)
        if verdict is not None:
            failures.append((case, verdict))
    checked = f"compiled with {tool} and the host compiler" if tool else "compiled with the host compiler only"
    if failures:
        print(f"[x] {title}: {_summarize(failures, cases)}")
        print(ON_CPU)
        _show_printed(printed)
        return False
    print(f"[OK] {title}: all {len(cases)} cases pass on the CPU executor (three launches each in three thread orders, "
          f"poisoned output and guard; {checked})")
    _show_printed(printed)
    print(f"     speed not measured: the CPU executor runs the kernel's threads one at a time (no usable GPU here: "
          f"{gpu_reason.rstrip('.')})")
    show_recorded(name)
    return True


ON_CPU = "     (run on the CPU executor, no usable GPU here: the same cases and diagnosis as on a GPU, speed not measured)"


def _show_printed(printed, lines: int = 20) -> None:
    """What the kernel printed (printf) in the first case that printed, cut at `lines` lines."""
    if printed is None:
        return
    label, text = printed
    shown = text.splitlines()
    cut = f", first {lines} lines" if len(shown) > lines else ""
    print(f"     your kernel printed (case {label}, three launches{cut}):")
    for line in shown[:lines]:
        print(f"     > {line}")


def _summarize(failures, cases) -> str:
    """The first failure, unless the failing cases together say 'one warp is fine, several are not'."""
    case, verdict = failures[0]
    one_warp_ok = any(c.block == 32 for c in cases) and all(c.block > 32 for c, _ in failures)
    if one_warp_ok and not verdict.startswith(("missing bounds", "unwritten", "wrong destination", "it looks like")):
        return (f"a race between warps: every case with one warp (blockDim 32) passes, {len(failures)} case(s) with "
                f"more warps fail ({case.label}: {verdict}). Warps meet only through shared memory: "
                "__syncthreads() after writing the per-warp sums and before reading them")
    return f"case {case.label}: {verdict}"


def _compile(text: str, shown: str, kernel: str, defines: dict):
    from engine.backend import load_source
    module = load_source(text, shown, tuple(sorted(defines.items())))
    try:
        return module.get_function(kernel)
    except Exception:
        raise LookupError(f"{shown} has no kernel named {kernel} (it must be declared "
                          f"extern \"C\" __global__ void {kernel}(...))") from None


def _device_inputs(case: Case) -> dict:
    import cupy as cp
    return {name: cp.asarray(a) for name, a in case.inputs.items()}


def _launch_runs(kernel, case: Case):
    """Launch RUNS times into a freshly poisoned output + guard; (list of host bit arrays, crash or None)."""
    import cupy as cp
    dev = _device_inputs(case)
    n = case.want.size
    guard = max(4096, n // 4)          # enough for any overshoot of the grid (at most a block per row)
    runs = []
    try:
        for _ in range(RUNS):
            buf = cp.full(n + guard, POISON[case.out_dtype], dtype=BITS[case.out_dtype])
            dev["out"] = buf[:n].reshape(case.want.shape)
            kernel(case.grid, (case.block,), case.args(dev))
            cp.cuda.Device().synchronize()
            runs.append(buf.get())
    except cp.cuda.runtime.CUDARuntimeError as exc:
        return runs, str(exc)
    return runs, None


def time_ms(launch: Callable[[], None], reps: int = 20) -> float:
    """Median over 5 rounds of (time of `reps` back-to-back launches) / reps, by CUDA events."""
    import cupy as cp
    for _ in range(3):
        launch()
    start, end = cp.cuda.Event(), cp.cuda.Event()
    times = []
    for _ in range(5):
        start.record()
        for _ in range(reps):
            launch()
        end.record()
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end) / reps)
    return float(np.median(times))


def _report_speed(exercise: Exercise, text: str, shown: str) -> None:
    import cupy as cp

    from engine.backend import load_kernel
    case = exercise.timing()
    yours = _compile(text, shown, exercise.kernel, case.defines)
    engine = load_kernel(exercise.stage, exercise.kernel, **case.defines)
    dev = _device_inputs(case)
    dev["out"] = cp.empty(case.want.shape, dtype=BITS[case.out_dtype])
    args = case.args(dev)
    figures = {}
    for who, kernel in (("yours", yours), ("engine", engine)):
        ms = time_ms(functools.partial(kernel, case.grid, (case.block,), args))
        figures[who] = (ms, case.nbytes / (ms * 1e-3) / 1e9)
    (ms_y, gb_y), (ms_e, gb_e) = figures["yours"], figures["engine"]
    print(f"     speed on {case.label}: yours {ms_y * 1e3:.1f} us = {gb_y:,.0f} GB/s, the engine's kernels_cu/"
          f"{exercise.stage}.cu {ms_e * 1e3:.1f} us = {gb_e:,.0f} GB/s ({100 * gb_y / gb_e:.0f}% of it)")


# ----------------------------------------------------------------------------------------------
# Shared input builders
# ----------------------------------------------------------------------------------------------

def bf16_values(rng, shape, scale=1.0) -> tuple[np.ndarray, np.ndarray]:
    """(bf16 bits, the float32 values of exactly those bits)."""
    from engine.backend import f32_to_bf16
    bits = f32_to_bf16(rng.standard_normal(shape, dtype=np.float32) * np.float32(scale))
    return bits, bf16_to_f32(bits)


def f32_values(rng, shape, scale=1.0) -> np.ndarray:
    return (rng.standard_normal(shape, dtype=np.float32) * np.float32(scale)).astype(np.float32)
