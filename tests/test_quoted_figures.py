"""Every GPU figure that the README, the notes and the chapters quote is a recorded measurement.

How a figure is marked and where its value comes from: tests/helpers/quoted_figures.py (the module
docstring) and notes/measurements/figures.json. `python -m tests.helpers.quoted_figures FILE` lists the
unmarked or wrong figures of a file with the recorded values that would hold each.
"""
import json
import shutil

import pytest
from helpers.quoted_figures import (
    _UNITS,
    REGISTRY,
    ROOT,
    FigureError,
    Registry,
    check_file,
    check_lines,
    find_quotes,
    prose_files,
)


@pytest.fixture(scope="module")
def registry():
    return Registry()


def test_every_figure_resolves_to_one_recorded_value(registry):
    """Each entry of figures.json reads a file that exists, matches the rows it names (one, or at
    least one for a range) and has a known unit."""
    assert registry.spec, "figures.json holds no figures"
    broken = []
    for name in registry.spec:
        try:
            lo, hi = registry.value(name)
            assert lo <= hi
            if registry.unit(name) not in _UNITS:
                broken.append(f"{name}: unit {registry.unit(name)!r} is not one the prose can quote")
        except FigureError as exc:
            broken.append(str(exc))
    assert not broken, "\n".join(broken)


