"""Every GPU cell of the chapters shows, on a CPU, what it printed on a GPU (engine.exercises.recorded).

The cells: each one that branches on the GPU (`backend.is_gpu`, `cupy_unavailable_reason()`) calls
`show_recorded_cell(KEY)` in its CPU branch, under a key unique in its notebook and present in the
recording. The recorder (`python -m engine.exercises.record_cells`): its cell executor, run here on
a synthetic notebook, and the repository copy it runs the notebooks in.
"""
import ast
import json
import re
from pathlib import Path

import pytest

from engine.exercises import record_cells, recorded
from engine.exercises.record_cells import CellError, cell_keys, code_cells, execute_notebook, is_quiet

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = ROOT / "chapters"
NOTEBOOKS = sorted(CHAPTERS.glob("*.ipynb")) + sorted((CHAPTERS / "solutions").glob("*.ipynb"))
SKIP_MESSAGE = re.compile(r"GPU cells? skipped|GPU check skipped|needs a CUDA GPU|no CUDA GPU", re.I)


def _cells(path):
    return code_cells(json.loads(path.read_text(encoding="utf-8")))


def _chapter_of(path: Path) -> str:
    """03_embedding for chapters/03_embedding.ipynb and chapters/solutions/03_embedding_solutions.ipynb."""
    return path.stem.removesuffix("_solutions")


def _names(node) -> set[str]:
    return {n.attr if isinstance(n, ast.Attribute) else n.id for n in ast.walk(node) if isinstance(n, (ast.Attribute, ast.Name))}


def _branches(node: ast.If):
    """(cpu branch, gpu branch) of an `if` that tests the GPU, else None."""
    names = _names(node.test)
    if not names & {"is_gpu", "cupy_unavailable_reason"}:
        return None
    test = node.test
    cpu_first = (isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not)) or (
        isinstance(test, ast.Compare) and isinstance(test.ops[0], ast.IsNot))      # `reason() is not None`
    return (node.body, node.orelse) if cpu_first else (node.orelse, node.body)


def _calls(stmts, name) -> list[ast.Call]:
    return [n for s in stmts for n in ast.walk(s) if isinstance(n, ast.Call) and name in _names(n.func)]


def gpu_cells(path):
    """(index, source, the cell's other top-level statements, cpu branch) of every cell with a GPU
    branch and a CPU branch."""
    found = []
    for index, _, source in _cells(path):
        body = ast.parse(source).body
        for k, stmt in enumerate(body):
            ifs = [n for n in ast.walk(stmt) if isinstance(n, ast.If) and (b := _branches(n)) and b[0] and b[1]]
            if ifs:
                found.append((index, source, body[:k] + body[k + 1:], _branches(ifs[0])[0]))
                break
    return found


ALL_GPU_CELLS = [(p, i, s, rest, cpu) for p in NOTEBOOKS for i, s, rest, cpu in gpu_cells(p)]


def test_the_gpu_cells_are_found():
    assert len(ALL_GPU_CELLS) >= 20
    found = {p.name for p, *_ in ALL_GPU_CELLS}
    assert {"03_embedding.ipynb", "13_flash_attention_solutions.ipynb", "appendix_qwen_solutions.ipynb"} <= found
    # chapter 12's cell that only adds a `--backend cupy` case without a GPU is not a GPU cell
    assert not any(p.name == "12_chat_and_serving.ipynb" and "bad.append" in s for p, _, s, _, _ in ALL_GPU_CELLS)


@pytest.mark.parametrize("path,index,source,outside,cpu", ALL_GPU_CELLS,
                         ids=[f"{p.relative_to(CHAPTERS).as_posix()}-cell{i}" for p, i, *_ in ALL_GPU_CELLS])
