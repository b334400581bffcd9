"""`python -m engine.exercises.record_cells`: record what every GPU cell of the chapters prints on this GPU.

A chapter's GPU cell branches on the backend; on a CPU its skip branch calls
`show_recorded_cell("03_embedding/gather-kernel", backend.reason)`, which prints what the same cell
printed on a GPU. This command makes that recording. On a CUDA machine, without Jupyter, it runs
each chapter notebook that has such a cell (chapters/*.ipynb, not the solutions copies): the code
cells in order up to its last GPU cell, as Python, in one fresh namespace per notebook, in a
subprocess with cwd = chapters/ and MPLBACKEND=Agg, capturing each cell's stdout (and, as Jupyter
shows it, the repr of a final bare expression, unless the cell ends with `;`). The stdout of every
cell that names a key is stored under that key, with the device, the date, the default model and
the CuPy/CUDA versions, in engine/exercises/recorded/gpu_cells.json. Plots are not kept: the entry
counts the figures a cell drew, and the recorded banner says that the text only was kept.

The notebooks run in a temporary copy of the repository in which every CUDA exercise
kernels_cu/exercises/<name>.cu is replaced by its worked solution kernels_cu/exercises/solutions/<name>.cu,
so the cells that run the model with "your" kernel record the solution's run, and their output is
stored worded as the worked solution's ("with the worked solution's kernel", never "yours"). The copy comes first
on PYTHONPATH (and ENGINE_KERNELS_DIR points at its kernels_cu/). The default model is the one
`engine.ensure_default_model()` returns: set ENGINE_MODEL_DIR on a machine without network.

A notebook that raises is reported with its cell index and the traceback; the command then exits
non-zero and writes nothing. Without a usable GPU it refuses to run.

    python -m engine.exercises.record_cells [--out PATH] [--only NOTEBOOK ...] [--timeout S]

`--only 03_embedding 11_paged_attention` re-records those notebooks and keeps the other entries of an
existing output file (each stamped with its own device and date). Record the CUDA checkers' run and
the GPU cells on the same machine:

    python -m engine.exercises.record_gpu && python -m engine.exercises.record_cells
"""
from __future__ import annotations

import argparse
import ast
import builtins
import contextlib
import datetime
import io
import json
import linecache
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tokenize
import traceback
from dataclasses import dataclass
from pathlib import Path

from engine.exercises.recorded import RECORDED_CELLS, as_worked_solution

REPO = Path(__file__).resolve().parents[2]
COPIED_DIRS = ("engine", "kernels_cu", "chapters", "notes", "tests")   # what the notebooks read
COPIED_FILES = ("pyproject.toml", "README.md")
KEY_RE = re.compile(r"""show_recorded_cell\(\s*["']([^"']+)["']""")
EXERCISE_FILE_RE = re.compile(r"""["']exercises["']\s*/\s*["'](\w+)\.cu["']|exercises/(\w+)\.cu""")
# what a GPU run of a recorded cell must not print: its skip branch, a checker's failure
NOT_ON_A_GPU = ("GPU cell skipped here", "[skipped]", "[x] ")


# ----------------------------------------------------------------------------------------------
# The cell executor (no Jupyter, no GPU: unit-tested on a synthetic notebook)
# ----------------------------------------------------------------------------------------------

@dataclass
class CellRun:
    index: int       # position in the notebook's cells (markdown counted, 0-based: as nbclient reports it)
    cell_id: str
    source: str
    output: str      # what the cell printed, then the repr of its final bare expression
    figures: int     # matplotlib figures it left open (the inline backend would have shown them)
    seconds: float


class CellError(RuntimeError):
    """A cell raised: which one (index as nbclient counts it, and id) and the traceback."""

    def __init__(self, notebook: str, index: int, cell_id: str, tb: str):
        self.notebook, self.index, self.cell_id, self.traceback = notebook, index, cell_id, tb
        super().__init__(f"{notebook}: cell {index} (id {cell_id}) raised:\n{tb}")


def code_cells(notebook: dict) -> list[tuple[int, str, str]]:
    """(index among all cells, id, source) of every code cell."""
    out = []
    for i, cell in enumerate(notebook.get("cells", [])):
        if cell.get("cell_type") == "code":
            src = cell.get("source", "")
            out.append((i, cell.get("id", ""), "".join(src) if isinstance(src, list) else src))
    return out


def cell_keys(source: str) -> list[str]:
    """The show_recorded_cell keys a cell's source names."""
    return KEY_RE.findall(source)


