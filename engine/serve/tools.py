"""Tool calling for /v1/chat/completions (OpenAI's `tools` and `tool_choice`).

    tool_choice   what the model may do                     how the engine makes it so
    "none"        answer in text                            the tools are not shown to it
    "auto"        answer, or call tools in its own format   the chat template shows the tools; the answer
                                                            is parsed for calls (see parse_calls)
    "required"    call one of the tools                     the output is constrained to the JSON object
                                                            {"name": one of them, "arguments": its schema}
    a function    call that function                        the output is constrained to its parameters'
                                                            schema: the output is the arguments

A forced choice ("required" or a named function) works with any chat model, one whose template knows
nothing of tools included: the constraint makes the output a valid call whatever the model would have
said, and a template that ignores `tools` gets them described in a system message instead. "auto"
depends on the model: it calls a tool only if its template and training know how.

Calls come back as the message's `tool_calls` (finish_reason "tool_calls"), each with an id; the next
turn's messages carry them (an assistant message with tool_calls, then "tool" messages with
tool_call_id and the result), which the chat template renders.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from engine.serve.protocol import ProtocolError

MAX_TOOLS = 128
NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")     # OpenAI's function names
TAGGED_CALL_RE = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)     # Hermes / Qwen


@dataclass
class ToolPlan:
    mode: str                       # "none" | "auto" | "required" | "named"
    tools: list[dict]               # [{"type": "function", "function": {name, description, parameters}}]
    named: str | None = None

    @property
    def constraint(self) -> tuple | None:
        """SamplingParams.structured for a forced choice."""
        if self.mode == "named":
            return ("json_schema", self._parameters(self.named))
        if self.mode == "required":
            return ("json_schema", {"anyOf": [
                {"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                  "arguments": self._parameters(t["function"]["name"])},
                 "required": ["name", "arguments"]} for t in self.tools]})
        return None

    def _parameters(self, name: str | None) -> dict:
        fn = next(t["function"] for t in self.tools if t["function"]["name"] == name)
        return fn.get("parameters") or {"type": "object", "properties": {}}

    def template_tools(self) -> list[dict] | None:
        return None if self.mode == "none" or not self.tools else self.tools

    def calls(self, text: str) -> list[dict] | None:
        """The tool calls an answer makes ([{"name", "arguments": a JSON string}]), or None for text."""
        if self.mode == "named":
            return [{"name": self.named, "arguments": text}]
        if self.mode == "required":
            call = json.loads(text)
            return [{"name": call["name"], "arguments": json.dumps(call["arguments"])}]
        if self.mode == "auto":
            return parse_calls(text, {t["function"]["name"] for t in self.tools})
        return None


def plan_tools(tools, tool_choice) -> ToolPlan:
    """The request's tools and tool_choice, checked (ProtocolError names the field)."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise ProtocolError("tool_choice needs tools", "tool_choice")
        return ToolPlan("none", [])
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise ProtocolError(f"tools must be a list of at most {MAX_TOOLS} functions", "tools")
    names = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise ProtocolError('each tool must be {"type": "function", "function": {...}}', f"tools[{i}]")
        if not isinstance(fn.get("name"), str) or not NAME_RE.match(fn["name"]):
            raise ProtocolError("a function name is 1-64 letters, digits, _ . or -", f"tools[{i}].function.name")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise ProtocolError("parameters must be a JSON schema object", f"tools[{i}].function.parameters")
        names.append(fn["name"])
    if len(set(names)) != len(names):
        raise ProtocolError("two tools have the same name", "tools")
    if tool_choice in (None, "auto"):
        return ToolPlan("auto", tools)
    if tool_choice in ("none", "required"):
        return ToolPlan(tool_choice, tools)
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" or not isinstance(fn, dict):
        raise ProtocolError('tool_choice must be "none", "auto", "required" or {"type": "function", '
                            '"function": {"name": ...}}', "tool_choice")
    if fn.get("name") not in names:
        raise ProtocolError(f"tool_choice names {fn.get('name')!r}, which is not among the tools", "tool_choice")
    return ToolPlan("named", tools, fn["name"])


def describe_tools(tools: list[dict]) -> str:
    """A system message for a template that ignores `tools`."""
    return ("You can call these functions. To call one, answer with a JSON object "
            '{"name": ..., "arguments": {...}} and nothing else.\n' + "\n".join(json.dumps(t["function"]) for t in tools))


def parse_calls(text: str, names: set[str]) -> list[dict] | None:
    """Tool calls in a free answer: <tool_call>{...}</tool_call> blocks (Hermes, Qwen), or an answer
    that is one JSON object {"name": a tool, "arguments" or "parameters": {...}} (Llama 3)."""
    blocks = TAGGED_CALL_RE.findall(text)
    candidates = blocks if blocks else [text.strip().removeprefix("<|python_tag|>").strip()]
    calls = []
    for raw in candidates:
        try:
            call = json.loads(raw)
        except ValueError:
            return None
        args = call.get("arguments", call.get("parameters")) if isinstance(call, dict) else None
        if not isinstance(call, dict) or call.get("name") not in names or not isinstance(args, (dict, str)):
            return None
        calls.append({"name": call["name"], "arguments": args if isinstance(args, str) else json.dumps(args)})
    return calls or None


def tool_call_objects(calls: list[dict]) -> list[dict]:
    """OpenAI's message.tool_calls: each call with an id."""
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls]


def template_messages(messages: list[dict]) -> list[dict]:
    """Messages as chat templates expect tool turns: an assistant's tool_calls with arguments as objects
    (OpenAI sends a JSON string), a tool result with its tool_call_id (and name, when known)."""
    names = {}
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                fn = dict(c.get("function") or {})
                try:
                    args = json.loads(fn.get("arguments") or "{}")
                except (TypeError, ValueError):
                    args = fn.get("arguments")
                fn["arguments"] = args
                names[c.get("id")] = fn.get("name")
                calls.append({**c, "function": fn})
            m["tool_calls"] = calls
        if m.get("role") == "tool" and m.get("tool_call_id") in names and not m.get("name"):
            m["name"] = names[m["tool_call_id"]]
        out.append(m)
    return out
