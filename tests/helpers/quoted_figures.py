"""Every GPU figure quoted in prose comes from a recorded measurement.

The prose: README.md, notes/*.md and the markdown cells of chapters/**/*.ipynb. A *figure* is a number
with a unit that a GPU run produces: tok/s, TFLOP/s, GB/s, TB/s, GiB/s, MB/s, µs/us, ms, s, and a % or
a ratio written against its number (0.75×, 17x) on a line that speaks of a measurement (copy, floor,
GEMM, GPU, kernel, transformers, faster, a throughput or time unit, ...); "2 × 16" is a product.
Every figure the scanner finds must carry a marker, an HTML comment (invisible in rendered Markdown
and in JupyterLab) placed after it:

    770 tok/s<!--fig decode.b1.llm_tok_s-->           the figure named in notes/measurements/figures.json
    4.1–4.2 TB/s and 1.84 ms<!--fig h200.copy_tbs_range profile.b64.graph_ms-->
                                                       several figures: one name each, in order
    28 ms per token on 2 cores<!--nofig cpu run-->      not a GPU measurement (a CPU run, arithmetic
                                                       on the spec sheet); the reason is required

A marker covers the figures between the previous marker of the same paragraph (or the paragraph's
start) and itself; a table row, a wrapped sentence or a whole paragraph can share one marker. A figure
still uncovered when its paragraph ends (a blank line, the end of a cell) fails.
A named figure reads its value from a recorded file under notes/measurements/ or
engine/exercises/recorded/ (figures.json says how: a JSON/JSON-lines row and key, a regular expression
over a text file, or arithmetic on other figures), so re-recording a file re-checks every sentence that
quotes it. The quoted number must equal the value at the precision the text writes it: 790 holds
785..795, 1,700 holds 1,650..1,750 (trailing zeros are rounding), 0.75 holds 0.745..0.755; a range
"a–b" must match a figure that is a range.

`python -m tests.helpers.quoted_figures [FILE ...]` lists every unmarked or wrong figure with the
recorded values that would hold it (file, row, key), to help an author mark a sentence.
"""
from __future__ import annotations

import ast
import json
import math
import operator
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
REGISTRY = ROOT / "notes" / "measurements" / "figures.json"
SOURCE_DIRS = (ROOT / "notes" / "measurements", ROOT / "engine" / "exercises" / "recorded")

# --------------------------------------------------------------------------------------------
# Numbers and units in prose
# --------------------------------------------------------------------------------------------

# 1,234.5 / 1 234 (space or narrow space as the thousands separator) / 12.5 / .5 is not written
_NUM = r"\d{1,3}(?:[,\u202f\u2009 ]\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?"
_UNITS = {   # text unit -> (dimension, scale to the dimension's base)
    "tok/s": ("rate", 1.0), "tokens/s": ("rate", 1.0),
    "TFLOP/s": ("flops", 1.0), "TFLOPS": ("flops", 1.0),
    "MB/s": ("bw", 1e-3), "GB/s": ("bw", 1.0), "TB/s": ("bw", 1e3), "GiB/s": ("bw", 2**30 / 1e9),
    "µs": ("time", 1e-3), "us": ("time", 1e-3), "ms": ("time", 1.0), "s": ("time", 1e3),
    "%": ("pct", 1.0), "×": ("ratio", 1.0), "x": ("ratio", 1.0),
    "count": ("count", 1.0),      # a registry unit only (kernel launches, steps): never detected in prose
}
_UNIT_RE = r"tok/s|tokens/s|TFLOP/s|TFLOPS|MB/s|GB/s|TB/s|GiB/s|µs|us\b|ms\b|s\b(?![/-])|%|×|x\b"
FIGURE_RE = re.compile(
    rf"(?<![\w.\-/])(?P<a>{_NUM})(?:\s*(?:–|-|to)\s*(?P<b>{_NUM}))?(?P<k>k)?\s?(?P<unit>{_UNIT_RE})")
# "a / b / c unit": each number of the list is a figure in that unit
LIST_RE = re.compile(rf"(?<![\w.\-/])(?:{_NUM})(?:\s*/\s*(?:{_NUM}))+\s?(?P<unit>{_UNIT_RE})")
# % and × are figures only on a line that speaks of a measurement (its other words or units)
_RATIO_CONTEXT = re.compile(
    r"copy|bandwidth|floor|GEMM|peak|roofline|busy|cuBLAS|transformers|faster|slower|speed-?up|H200|"
    r"GPU|kernel|tensor core|achieved|throughput|tok/s|TFLOP/s|GB/s|TB/s|\d\s?(?:ms|µs|us)\b", re.I)
