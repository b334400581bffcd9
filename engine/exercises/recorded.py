"""What the GPU track prints on a real GPU, for learners reading the chapters on a CPU.

Two recordings, both made on a CUDA machine and both labelled as a recorded run (device, date) when
shown; nothing here is computed on the CPU. What a recorded run of a worked solution printed about
the learner's kernel ("yours", "with your kernel") is worded as the worked solution's
(`as_worked_solution`, applied when recording and when showing):

  * `python -m engine.exercises.record_gpu` runs every worked solution through its checker and the
    kernel ladder of `engine.bench.kernels` -> engine/exercises/recorded/gpu_run.json
    (`show_recorded`, `show_ladder`: the CUDA exercise checkers and the ladder cells);
  * `python -m engine.exercises.record_cells` runs the chapter notebooks and keeps what every GPU
    cell printed -> engine/exercises/recorded/gpu_cells.json (`show_recorded_cell`: the skip branch
    of each GPU cell, `show_recorded_cell("03_embedding/gather-kernel", backend.reason)`).

Record both on the same machine:
    python -m engine.exercises.record_gpu && python -m engine.exercises.record_cells
"""
from __future__ import annotations

import json
import re
from pathlib import Path

RECORDED = Path(__file__).resolve().parent / "recorded" / "gpu_run.json"
HOW = "python -m engine.exercises.record_gpu (on a CUDA GPU) records one"
RECORDED_CELLS = Path(__file__).resolve().parent / "recorded" / "gpu_cells.json"
HOW_CELLS = "python -m engine.exercises.record_cells (on a CUDA GPU) records it"


# What the checker and the chapters' cells print about the learner's kernel ("yours", "your kernel"), as
# worded in a recording, where the kernel is the worked solution.
_LEARNERS = ((re.compile(r"\byours\b"), "the worked solution"),
             (re.compile(r"\b[Ww]ith your kernel\b"), "with the worked solution's kernel"),
             (re.compile(r"\byour kernel\b"), "the worked solution's kernel"),
             (re.compile(r"\bYour kernel\b"), "The worked solution's kernel"))


def as_worked_solution(text: str) -> str:
    """A recorded output of the worked solution, labelled as the worked solution's, never "yours"."""
    for pattern, words in _LEARNERS:
        text = pattern.sub(words, text)
    return text


def load(path: Path | None = None) -> dict | None:
    path = path or RECORDED
    return json.loads(path.read_text()) if path.is_file() else None


def _banner(run: dict) -> str:
    return f"{run['device']}, {run['date']}"


def _quote(text: str) -> None:
    """A recorded output, each line after '    | ' (set apart from what this machine printed)."""
    for line in text.rstrip().splitlines():
        print(f"    | {line}")


def show_recorded(exercise: str, path: Path | None = None) -> None:
    """Print what the worked solution's checker printed in the recorded GPU run."""
    run = load(path)
    if run is None or exercise not in run.get("checks", {}):
        print(f"    (no recorded GPU run of this exercise in {(path or RECORDED).name} yet: {HOW})")
        return
    print(f"    Recorded run of the worked solution kernels_cu/exercises/solutions/{exercise}.cu "
          f"on {_banner(run)}:")
    _quote(as_worked_solution(run["checks"][exercise]))


def ladder_rows(stage: str, path: Path | None = None) -> list[dict]:
    run = load(path)
    return [r for r in (run or {}).get("ladder", []) if r.get("ladder") == stage]


def show_ladder(stage: str, path: Path | None = None) -> None:
    """Print the recorded kernel ladder of one stage: each version's time, GB/s and share of copy bandwidth."""
    run = load(path)
    rows = ladder_rows(stage, path)
    if run is None or not rows:
        print(f"(no recorded kernel ladder for {stage!r} in {(path or RECORDED).name} yet: {HOW})")
        return
    print(f"Kernel ladder for {stage}, recorded on {_banner(run)} "
          f"(measured copy bandwidth {run['copy_gbps']:,.0f} GB/s); python -m engine.kernel_bench --only ladder")
    print(f"  {'kernel':<52} {'shape':<44} {'ms':>8} {'GB/s':>7} {'%copy':>6} {'check':>6}")
    for r in rows:
        print(f"  {r['kernel']:<52} {r['shape']:<44} {r['ms']:>8.4f} {r['gbps']:>7,.0f} {r['pct_of_copy']:>6.1f} "
              f"{'ok' if r['ok'] else 'FAIL':>6}")


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def show_recorded_cell(key: str, reason: str | None = None, path: Path | None = None) -> None:
    """The skip branch of a chapter's GPU cell: say why this machine skipped it, then print what the
    same cell printed on a GPU (recorded by `python -m engine.exercises.record_cells`), each line
    prefixed with '    | '. `reason` defaults to `cupy_unavailable_reason()`."""
    if reason is None:
        from engine.backend import cupy_unavailable_reason
        reason = cupy_unavailable_reason() or "the NumPy backend was chosen"
    reason = reason.rstrip(".")
    path = path or RECORDED_CELLS
    run = load(path) or {}
    cell = run.get("cells", {}).get(key)
    if cell is None or not cell.get("output"):
        print(f"GPU cell skipped here: {reason}. No recorded GPU output for {key!r} in {path.name} yet: {HOW_CELLS}.")
        return
    device, date = cell.get("device") or run.get("device", "?"), cell.get("date") or run.get("date", "?")
    model = cell.get("model") or run.get("model")
    what = f"{device}, {date}" + (f", default model {model}" if model else "")
    solutions = cell.get("solutions") or []
    if solutions:
        what += ", with the worked solution " + " and ".join(f"kernels_cu/exercises/solutions/{s}.cu" for s in solutions)
    if cell.get("figures"):
        what += f" (text only: its {_plural(cell['figures'], 'figure')} not kept)"
    print(f"GPU cell skipped here: {reason}. What it printed in a recorded run on {what}:")
    _quote(as_worked_solution(cell["output"]) if solutions else cell["output"])