def test_a_gpu_cell_shows_its_recorded_output_on_a_cpu(path, index, source, outside, cpu):
    calls = _calls(cpu, "show_recorded_cell")
    assert len(calls) == 1, f"the CPU branch of cell {index} must call show_recorded_cell(KEY) once"
    assert isinstance(calls[0].args[0], ast.Constant), "the key is a string literal (the recorder reads it from the source)"
    assert cell_keys(source) == [calls[0].args[0].value]
    for call in _calls(cpu, "print"):
        text = ast.get_source_segment(source, call)
        assert "skipped" not in text, f"cell {index} still prints its own skip message: {text}"
    # what the recorder keeps is everything the cell prints: nothing may print outside the GPU branch,
    # or a CPU would show it twice (once itself, once in the recording)
    assert not _calls(outside, "print"), f"cell {index} prints outside its GPU branch: split it"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.relative_to(CHAPTERS).as_posix() for p in NOTEBOOKS])
def test_no_cell_prints_a_bare_skip_message_and_every_cell_is_plain_python(path):
    for index, _, source in _cells(path):
        tree = ast.parse(source)      # no IPython magics or shell lines: the recorder runs cells as Python
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and SKIP_MESSAGE.search(node.value):
                pytest.fail(f"cell {index} prints {node.value!r}: call show_recorded_cell in its CPU branch instead")
        if "show_recorded_cell(" in source:
            assert cell_keys(source), f"cell {index} calls show_recorded_cell without a literal key"


def _keys(path) -> list[str]:
    return [k for _, _, s in _cells(path) for k in cell_keys(s)]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.relative_to(CHAPTERS).as_posix() for p in NOTEBOOKS])
def test_keys_are_unique_per_notebook_and_a_solution_copy_reuses_its_chapters(path):
    keys = _keys(path)
    assert len(keys) == len(set(keys)), f"duplicate keys in {path.name}: {keys}"
    for key in keys:
        assert re.fullmatch(rf"{_chapter_of(path)}/[a-z0-9][a-z0-9-]*", key), f"{key!r}: '<notebook>/<short-name>'"
    if path.parent.name == "solutions":
        chapter = CHAPTERS / f"{_chapter_of(path)}.ipynb"
        assert set(keys) <= set(_keys(chapter)), f"{path.name} uses keys its chapter {chapter.name} does not record"


def test_the_recorder_finds_every_key_in_the_chapters():
    found = record_cells.notebooks_with_keys(CHAPTERS)
    used = {k for p in NOTEBOOKS for k in _keys(p)}
    assert {k for ks in found.values() for k in ks} == used
    assert "02_tokenizer.ipynb" not in found and "03_embedding.ipynb" in found


def test_every_key_is_in_the_recorded_run():
    path = recorded.RECORDED_CELLS
    if not path.is_file():
        pytest.skip(f"no GPU recording yet ({path.relative_to(ROOT)}): python -m engine.exercises.record_cells "
                    "on a CUDA GPU writes it")
    run = json.loads(path.read_text())
    for field in ("device", "date", "model"):
        assert run.get(field), f"{path.name} does not name the {field}"
    missing = []
    for nb in NOTEBOOKS:
        for key in _keys(nb):
            cell = run.get("cells", {}).get(key)
            if cell is None or not cell.get("output", "").strip():
                missing.append(f"{nb.name}: {key}")
            else:
                assert cell["notebook"] == f"{_chapter_of(nb)}.ipynb"
    assert not missing, f"keys without a recorded output (re-run python -m engine.exercises.record_cells): {missing}"


# ----------------------------------------------------------------------------------------------
# show_recorded_cell
# ----------------------------------------------------------------------------------------------

RUN = {"device": "NVIDIA H200", "date": "2026-12-01", "model": "SmolLM2-135M-Instruct", "cupy": "14.0.0", "cuda": "12.8",
       "cells": {"03_embedding/gather-kernel": {"notebook": "03_embedding.ipynb", "cell_id": "03_embedding-21",
                                                "output": "unwritten elements: 0 | exact match: True\nGPU gather: 7.4 us\n"},
                 "03_embedding/your-kernel-in-model": {"notebook": "03_embedding.ipynb", "output": "with your kernel: 'Paris'\n",
                                                       "solutions": ["embedding"], "figures": 2,
                                                       "device": "NVIDIA H100", "date": "2026-11-02"}}}


@pytest.fixture
def recording(tmp_path, monkeypatch):
    path = tmp_path / "gpu_cells.json"
    path.write_text(json.dumps(RUN))
    monkeypatch.setattr(recorded, "RECORDED_CELLS", path)
    return path