MARKER_RE = re.compile(r"<!--\s*(?P<kind>fig|nofig)\b(?P<body>.*?)-->")
CODE_SPAN_RE = re.compile(r"`[^`]*`")        # a marker inside inline code (`<!--fig X-->`) is an example


@dataclass
class Quote:
    where: str          # file[#cell]:line
    text: str           # the figure as written
    unit: str
    lo: float           # the quoted number (or range) in the text's unit
    hi: float
    tol_lo: float       # half a unit in the last written place
    tol_hi: float
    is_range: bool
    line: str
    weak: bool = False  # a % or ratio on a line with no word of a measurement: a figure only if a marker names it


def _parse_number(s: str) -> tuple[float, float]:
    """(value, tolerance) of a number as written: half a unit of the last significant place."""
    s = re.sub(r"[,\u202f\u2009 ]", "", s)
    if "." in s:
        return float(s), 0.5 * 10 ** -len(s.split(".")[1])
    zeros = len(s) - len(s.rstrip("0")) if s.strip("0") else 0
    return float(s), 0.5 * 10 ** zeros


def find_quotes(line: str) -> list[tuple[int, Quote | None, re.Match]]:
    """The figures of one line (position, Quote) and its markers (position, None, match)."""
    out: list[tuple[int, Quote | None, re.Match]] = []
    bare = MARKER_RE.sub(lambda m: " " * len(m.group(0)), line)   # markers never hold figures
    measured = bool(_RATIO_CONTEXT.search(bare))
    for m in LIST_RE.finditer(bare):
        unit = m.group("unit")
        weak = unit in ("%", "×", "x") and not measured
        for n in re.finditer(_NUM, m.group(0)[: m.start("unit") - m.start()]):
            a, ta = _parse_number(n.group(0))
            out.append((m.start() + n.start(),
                        Quote("", f"{n.group(0)} {unit}", unit, a, a, ta, ta, False, line, weak), n))
    bare = LIST_RE.sub(lambda m: " " * len(m.group(0)), bare)
    for m in FIGURE_RE.finditer(bare):
        unit = m.group("unit")
        weak = unit in ("%", "×", "x") and not measured
        if unit == "s" and m.group("k"):
            continue
        if unit in ("×", "x") and (bare[m.start("unit") - 1].isspace() or re.match(r"\s*[\d(]", bare[m.end():])):
            continue        # "2 × 16", "4×(…)": a product, not a measured ratio
        a, ta = _parse_number(m.group("a"))
        b, tb = _parse_number(m.group("b")) if m.group("b") else (a, ta)
        mult = 1000.0 if m.group("k") else 1.0
        out.append((m.start(), Quote("", m.group(0), unit, a * mult, b * mult, ta * mult, tb * mult,
                                     m.group("b") is not None, line, weak), m))
    spans = [c.span() for c in CODE_SPAN_RE.finditer(line)]
    for m in MARKER_RE.finditer(line):
        if not any(a <= m.start() < b for a, b in spans):
            out.append((m.start(), None, m))
    out.sort(key=lambda t: t[0])
    return out


# --------------------------------------------------------------------------------------------
# The prose
# --------------------------------------------------------------------------------------------

def prose_files() -> list[Path]:
    files = [ROOT / "README.md"] + sorted((ROOT / "notes").glob("*.md"))
    files += sorted((ROOT / "chapters").glob("*.ipynb")) + sorted((ROOT / "chapters" / "solutions").glob("*.ipynb"))
    return files


def prose_lines(path: Path, text: str | None = None):
    """(where, line) for every line of prose in a file: markdown cells only for a notebook."""
    rel = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)
    if path.suffix == ".ipynb":
        nb = json.loads(text if text is not None else path.read_text())
        for i, cell in enumerate(nb["cells"]):
            if cell["cell_type"] != "markdown":
                continue
            src = cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])
            for n, line in enumerate(src.splitlines(), 1):
                yield f"{rel}#cell{i}:{n}", line
    else:
        for n, line in enumerate((text if text is not None else path.read_text()).splitlines(), 1):
            yield f"{rel}:{n}", line


# --------------------------------------------------------------------------------------------
# The recorded figures
# --------------------------------------------------------------------------------------------

class FigureError(Exception):
    pass


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


