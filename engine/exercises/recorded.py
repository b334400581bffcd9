"""What the GPU track prints on a real GPU, for learners reading the chapters on a CPU.

`python -m engine.exercises.record_gpu` (on a CUDA machine) runs every worked solution through its
checker and the kernel ladder of `engine.kernel_bench`, and stores both, with the device and the
date, in engine/exercises/recorded/gpu_run.json. The chapters print from that file, labelled as a
recorded run; nothing here is computed on the CPU.
"""
from __future__ import annotations

import json
from pathlib import Path

RECORDED = Path(__file__).resolve().parent / "recorded" / "gpu_run.json"
HOW = "python -m engine.exercises.record_gpu (on a CUDA GPU) records one"


def load(path: Path | None = None) -> dict | None:
    path = path or RECORDED
    return json.loads(path.read_text()) if path.is_file() else None


def _banner(run: dict) -> str:
    return f"{run['device']}, {run['date']}"


def show_recorded(exercise: str, path: Path | None = None) -> None:
    """Print what the worked solution's checker printed in the recorded GPU run."""
    run = load(path)
    if run is None or exercise not in run.get("checks", {}):
        print(f"    (no recorded GPU run of this exercise in {(path or RECORDED).name} yet: {HOW})")
        return
    print(f"    Recorded run of the worked solution kernels_cu/exercises/solutions/{exercise}.cu "
          f"on {_banner(run)}:")
    for line in run["checks"][exercise].rstrip().splitlines():
        print(f"    | {line}")


def ladder_rows(stage: str, path: Path | None = None) -> list[dict]:
    run = load(path)
    return [r for r in (run or {}).get("ladder", []) if r.get("ladder") == stage]


def show_ladder(stage: str, path: Path | None = None) -> None:
    """Print the recorded kernel ladder of one stage: each version's time, GB/s and share of copy bandwidth."""
    run = load(path)
    rows = ladder_rows(stage, path)
    if not rows:
        print(f"(no recorded kernel ladder for {stage!r} in {(path or RECORDED).name} yet: {HOW})")
        return
    print(f"Kernel ladder for {stage}, recorded on {_banner(run)} "
          f"(measured copy bandwidth {run['copy_gbps']:,.0f} GB/s); python -m engine.kernel_bench --only ladder")
    print(f"  {'kernel':<52} {'shape':<44} {'ms':>8} {'GB/s':>7} {'%copy':>6} {'check':>6}")
    for r in rows:
        print(f"  {r['kernel']:<52} {r['shape']:<44} {r['ms']:>8.4f} {r['gbps']:>7,.0f} {r['pct_of_copy']:>6.1f} "
              f"{'ok' if r['ok'] else 'FAIL':>6}")