def test_show_recorded_cell_prints_a_banner_and_the_recorded_lines(recording, capsys):
    recorded.show_recorded_cell("03_embedding/gather-kernel", "CuPy is not installed.")
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("GPU cell skipped here: CuPy is not installed. What it printed in a recorded run on ")
    assert "NVIDIA H200, 2026-12-01, default model SmolLM2-135M-Instruct" in lines[0] and lines[0].endswith(":")
    assert lines[1:] == ["    | unwritten elements: 0 | exact match: True", "    | GPU gather: 7.4 us"]


def test_show_recorded_cell_names_the_solution_the_figures_and_a_cells_own_run(recording, capsys):
    recorded.show_recorded_cell("03_embedding/your-kernel-in-model", "no GPU")
    first, *rest = capsys.readouterr().out.splitlines()
    assert "NVIDIA H100, 2026-11-02" in first and "kernels_cu/exercises/solutions/embedding.cu" in first
    assert "(text only: its 2 figures not kept)" in first
    assert rest == ["    | with the worked solution's kernel: 'Paris'"]     # the worked solution's, never "your"


def test_no_recorded_cell_that_ran_a_worked_solution_says_your_kernel(capsys):
    run = recorded.load(recorded.RECORDED_CELLS)
    with_solutions = [k for k, c in run["cells"].items() if c.get("solutions")]
    assert with_solutions
    for key in with_solutions:
        recorded.show_recorded_cell(key, "no GPU")
        out = capsys.readouterr().out
        assert "with the worked solution" in out and not re.search(r"\byours?\b", out, re.I), out


def test_show_recorded_cell_defaults_to_the_backends_reason(recording, capsys, monkeypatch):
    monkeypatch.setattr("engine.backend.cupy_unavailable_reason", lambda: "no CUDA driver.")
    recorded.show_recorded_cell("03_embedding/gather-kernel")
    assert capsys.readouterr().out.startswith("GPU cell skipped here: no CUDA driver. ")


def test_show_recorded_cell_without_a_recording_says_how_to_make_one(recording, tmp_path, capsys):
    recorded.show_recorded_cell("05_rope/rope-kernel", "no GPU")
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "'05_rope/rope-kernel'" in out
    assert out.startswith("GPU cell skipped here: no GPU. No recorded GPU output")
    assert "python -m engine.exercises.record_cells" in out
    recorded.show_recorded_cell("03_embedding/gather-kernel", "no GPU", path=tmp_path / "absent.json")
    out = capsys.readouterr().out
    assert "No recorded GPU output" in out and "absent.json" in out and out.count("\n") == 1


# ----------------------------------------------------------------------------------------------
# The recorder: its cell executor, on a synthetic notebook
# ----------------------------------------------------------------------------------------------