class Registry:
    """notes/measurements/figures.json: name -> how to read the value from a recorded file."""

    def __init__(self, path: Path = REGISTRY, root: Path = ROOT):
        self.path, self.root = path, root
        self.spec: dict[str, dict] = json.loads(path.read_text())["figures"]
        self._cache: dict[str, tuple[float, float]] = {}

    def unit(self, name: str) -> str:
        return self._get(name)["unit"]

    def _get(self, name: str) -> dict:
        if name not in self.spec:
            raise FigureError(f"no figure named {name!r} in {self.path.name}")
        return self.spec[name]

    def value(self, name: str) -> tuple[float, float]:
        """(lo, hi) of a figure; lo == hi unless it is a range."""
        if name not in self._cache:
            self._cache[name] = self._resolve(name, self._get(name))
        return self._cache[name]

    def _resolve(self, name: str, spec: dict) -> tuple[float, float]:
        if "range" in spec:
            vals = [v for k in spec["range"] for v in self.value(k)]
            return min(vals), max(vals)
        if "expr" in spec:
            v = self._eval(ast.parse(spec["expr"], mode="eval").body, name)
            return v, v
        path = self.root / spec["source"]
        if not path.is_file():
            raise FigureError(f"{name}: recorded file {spec['source']} is missing")
        if "regex" in spec:
            hits = re.findall(spec["regex"], path.read_text(), re.M)
            vals = [float((h if isinstance(h, str) else h[0]).replace(",", "")) for h in hits]
        else:
            vals = self._json_values(name, spec, path)
        many = spec.get("all", False)    # "all": the range over every match, else exactly one match
        if not vals or (len(vals) != 1 and not many):
            how = f"regex {spec['regex']!r}" if "regex" in spec else f"rows matching {spec.get('where', {})}"
            raise FigureError(f"{name}: {how} give(s) {len(vals)} values in {spec['source']} "
                              f"({'at least one' if many else 'exactly one'} expected)")
        scale = spec.get("scale", 1.0)
        return min(vals) * scale, max(vals) * scale

    def _json_values(self, name: str, spec: dict, path: Path) -> list[float]:
        text = path.read_text()
        rows = [json.loads(x) for x in text.splitlines() if x.startswith("{")] if path.suffix == ".jsonl" \
            else [json.loads(text)]
        where = spec.get("where", {})
        rows = [r for r in rows if all(_dig(r, k, None) == v for k, v in where.items())]
        out = []
        for row in rows:
            v = _dig(row, spec["key"], None)
            if not isinstance(v, (int, float)) or isinstance(v, bool):
                raise FigureError(f"{name}: {spec['source']} has no number at {spec['key']!r} ({v!r})")
            out.append(float(v))
        return out

    def _eval(self, node, name):
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](self._eval(node.left, name), self._eval(node.right, name))
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return float(node.value)
        if isinstance(node, ast.Name) or isinstance(node, ast.Attribute):
            ref = ast.unparse(node)
            lo, hi = self.value(ref)
            if lo != hi:
                raise FigureError(f"{name}: {ref} is a range, not a number")
            return lo
        raise FigureError(f"{name}: only + - * / on figure names and numbers in 'expr'")


def _dig(obj, key: str, default):
    for part in key.split("."):
        if isinstance(obj, list) and part.lstrip("-").isdigit():
            obj = obj[int(part)] if -len(obj) <= int(part) < len(obj) else default
        elif isinstance(obj, dict) and part in obj:
            obj = obj[part]
        else:
            return default
    return obj


def _convert(value: float, from_unit: str, to_unit: str) -> float:
    (d1, s1), (d2, s2) = _UNITS[from_unit], _UNITS[to_unit]
    if d1 != d2:
        raise FigureError(f"a figure in {from_unit} quoted as {to_unit}")
    return value * s1 / s2


def holds(reg: Registry, name: str, q: Quote) -> str | None:
    """None when the figure holds the quote, else why not."""
    lo, hi = reg.value(name)
    unit = reg.unit(name)
    if unit not in _UNITS:
        raise FigureError(f"{name}: unknown unit {unit!r}")
    lo, hi = _convert(lo, unit, q.unit), _convert(hi, unit, q.unit)
    if q.is_range != (lo != hi):
        kind = "a range" if lo != hi else "one number"
        return f"{name} is {kind} ({_fmt(lo)}–{_fmt(hi)} {q.unit}), quoted as {q.text!r}"
    if abs(lo - q.lo) <= q.tol_lo * (1 + 1e-9) and abs(hi - q.hi) <= q.tol_hi * (1 + 1e-9):
        return None
    got = _fmt(lo) if lo == hi else f"{_fmt(lo)}–{_fmt(hi)}"
    return f"{name} = {got} {q.unit} does not round to {q.text!r}"


def _fmt(v: float) -> str:
    return f"{v:,.4g}" if abs(v) < 1e4 else f"{v:,.0f}"


# --------------------------------------------------------------------------------------------
# The check
# --------------------------------------------------------------------------------------------

class Problem(str):
    """A failure message; `quote` is the figure it is about (None for a marker's own error)."""
    quote: Quote | None = None


