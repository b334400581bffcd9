"""`python -m engine.exercises.record_gpu`: record what the GPU track prints on this GPU.

Runs every worked solution (kernels_cu/exercises/solutions/) through its checker, and the kernel
ladder of `engine.bench.kernels` (each stage's naive and fast kernels), then writes the printed
verdicts (worded as the worked solution's: "the worked solution 8.1 us", not "yours"), the ladder's
rows, the device and the date to engine/exercises/recorded/gpu_run.json. The chapters show that file
to learners without a GPU, labelled as a recorded run of the worked solution. Exits non-zero when
a solution fails its checker or a ladder kernel fails its reference check (nothing is written then).

    python -m engine.exercises.record_gpu [--out PATH] [--skip-ladder]

Its companion `python -m engine.exercises.record_cells` records what every GPU cell of the chapter
notebooks prints (engine/exercises/recorded/gpu_cells.json); record both on the same machine:

    python -m engine.exercises.record_gpu && python -m engine.exercises.record_cells
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import sys
from pathlib import Path
from typing import Any

from engine.exercises import ch03, ch04, ch05, ch07, ch11, ch18
from engine.exercises.cuda_check import SOLUTIONS_DIR
from engine.exercises.recorded import RECORDED, as_worked_solution

# exercise name (= its .cu file) -> checker
CHECKERS = {
    "embedding": ch03.check_embedding_kernel,
    "rmsnorm": ch04.check_rmsnorm_kernel,
    "rope": ch05.check_rope_kernel,
    "swiglu": ch07.check_swiglu_kernel,
    "kv_write": ch11.check_kv_write_kernel,
    "paged_attention": ch11.check_paged_attention_kernel,
    "quant_gemv": ch18.check_quant_gemv_kernel,
}


def run_solution(name: str) -> tuple[bool | None, str]:
    """(the checker's verdict, what it printed) for the worked solution of one exercise."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        verdict = CHECKERS[name](SOLUTIONS_DIR / f"{name}.cu")
    return verdict, out.getvalue()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=RECORDED)
    ap.add_argument("--skip-ladder", action="store_true", help="record the checkers only")
    args = ap.parse_args(argv)
    from engine.backend import gpu_name, resolve_backend
    resolve_backend("cupy")                      # raises, with the reason, on a machine without a GPU
    checks, failed = {}, []
    for name in CHECKERS:
        verdict, text = run_solution(name)
        print(text, end="")
        checks[name] = as_worked_solution(text)     # the worked solution's figures, never "yours"
        if verdict is not True:
            failed.append(name)
    run: dict[str, Any] = {"device": gpu_name(), "date": datetime.date.today().isoformat(), "checks": checks}
    if not args.skip_ladder:
        from engine.bench.kernels import Bench
        bench = Bench(quick=False)
        bench.ladder()
        run["copy_gbps"] = round(bench.copy_gbps, 1)
        run["ladder"] = bench.rows
        failed += [f"ladder: {r['kernel']} {r['shape']}" for r in bench.rows if not r["ok"]]
    if failed:
        print(f"not recorded: failed {failed}", file=sys.stderr)
        return 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(run, indent=1) + "\n")
    print(f"recorded {len(checks)} checks" + ("" if args.skip_ladder else f" and {len(run['ladder'])} ladder rows")
          + f" on {run['device']} to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