def is_quiet(source: str) -> bool:
    """True when the cell's last token is `;`: Jupyter then shows no value for its final expression."""
    skip = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER)
    try:
        tokens = [t for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type not in skip]
    except (tokenize.TokenError, SyntaxError):
        return False
    return bool(tokens) and tokens[-1].string == ";"


def clean_output(text: str) -> str:
    """What a notebook shows of a stream: on each line, the text after the last carriage return."""
    lines = []
    for line in text.split("\n"):
        parts = [p for p in line.split("\r") if p]
        lines.append(parts[-1] if parts else "")
    return "\n".join(lines)


class _Capture(io.StringIO):
    def isatty(self) -> bool:
        return False


def _close_figures() -> int:
    plt = sys.modules.get("matplotlib.pyplot")
    if plt is None:
        return 0
    n = len(plt.get_fignums())
    plt.close("all")
    return n


def _run_source(source: str, filename: str, namespace: dict) -> None:
    lines = source.splitlines(keepends=True)
    linecache.cache[filename] = (len(source), None, lines, filename)    # tracebacks show the cell's lines
    tree = ast.parse(source, filename)
    last = tree.body[-1] if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    body = ast.Module(body=tree.body[:-1] if last else tree.body, type_ignores=[])
    exec(compile(body, filename, "exec"), namespace)
    if last is not None:
        value = eval(compile(ast.Expression(last.value), filename, "eval"), namespace)
        if value is not None and not is_quiet(source):
            namespace["_"] = value
            out = sys.stdout
            if isinstance(out, io.StringIO) and out.getvalue() and not out.getvalue().endswith("\n"):
                print()                       # Jupyter shows the value as an output of its own
            print(repr(value))


def execute_cells(cells: list[tuple[int, str, str]], name: str = "notebook", namespace: dict | None = None,
                  on_cell=None) -> list[CellRun]:
    """Run code cells in order in one namespace, as a Jupyter kernel would, capturing what each prints.
    Raises CellError (index, id, traceback) on the first cell that raises."""
    namespace = {"__name__": "__main__", "__builtins__": builtins} if namespace is None else namespace
    runs = []
    for index, cell_id, source in cells:
        filename = f"<{name} cell {index}>"
        out = _Capture()
        t0 = time.perf_counter()
        try:
            with contextlib.redirect_stdout(out):
                _run_source(source, filename, namespace)
        except BaseException as exc:   # SystemExit and KeyboardInterrupt in a cell are failures too
            _close_figures()
            tb = exc.__traceback__
            while tb is not None and tb.tb_frame.f_code.co_filename != filename:
                tb = tb.tb_next            # drop the executor's own frames
            text = "".join(traceback.format_exception(type(exc), exc, tb or exc.__traceback__))
            raise CellError(name, index, cell_id, (clean_output(out.getvalue()) + text).strip()) from exc
        run = CellRun(index, cell_id, source, clean_output(out.getvalue()), _close_figures(), time.perf_counter() - t0)
        runs.append(run)
        if on_cell is not None:
            on_cell(run)
    return runs


def execute_notebook(path: Path, on_cell=None, last_keyed: bool = False) -> list[CellRun]:
    """Run a notebook's code cells in this process (cwd unchanged), in a fresh namespace; with
    `last_keyed`, only up to the last cell that names a show_recorded_cell key (what comes after it
    cannot change what it printed)."""
    path = Path(path)
    cells = code_cells(json.loads(path.read_text(encoding="utf-8")))
    if last_keyed:
        keyed = [k for k, (_, _, src) in enumerate(cells) if cell_keys(src)]
        cells = cells[:keyed[-1] + 1] if keyed else []
    return execute_cells(cells, path.name, on_cell=on_cell)


# ----------------------------------------------------------------------------------------------
# The recorder
# ----------------------------------------------------------------------------------------------

def notebooks_with_keys(chapters: Path) -> dict[str, list[str]]:
    """chapters/*.ipynb (not the solutions) -> the keys its cells name, for notebooks with any."""
    found = {}
    for path in sorted(chapters.glob("*.ipynb")):
        keys = [k for _, _, src in code_cells(json.loads(path.read_text(encoding="utf-8"))) for k in cell_keys(src)]
        if keys:
            found[path.name] = keys
    return found