def _problem(msg: str, quote: Quote | None = None) -> Problem:
    p = Problem(msg)
    p.quote = quote
    return p


def check_lines(lines, reg: Registry) -> list[Problem]:
    """Every figure on these (where, line) pairs is marked and held; returns the failures."""
    problems: list[Problem] = []
    pending: list[Quote] = []

    def unmarked():
        for q in (q for q in pending if not q.weak):
            problems.append(_problem(f"{q.where}: unmarked GPU figure {q.text!r}: {q.line.strip()}", q))
        pending.clear()

    last_file = None
    for where, line in lines:
        block = where.rsplit(":", 1)[0]
        if not line.strip() or block != last_file:      # a paragraph (or a cell) ends
            unmarked()
        last_file = block
        for _, q, m in find_quotes(line):
            if q is not None:
                q.where = where
                pending.append(q)
                continue
            kind, body = m.group("kind"), m.group("body").strip()
            if kind == "nofig":
                if not body:
                    problems.append(_problem(f"{where}: <!--nofig--> needs a reason"))
                pending.clear()
                continue
            names = body.split()
            strong = [q for q in pending if not q.weak]
            # a marker names every figure before it, or the measured ones when it names fewer (the
            # other % and ratios of the paragraph are then arithmetic)
            covered = pending if len(names) == len(pending) else strong if len(names) == len(strong) else None
            if covered is None:
                problems.append(_problem(f"{where}: marker names {len(names)} figure(s) for the "
                                         f"{len(pending)} figure(s) before it ({[p.text for p in pending]}): "
                                         f"{line.strip()}"))
            else:
                for name, q in zip(names, covered):
                    try:
                        why = holds(reg, name, q)
                    except FigureError as exc:
                        why = str(exc)
                    if why:
                        problems.append(_problem(f"{q.where}: {why}: {q.line.strip()}", q))
            pending.clear()
    unmarked()
    return problems


def check_file(path: Path, reg: Registry | None = None, text: str | None = None) -> list[Problem]:
    return check_lines(prose_lines(path, text), reg or Registry())


# --------------------------------------------------------------------------------------------
# Helping an author: which recorded values would hold a figure
# --------------------------------------------------------------------------------------------

def recorded_values():
    """(file, locator, value) for every number in the recorded files (JSON leaves, numbers in text)."""
    for d in SOURCE_DIRS:
        for p in sorted(d.rglob("*")):
            if not p.is_file() or p.suffix in (".py", ".sh"):
                continue
            rel = p.relative_to(ROOT).as_posix()
            text = p.read_text(errors="replace")
            if p.suffix in (".json", ".jsonl"):
                docs = [text] if p.suffix == ".json" else [x for x in text.splitlines() if x.startswith("{")]
                for i, doc in enumerate(docs):
                    try:
                        obj = json.loads(doc)
                    except json.JSONDecodeError:
                        continue
                    for key, v in _leaves(obj, ""):
                        yield rel, f"row {i} {key}", float(v)
                        if isinstance(v, str):
                            pass
            for n, line in enumerate(text.splitlines(), 1):
                if p.suffix in (".json", ".jsonl") and '"output"' not in line and '\\n' not in line:
                    continue
                for m in re.finditer(r"(?<![\w.])\d[\d,]*(?:\.\d+)?", line):
                    yield rel, f"line {n}", float(m.group(0).replace(",", ""))


def _leaves(obj, prefix):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _leaves(v, f"{prefix}.{k}" if prefix else k)
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _leaves(v, f"{prefix}.{i}" if prefix else str(i))
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool) and math.isfinite(obj):
        yield prefix, obj


def suggest(q: Quote, values, limit: int = 6) -> list[str]:
    out = []
    scales = {"TB/s": 1e3, "µs": 1e-3, "us": 1e-3, "s": 1e3}   # recorded files use GB/s and ms mostly
    for f, loc, v in values:
        if "timeline" in loc:
            continue
        for s in {1.0, scales.get(q.unit, 1.0), 1 / scales.get(q.unit, 1.0)}:
            if abs(v / s - q.lo) <= q.tol_lo:
                out.append(f"{f} {loc} = {v}")
                break
        if len(out) >= limit:
            break
    return out


def main(argv: list[str]) -> int:
    reg = Registry()
    files = [Path(a).resolve() for a in argv] or prose_files()
    values = list(recorded_values())
    bad = 0
    for path in files:
        for problem in check_file(path, reg):
            bad += 1
            print(problem)
            if problem.quote is not None:
                for s in suggest(problem.quote, values):
                    print(f"      held by? {s}")
    print(f"{bad} problem(s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