def _notebook(tmp_path, *cells) -> Path:
    nb = {"cells": [{"cell_type": t, "id": f"c{i}", "metadata": {}, "source": s.splitlines(keepends=True),
                     **({"outputs": [], "execution_count": None} if t == "code" else {})}
                    for i, (t, s) in enumerate(cells)],
          "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    path = tmp_path / "synthetic.ipynb"
    path.write_text(json.dumps(nb))
    return path


def test_the_executor_captures_each_cells_stdout_and_shows_a_final_expression_as_jupyter_does(tmp_path):
    path = _notebook(tmp_path,
                     ("markdown", "# title"),
                     ("code", "x = 20\nprint('hello')\nx + 1"),             # final expression: its repr
                     ("code", "print('no value shown'); x;"),               # `;` suppresses it
                     ("code", "def f():\n    return None\n\nf()"),          # None: nothing shown
                     ("code", "'text'  # a comment after the value"),
                     ("code", "for i in range(3):\n    print(f'{i}/3', end='\\r')\nprint('done')"),
                     ("code", "y = x * 2   # no output"),
                     ("code", "[y, 'a']"),
                     ("code", "x  # the comment does not hide the value ;"))
    runs = execute_notebook(path)
    assert [r.index for r in runs] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert [r.cell_id for r in runs] == [f"c{i}" for i in range(1, 9)]
    assert [r.output for r in runs] == ["hello\n21\n", "no value shown\n", "", "'text'\n", "done\n", "", "[40, 'a']\n", "20\n"]
    assert all(r.figures == 0 for r in runs)


def test_a_raising_cell_is_reported_with_its_index_and_traceback(tmp_path):
    path = _notebook(tmp_path,
                     ("code", "print('fine')"),
                     ("markdown", "text"),
                     ("code", "print('before the error')\nvalues = [1, 2]\nvalues[5]"),
                     ("code", "print('never runs')"))
    with pytest.raises(CellError) as info:
        execute_notebook(path)
    err = info.value
    assert (err.index, err.cell_id, err.notebook) == (2, "c2", "synthetic.ipynb")
    assert "IndexError" in err.traceback and "values[5]" in err.traceback and "before the error" in err.traceback
    assert "record_cells.py" not in err.traceback         # the executor's own frames are dropped
    assert "cell 2 (id c2)" in str(err)


def test_the_executor_counts_and_closes_the_figures_a_cell_draws(tmp_path):
    pytest.importorskip("matplotlib")
    path = _notebook(tmp_path, ("code", "import matplotlib\nmatplotlib.use('Agg')\nimport matplotlib.pyplot as plt"),
                     ("code", "fig, axes = plt.subplots(1, 2)\nplt.figure()\nplt.plot([1, 2]);\nprint('drawn')"),
                     ("code", "print(len(plt.get_fignums()))"))
    runs = execute_notebook(path)
    assert [(r.output, r.figures) for r in runs] == [("", 0), ("drawn\n", 2), ("0\n", 0)]


def test_quiet_and_keys_are_read_from_the_source():
    assert is_quiet("check_rmsnorm_kernel();") and is_quiet("x = 1\nf() ;  # comment\n")
    assert not is_quiet("x = 1\nx") and not is_quiet("s = ';'\ns")
    assert cell_keys('if a:\n    pass\nelse:\n    show_recorded_cell("03_embedding/gather-kernel", backend.reason)') == [
        "03_embedding/gather-kernel"]


def test_the_repository_copy_runs_the_worked_solutions(tmp_path):
    replaced = record_cells.copy_repository(ROOT, tmp_path)
    assert {"embedding", "rmsnorm", "rope", "swiglu", "kv_write", "paged_attention"} <= set(replaced)
    for name in replaced:
        solution = (ROOT / "kernels_cu" / "exercises" / "solutions" / f"{name}.cu").read_text()
        assert (tmp_path / "kernels_cu" / "exercises" / f"{name}.cu").read_text() == solution
    assert (tmp_path / "engine" / "__init__.py").is_file() and (tmp_path / "chapters" / "03_embedding.ipynb").is_file()
    assert (tmp_path / "tests" / "fixtures").is_dir()                  # the appendix reads ../tests/fixtures
    assert not list(tmp_path.rglob("__pycache__"))


@pytest.mark.nogpu   # with a GPU the recorder would run
def test_the_recorder_refuses_to_run_without_a_gpu(tmp_path, capsys):
    out = tmp_path / "gpu_cells.json"
    assert record_cells.main(["--out", str(out)]) == 2
    assert "needs one" in capsys.readouterr().err and not out.exists()


def test_only_picks_notebooks_by_name_and_rejects_one_without_gpu_cells():
    found = record_cells.notebooks_with_keys(CHAPTERS)
    assert set(record_cells._chosen(found, ["03_embedding", "appendix_qwen.ipynb"])) == {"03_embedding.ipynb",
                                                                                        "appendix_qwen.ipynb"}
    assert record_cells._chosen(found, None) == found
    with pytest.raises(SystemExit, match="02_tokenizer"):
        record_cells._chosen(found, ["02_tokenizer"])


def test_the_recorder_stops_after_the_last_cell_it_records(tmp_path):
    path = _notebook(tmp_path, ("code", "print(1)"), ("code", "if False:\n    pass\nelse:\n    show_recorded_cell = print\n"
                                                       "    show_recorded_cell('k')"), ("code", "raise RuntimeError"))
    assert [r.output for r in execute_notebook(path, last_keyed=True)] == ["1\n", "k\n"]
    with pytest.raises(CellError):
        execute_notebook(path)
