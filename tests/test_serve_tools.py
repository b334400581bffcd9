"""engine/serve/tools.py: tool plans from tools + tool_choice, the constraint of a forced choice, and
the calls found in a free answer (Hermes/Qwen tags, a Llama 3 JSON object)."""
import json

import pytest

pytest.importorskip("pydantic")     # engine.serve's protocol ([serve] extra)

from engine.serve.protocol import ProtocolError  # noqa: E402
from engine.serve.tools import parse_calls, plan_tools, template_messages  # noqa: E402

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def test_each_tool_choice_gives_its_plan():
    assert plan_tools(None, None).mode == "none" and plan_tools([WEATHER], "none").template_tools() is None
    auto = plan_tools([WEATHER, TIME], None)
    assert auto.mode == "auto" and auto.constraint is None and auto.template_tools() == [WEATHER, TIME]
    named = plan_tools([WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}})
    assert named.constraint == ("json_schema", WEATHER["function"]["parameters"])
    assert named.calls('{"city": "Oslo"}') == [{"name": "get_weather", "arguments": '{"city": "Oslo"}'}]
    required = plan_tools([WEATHER, TIME], "required")
    kind, schema = required.constraint
    assert kind == "json_schema" and [s["properties"]["name"] for s in schema["anyOf"]] == \
        [{"const": "get_weather"}, {"const": "get_time"}]
    assert required.calls('{"name": "get_time", "arguments": {}}') == [{"name": "get_time", "arguments": "{}"}]


@pytest.mark.parametrize("tools, choice, param", [
    (None, "required", "tool_choice"),
    ([{"type": "code"}], None, "tools[0]"),
    ([{"type": "function", "function": {"name": "bad name"}}], None, "tools[0].function.name"),
    ([WEATHER, WEATHER], None, "tools"),
    ([WEATHER], {"type": "function", "function": {"name": "other"}}, "tool_choice"),
    ([WEATHER], "sometimes", "tool_choice"),
    ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], None, "tools[0].function.parameters"),
])
def test_bad_tools_are_refused_naming_the_field(tools, choice, param):
    with pytest.raises(ProtocolError) as info:
        plan_tools(tools, choice)
    assert info.value.param == param


def test_calls_in_a_free_answer():
    names = {"get_weather", "get_time"}
    assert parse_calls('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', names) == \
        [{"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}]
    assert parse_calls('{"name": "get_time", "parameters": {}}', names) == [{"name": "get_time", "arguments": "{}"}]
    two = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call><tool_call>{"name": "get_weather", ' \
          '"arguments": {"city": "Rome"}}</tool_call>'
    assert [c["name"] for c in parse_calls(two, names)] == ["get_time", "get_weather"]
    for text in ("It is sunny.", '{"name": "unknown", "arguments": {}}', '{"name": "get_time"}', "{not json"):
        assert parse_calls(text, names) is None


def test_a_tool_turn_is_given_to_the_template_with_object_arguments_and_the_tools_name():
    messages = template_messages([
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "content": "12 C", "tool_call_id": "call_1"}])
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert messages[2]["name"] == "get_weather"