def copy_repository(src: Path, dst: Path) -> list[str]:
    """The parts of the repository the notebooks read, with each CUDA exercise replaced by its worked
    solution; returns the names of the replaced exercises."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".ipynb_checkpoints")
    for d in COPIED_DIRS:
        if (src / d).is_dir():
            shutil.copytree(src / d, dst / d, ignore=ignore)
    for f in COPIED_FILES:
        if (src / f).is_file():
            shutil.copy2(src / f, dst / f)
    replaced = []
    exercises = dst / "kernels_cu" / "exercises"
    for solution in sorted((exercises / "solutions").glob("*.cu")):
        if (exercises / solution.name).is_file():
            shutil.copy2(solution, exercises / solution.name)
            replaced.append(solution.stem)
    return replaced


def default_model_name() -> str:
    from engine.formats.gguf_convert import read_marker
    from engine.model.default_model import GGUF_SHA256, MODEL_NAME, ensure_default_model
    model_dir = ensure_default_model()
    marker = read_marker(model_dir) or {}
    return MODEL_NAME if marker.get("source_sha256") == GGUF_SHA256 else model_dir.name


def versions() -> dict:
    out = {}
    with contextlib.suppress(Exception):
        import cupy
        out["cupy"] = cupy.__version__
        v = cupy.cuda.runtime.runtimeGetVersion()
        out["cuda"] = f"{v // 1000}.{v % 1000 // 10}"
        v = cupy.cuda.runtime.driverGetVersion()
        out["cuda_driver"] = f"{v // 1000}.{v % 1000 // 10}"
    return out


def _child(notebook: str, result: Path) -> int:
    """Inside the repository copy (cwd = its chapters/): run one notebook, write its keyed cells."""
    import warnings
    warnings.filterwarnings("ignore", message=".*non-interactive.*")   # plt.show() under Agg
    from engine.backend import resolve_backend
    resolve_backend("cupy")
    import engine
    copy_root = Path.cwd().resolve().parent
    if copy_root not in Path(engine.__file__).resolve().parents:
        raise RuntimeError(f"engine was imported from {engine.__file__}, not from the copy {copy_root}")

    def progress(run: CellRun) -> None:
        keys = cell_keys(run.source)
        if keys or run.seconds > 20:
            print(f"  {notebook} cell {run.index:3d} {run.seconds:7.1f} s  {' '.join(keys)}", file=sys.stderr, flush=True)

    try:
        runs = execute_notebook(Path(notebook), on_cell=progress, last_keyed=True)
    except CellError as e:
        result.write_text(json.dumps({"error": {"index": e.index, "id": e.cell_id, "traceback": e.traceback}}))
        return 1
    cells = [{"key": key, "index": r.index, "id": r.cell_id, "output": r.output, "figures": r.figures,
              "solutions": sorted({a or b for a, b in EXERCISE_FILE_RE.findall(r.source)})}
             for r in runs for key in cell_keys(r.source)]
    partial = result.with_suffix(".partial")
    partial.write_text(json.dumps({"cells": cells}))
    partial.replace(result)                   # all or nothing: a reader never sees half a file
    return 0


def run_notebook(copy_root: Path, notebook: str, timeout: float) -> dict:
    """Run one notebook of the copy in a fresh subprocess; its keyed cells, or {"error": ...}."""
    env = dict(os.environ, MPLBACKEND="Agg", PYTHONUNBUFFERED="1", ENGINE_KERNELS_DIR=str(copy_root / "kernels_cu"),
               PYTHONPATH=os.pathsep.join([str(copy_root), *filter(None, [os.environ.get("PYTHONPATH")])]))
    result = copy_root / f".{notebook}.result.json"
    result.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "engine.exercises.record_cells", "--child", notebook, "--result", str(result)]
    # A session of its own: on a timeout the whole group goes (a cell's own `python -m engine.bench` or
    # server too), so nothing keeps the GPU busy while the next notebook runs.
    proc = subprocess.Popen(cmd, cwd=copy_root / "chapters", env=env, start_new_session=True)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return {"error": {"index": None, "id": None, "traceback": f"did not finish within {timeout:.0f} s (--timeout)"}}
    try:
        return json.loads(result.read_text())
    except (OSError, json.JSONDecodeError):   # no result, or one cut short by a crash
        return {"error": {"index": None, "id": None,
                          "traceback": f"the notebook's process exited with status {proc.returncode} without a result"}}


def _problems(notebook: str, keys: list[str], cells: list[dict]) -> list[str]:
    problems = [f"{notebook}: key {k!r} is used by more than one cell" for k in sorted({k for k in keys if keys.count(k) > 1})]
    for c in cells:
        where = f"{notebook} cell {c['index']} ({c['key']})"
        if not c["output"].strip():
            problems.append(f"{where} printed nothing on the GPU")
        for marker in NOT_ON_A_GPU:
            if marker in c["output"]:
                problems.append(f"{where} printed {marker.strip()!r}: its GPU branch did not run cleanly")
    return problems


def _chosen(found: dict[str, list[str]], only: list[str] | None) -> dict[str, list[str]]:
    if not only:
        return found
    names = {n.removesuffix(".ipynb").split("/")[-1] + ".ipynb" for n in only}
    unknown = names - set(found)
    if unknown:
        raise SystemExit(f"--only: no GPU cells to record in {sorted(unknown)} (notebooks with some: {sorted(found)})")
    return {n: k for n, k in found.items() if n in names}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=RECORDED_CELLS)
    ap.add_argument("--only", nargs="+", metavar="NOTEBOOK", help="e.g. 03_embedding 11_paged_attention.ipynb")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per notebook (default 1800)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        code = _child(args.child, args.result)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)    # as a Jupyter kernel is shut down: threads a notebook left running (a server) end here

    from engine.backend import BackendError, gpu_name, resolve_backend
    try:
        resolve_backend("cupy")
    except BackendError as exc:
        print(f"record_cells records what the GPU cells print on a GPU, and needs one: {exc}", file=sys.stderr)
        return 2
    chapters = REPO / "chapters"
    if not chapters.is_dir():
        print(f"record_cells runs from a repository checkout: {chapters} does not exist", file=sys.stderr)
        return 2
    todo = _chosen(notebooks_with_keys(chapters), args.only)
    try:
        model = default_model_name()     # fetched (or found via ENGINE_MODEL_DIR) once, before the notebooks
    except Exception as exc:   # offline, no pip, a wrong ENGINE_MODEL_DIR
        print(f"record_cells needs the default model ({type(exc).__name__}: {exc}); on a machine without "
              "network set ENGINE_MODEL_DIR to a converted default model", file=sys.stderr)
        return 2
    run = {"device": gpu_name(), "date": datetime.date.today().isoformat(), "model": model, **versions(), "cells": {}}
    print(f"recording the GPU cells of {len(todo)} notebooks on {run['device']}, default model {model}", file=sys.stderr)
    problems, start = [], time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="record_cells_") as tmp:
        copy_root = Path(tmp)
        replaced = copy_repository(REPO, copy_root)
        print(f"worked solutions in place of the CUDA exercises: {', '.join(replaced)}", file=sys.stderr)
        for notebook, keys in todo.items():
            t0 = time.perf_counter()
            result = run_notebook(copy_root, notebook, args.timeout)
            if "error" in result:
                e = result["error"]
                where = f"cell {e['index']} (id {e['id']})" if e["index"] is not None else "the run"
                problems.append(f"{notebook}: {where} failed:\n{e['traceback']}")
                print(f"{notebook}: FAILED at {where}", file=sys.stderr)
                continue
            cells = result["cells"]
            problems += _problems(notebook, keys, cells)
            for c in cells:
                entry = {"notebook": notebook, "cell_id": c["id"], "output": c["output"]}
                if c["figures"]:
                    entry["figures"] = c["figures"]
                if c["solutions"]:
                    entry["solutions"] = [s for s in c["solutions"] if s in replaced]
                if entry.get("solutions"):     # it ran the worked solution: its figures are not "yours"
                    entry["output"] = as_worked_solution(entry["output"])
                run["cells"][c["key"]] = entry
            print(f"{notebook}: {len(cells)} GPU cells recorded in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    if problems:
        print("\nnot recorded (nothing written):\n" + "\n\n".join(problems), file=sys.stderr)
        return 1
    if args.only and args.out.is_file():        # keep the other notebooks' entries, stamped with their own run
        old = json.loads(args.out.read_text())
        for key, entry in old.get("cells", {}).items():
            if entry.get("notebook") not in todo and key not in run["cells"]:
                stamp = {f: old[f] for f in ("device", "date", "model") if f in old and f not in entry}
                run["cells"][key] = {**entry, **stamp}
    run["cells"] = dict(sorted(run["cells"].items()))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(run, indent=1, ensure_ascii=False) + "\n")
    print(f"recorded {len(run['cells'])} GPU cells of {len(todo)} notebooks on {run['device']} "
          f"in {time.perf_counter() - start:.0f} s to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