@pytest.mark.parametrize("path", prose_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_quoted_gpu_figures_are_recorded(path, registry):
    problems = check_file(path, registry)
    assert not problems, (f"{len(problems)} GPU figure(s) in {path.relative_to(ROOT)} not held by the recorded "
                          f"measurements (mark each as tests/helpers/quoted_figures.py says):\n  "
                          + "\n  ".join(problems))


# --- the check itself: it fails where it must ---------------------------------------------------

README_LINE = "| 770 tok/s through `LLM` (async scheduling; 46% of the ~1,700 tok/s floor) <!--fig " \
              "decode.b1.llm_tok_s decode.b1.llm_pct_of_floor decode.b1.floor_tok_s--> |"


def _check(line, registry):
    return check_lines([("planted.md:1", line)], registry)


def test_a_held_sentence_passes(registry):
    assert _check(README_LINE, registry) == []


@pytest.mark.parametrize("wrong, right", [("770 tok/s", "790 tok/s"),     # a wrong number
                                          ("46%", "52%"),                 # a wrong share of the floor
                                          ("~1,700 tok/s", "~1,800 tok/s")])
def test_a_planted_wrong_number_fails(registry, wrong, right):
    problems = _check(README_LINE.replace(wrong, right), registry)
    assert len(problems) == 1 and "does not round to" in problems[0], problems


def test_the_readme_with_a_planted_wrong_number_fails(registry):
    text = (ROOT / "README.md").read_text()
    assert "34,277 tok/s" in text
    problems = check_file(ROOT / "README.md", registry, text.replace("34,277 tok/s", "36,277 tok/s"))
    assert len(problems) == 1 and "serve.continuous_paged.tok_s" in problems[0], problems


def test_an_unmarked_gpu_figure_fails(registry):
    problems = _check("the kernel runs at 3,100 GB/s and 12.5 µs a launch", registry)
    assert [p.quote.text for p in problems] == ["3,100 GB/s", "12.5 µs"]
    assert all("unmarked GPU figure" in p for p in problems)


def test_a_figure_the_registry_does_not_have_fails(registry):
    problems = _check("it decodes at 770 tok/s<!--fig decode.b1.made_up-->", registry)
    assert len(problems) == 1 and "no figure named 'decode.b1.made_up'" in problems[0]


def test_a_marker_must_name_every_figure_before_it(registry):
    problems = _check("770 tok/s and 46% of the floor<!--fig decode.b1.llm_tok_s-->", registry)
    assert len(problems) == 1 and "names 1 figure(s) for the 2" in problems[0]


def test_nofig_needs_a_reason(registry):
    assert _check("28 ms per token on 2 cores<!--nofig CPU run-->", registry) == []
    problems = _check("28 ms per token on 2 cores<!--nofig-->", registry)
    assert len(problems) == 1 and "needs a reason" in problems[0]


def test_the_figure_is_checked_when_its_source_changes(tmp_path):
    """Re-recording the measurement file under a sentence makes that sentence fail."""
    spec = json.loads(REGISTRY.read_text())["figures"]["decode.b1.llm_tok_s"]
    src = ROOT / spec["source"]
    copy = tmp_path / spec["source"]
    copy.parent.mkdir(parents=True)
    shutil.copy(src, copy)
    reg = Registry(REGISTRY, root=tmp_path)
    line = "770 tok/s through `LLM`<!--fig decode.b1.llm_tok_s-->"
    assert check_lines([("x.md:1", line)], reg) == []
    rows = [json.loads(x) for x in copy.read_text().splitlines() if x.startswith("{")]
    for r in rows:
        if r.get("scenario") == "decode":
            r[spec["key"]] = 700.0
    copy.write_text("".join(json.dumps(r) + "\n" for r in rows))
    problems = check_lines([("x.md:1", line)], Registry(REGISTRY, root=tmp_path))
    assert len(problems) == 1 and "700" in problems[0], problems
    copy.unlink()
    problems = check_lines([("x.md:1", line)], Registry(REGISTRY, root=tmp_path))
    assert len(problems) == 1 and "is missing" in problems[0], problems


# --- the precision the text writes --------------------------------------------------------------

@pytest.mark.parametrize("text, holds", [
    ("~790 TFLOP/s", True),      # 791.7: written to the ten
    ("792 TFLOP/s", True),
    ("700 TFLOP/s", False),      # 700 = 650..750 ("7" and two zeros of rounding)
    ("807 TFLOP/s", False),
    ("800 TFLOP/s", True),       # 750..850: what "800" says
    ("791.7 TFLOP/s", True),
    ("791.8 TFLOP/s", False),
    ("0.79 TFLOP/s", False),
])
def test_rounding_follows_the_written_digits(registry, text, holds):
    problems = _check(f"bf16 GEMM {text}<!--fig h200.gemm_tflops-->", registry)
    assert (problems == []) is holds, problems


def test_units_convert_and_ranges_match_ranges(registry):
    assert _check("copy bandwidth 4.2 TB/s<!--fig h200.copy_gbps-->", registry) == []
    assert _check("copy bandwidth 4,205 GB/s<!--fig h200.copy_gbps-->", registry) == []
    assert "does not round" in _check("copy bandwidth 4.1 TB/s<!--fig h200.copy_gbps-->", registry)[0]
    assert _check("copy bandwidth 4.1–4.2 TB/s<!--fig readme.copy_gbps_range-->", registry) == []
    assert "is a range" in _check("copy bandwidth 4.2 TB/s<!--fig readme.copy_gbps_range-->", registry)[0]
    assert "one number" in _check("copy bandwidth 4.1–4.2 TB/s<!--fig h200.copy_gbps-->", registry)[0]
    assert "quoted as" in _check("a 4.2 ms step<!--fig h200.copy_gbps-->", registry)[0]


def test_what_counts_as_a_gpu_figure():
    def found(line):
        return [q.text for _, q, _ in find_quotes(line) if q is not None and not q.weak]
    assert found("a 6 × 4 table and 75 % of the parameters") == []           # arithmetic, no run
    assert found("43 % of copy and 0.75× transformers' time") == ["43 %", "0.75×"]
    assert found("26,163 / 27,777 tok/s") == ["26,163 tok/s", "27,777 tok/s"]
    assert found("1 796 GB/s achieved, in 17.4 ms") == ["1 796 GB/s", "17.4 ms"]
    assert found("about 93 MB, 2 × 16 × 8") == []


def test_a_marker_covers_its_paragraph_only(registry):
    wrapped = [("x.md:1", "the engine decodes at"), ("x.md:2", "770 tok/s through `LLM`<!--fig decode.b1.llm_tok_s-->")]
    assert check_lines(wrapped, registry) == []
    split = [("x.md:1", "the engine decodes at 770 tok/s"), ("x.md:2", ""),
             ("x.md:3", "and more<!--fig decode.b1.llm_tok_s-->")]
    problems = check_lines(split, registry)
    assert any("unmarked GPU figure '770 tok/s'" in p for p in problems), problems
    cells = [("nb#cell1:1", "770 tok/s"), ("nb#cell2:1", "<!--fig decode.b1.llm_tok_s-->")]
    assert any("unmarked" in p for p in check_lines(cells, registry))


def test_a_marker_in_inline_code_is_an_example(registry):
    assert check_lines([("x.md:1", "mark it with `<!--fig NAME-->` after the number")], registry) == []
    line = "run at 792 TFLOP/s in `python -m engine.bench`<!--fig h200.gemm_tflops-->"
    assert check_lines([("x.md:1", line)], registry) == []


def test_a_marker_may_name_a_percent_the_scanner_only_suspects(registry):
    """A % with no word of a measurement on its line is not flagged, but a marker after it covers it."""
    assert check_lines([("x.md:1", "that is 46% of it")], registry) == []
    assert check_lines([("x.md:1", "that is 46%<!--fig decode.b1.llm_pct_of_floor-->")], registry) == []
    problems = check_lines([("x.md:1", "that is 52%<!--fig decode.b1.llm_pct_of_floor-->")], registry)
    assert len(problems) == 1 and "does not round to" in problems[0]
