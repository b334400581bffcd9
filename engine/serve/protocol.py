"""The OpenAI HTTP API's request and response shapes, as far as this engine serves them (chapter 12).

Requests are pydantic models, strict in the JSON sense: a JSON string is never a number or a bool
("2", "yes"), a float is never an integer (1.0 for max_tokens or a token id is refused), a bool is never
a number (max_tokens: true); an integer is a valid number (temperature: 1 is 1.0). A wrong type becomes
a 400 with an OpenAI error object naming the field. Integers are bounded where the engine stores them
in fixed width: seed in [0, 2**63), top_k up to 2**31 - 1, token ids in [0, 2**31); max_tokens is
bounded by the server's own limit. null means the default for temperature, top_p, n, stream, top_k.

Known fields that would change the answer in a way the engine cannot honour are refused with a 400
naming the field (ProtocolError from check_supported) instead of being silently dropped. Each is
accepted only with the value that leaves the answer unchanged:

    both endpoints   n (1 .. MAX_N), best_of (null or n: no ranking by log-probability),
                     prompt_logprobs (null), guided_grammar (null)
    chat             functions (null or []) and function_call (null or "none"): the older form of
                     tools and tool_choice, which are served (engine/serve/tools.py)
    completions      echo (false), suffix (null or "")

Structured outputs (engine/structured/, the tokens each step may take masked by an automaton):
response_format {"type": "json_object"} or {"type": "json_schema", "json_schema": {"schema": ...}},
or vLLM's guided_json (a schema), guided_regex, guided_choice; one of them per request.

Served sampling fields (SamplingParams checks their values): presence_penalty and frequency_penalty
(OpenAI's, over the output), repetition_penalty and min_p (vLLM's), logit_bias ({"token id": bias},
bias in [-100, 100]); engine/ops/logits_processing.py says what each does to the logits.

Known fields with no effect on the answer are accepted and ignored: user, metadata, store,
parallel_tool_calls, service_tier, stream_options.continuous_usage_stats (stream_options.include_usage
is honoured). Unknown fields are accepted and ignored too (clients send vendor
extras), as vLLM does. The "developer" role is OpenAI's newer name for "system" and is rendered as one.

Responses are plain dicts built by the helpers at the bottom, one per object type:
"chat.completion", "chat.completion.chunk", "text_completion", "model", "list".
"""
from __future__ import annotations

import dataclasses
import json
import time
import uuid
from collections.abc import Callable
from typing import Annotated, Any, cast

from pydantic import BaseModel, ConfigDict, Field, ValidationError, WrapValidator, field_validator, model_validator
from pydantic_core import PydanticCustomError

from engine.runtime.sampling_params import MAX_LOGPROBS, SamplingParams

DEFAULT_MAX_TOKENS = 256
TOKEN_ID_LIMIT = 2**31          # token ids: int32 range
SEED_LIMIT = 2**63
TOP_K_MAX = 2**31 - 1
MAX_N = 16                      # choices per request (each is a request of its own in the engine)

# extra="allow": unknown fields pass (and are ignored); strict=True: no coercion between JSON types.
# Each model needs it: a nested model validates with its own config, not its parent's.
_STRICT = ConfigDict(extra="allow", strict=True)


def param_name(loc) -> str | None:
    """A validation error's location as the error's `param`: ("messages", 0, "content") ->
    "messages[0].content", the way the protocol's own errors name list items."""
    name = ""
    for part in loc:
        name += f"[{part}]" if isinstance(part, int) else (f".{part}" if name else str(part))
    return name or None


class ProtocolError(ValueError):
    """A request the server understands but cannot serve; becomes a 400 naming `param`."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def _short(value: Any) -> str:
    """A bounded description of an offending JSON value for an error message."""
    text = repr(value) if isinstance(value, (bool, int, float)) or value is None else type(value).__name__
    if isinstance(value, str):
        text = repr(value if len(value) <= 40 else value[:40] + "...")
    return text if len(text) <= 60 else text[:60] + "..."


def _one_of(what: str) -> WrapValidator:
    """A union's errors as one, at the field itself: "must be a string or a list of strings, got 5"
    (pydantic would report each member of the union under its own location)."""
    def check(value: Any, handler: Callable[[Any], Any]) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError("type_error", "must be {what}, got {got}",
                                      {"what": what, "got": _short(value)}) from None
    return WrapValidator(check)


Stop = Annotated[str | list[str] | None, _one_of("a string, a list of strings or null")]
Content = Annotated[str | list[dict] | None, _one_of("a string, a list of content parts (objects) or null")]
Logprobs = Annotated[bool | int | None, _one_of("a bool, an integer or null")]
Seed = Annotated[int, Field(ge=0, lt=SEED_LIMIT)]
TopK = Annotated[int, Field(le=TOP_K_MAX)]      # negatives: SamplingParams says "0 disables it"


def _refusals(checks: list[tuple[str, bool, str]]) -> None:
    """checks: (field, the value leaves the answer unchanged, what the refusal says)."""
    for field, fine, message in checks:
        if not fine:
            raise ProtocolError(message, field)


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: str
    content: Content = None
    tool_calls: list[dict] | None = None      # an assistant's calls (engine/serve/tools.py)
    tool_call_id: str | None = None           # a "tool" message: the call it answers
    name: str | None = None


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False


class SamplingRequest(BaseModel):
    """Fields shared by both endpoints. temperature defaults to 1.0, as in OpenAI's API."""
    model_config = _STRICT
    model: str
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: TopK = 0                # not in OpenAI's API; vLLM and others accept it
    seed: Seed | None = None
    stop: Stop = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False       # benchmarks: keep going past eos
    # refused unless they hold the value that changes nothing (check_supported)
    n: int = 1
    best_of: int | None = None
    logprobs: Logprobs = None
    top_logprobs: int | None = None
    logit_bias: dict | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None     # vLLM's
    min_p: float | None = None                  # vLLM's
    response_format: dict | None = None
    prompt_logprobs: int | None = None          # vLLM's
    guided_json: Any = None                     # vLLM's guided decoding: a schema (string or object)
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items()
                    if not (v is None and k in ("temperature", "top_p", "n", "stream", "top_k", "ignore_eos"))}
        return data

    def check_supported(self) -> None:
        _refusals([
            ("n", 1 <= self.n <= MAX_N, f"n must be in [1, {MAX_N}] (more choices are not supported), got {self.n}"),
            ("best_of", self.best_of in (None, self.n),
             "best_of must equal n (choosing the best of more by log-probability is not supported)"),
            ("prompt_logprobs", self.prompt_logprobs is None, "prompt_logprobs are not supported"),
            ("guided_grammar", self.guided_grammar is None,
             "guided_grammar is not supported (guided_json, guided_regex and guided_choice are)"),
        ])

    def sampling_params(self, max_tokens_field: str = "max_tokens") -> SamplingParams:
        """ValueError (a 400) on invalid values: SamplingParams validates them all."""
        max_tokens = DEFAULT_MAX_TOKENS if self.max_tokens is None else self.max_tokens
        stop = [] if self.stop is None else self.stop
        logprobs = self.wanted_logprobs()     # (ProtocolErrors naming their own fields)
        structured = self.structured_output()
        try:
            return SamplingParams(max_new_tokens=max_tokens, temperature=self.temperature, top_k=self.top_k,
                                  top_p=self.top_p, seed=self.seed, ignore_eos=self.ignore_eos,
                                  stop=stop,  # type: ignore[arg-type]  # SamplingParams takes a str or list, stores a tuple
                                  presence_penalty=self.presence_penalty or 0.0,
                                  frequency_penalty=self.frequency_penalty or 0.0,
                                  repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
                                  min_p=self.min_p or 0.0, logit_bias=tuple(self._logit_bias()),
                                  logprobs=logprobs, structured=structured)
        except ValueError as exc:
            message = str(exc)
            param = next((f for f in ("max_new_tokens", "temperature", "top_k", "top_p", "seed", "stop",
                                      "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p",
                                      "logit_bias") if message.startswith(f)), None)
            raise ProtocolError(message.replace("max_new_tokens", max_tokens_field),
                                "max_tokens" if param == "max_new_tokens" else param) from None

    def wanted_logprobs(self) -> int | None:
        """SamplingParams.logprobs: None, or how many alternatives per token. Completions: `logprobs`
        is that number; chat (below): `logprobs: true` and `top_logprobs`."""
        if self.logprobs is None or self.logprobs is False:
            return None
        if self.logprobs is True:
            raise ProtocolError("logprobs is a number of alternatives (0 .. 20) on /v1/completions", "logprobs")
        if not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ProtocolError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}", "logprobs")
        return self.logprobs

    def _logit_bias(self) -> list[tuple[int, float]]:
        """OpenAI's {"token id as a string": bias} as (id, bias) pairs (SamplingParams checks the values)."""
        pairs = []
        for key, bias in (self.logit_bias or {}).items():
            if not key.isdigit() or len(key) > 10:
                raise ProtocolError(f"logit_bias keys must be token ids, got {_short(key)}", "logit_bias")
            if isinstance(bias, bool) or not isinstance(bias, (int, float)):
                raise ProtocolError(f"logit_bias values must be numbers, got {_short(bias)}", "logit_bias")
            pairs.append((int(key), float(bias)))
        return pairs

    def structured_output(self) -> tuple | None:
        """SamplingParams.structured from `response_format` (OpenAI's json_object and json_schema) or
        vLLM's guided_json / guided_regex / guided_choice: one of them at most."""
        asked = [f for f in ("response_format", "guided_json", "guided_regex", "guided_choice")
                 if getattr(self, f) is not None and not (f == "response_format" and self.response_format == {"type": "text"})]
        if len(asked) > 1:
            raise ProtocolError(f"ask for one structured output at a time, got {' and '.join(asked)}", asked[1])
        if not asked:
            return None
        field, value = asked[0], getattr(self, asked[0])
        if field == "response_format":
            kind = value.get("type")
            if kind == "json_object":
                return ("json_object", None)
            if kind == "json_schema":
                spec = value.get("json_schema")
                schema = spec.get("schema") if isinstance(spec, dict) else None
                if not isinstance(schema, dict):
                    raise ProtocolError("response_format json_schema needs json_schema.schema, an object", field)
                return ("json_schema", schema)
            raise ProtocolError(f"response_format type must be text, json_object or json_schema, got {_short(kind)}",
                                field)
        if field == "guided_json":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError:
                    raise ProtocolError("guided_json must be a JSON schema (an object, or a string holding one)",
                                        field) from None
            if not isinstance(value, dict):
                raise ProtocolError("guided_json must be a JSON schema (an object, or a string holding one)", field)
            return ("json_schema", value)
        if field == "guided_regex":
            if not isinstance(value, str) or not value:
                raise ProtocolError("guided_regex must be a non-empty string", field)
            return ("regex", value)
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise ProtocolError("guided_choice must be a list of non-empty strings", field)
        return ("choice", list(value))

    def choice_params(self, params: SamplingParams) -> list[SamplingParams]:
        """The n choices' params: choice i draws with seed + i (mod 2**63), so that n choices equal n
        separate requests with those seeds; unseeded, each choice gets seeds of its own."""
        if self.n == 1 or params.seed is None:
            return [params] * self.n
        return [dataclasses.replace(params, seed=(params.seed + i) % SEED_LIMIT) for i in range(self.n)]

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None    # the newer name of max_tokens
    tools: list | None = None
    tool_choice: Any = None                     # "none", "auto", "required" or an object
    functions: list | None = None               # tools' older names
    function_call: Any = None

    def check_supported(self) -> None:
        super().check_supported()
        _refusals([
            ("functions", not self.functions, "functions (the API's older form) are not supported: send tools"),
            ("function_call", self.function_call in (None, "none"),
             "function_call (the API's older form) is not supported: send tool_choice"),
        ])
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens

    def wanted_logprobs(self) -> int | None:
        """Chat: `logprobs: true` asks for them, `top_logprobs` (0 .. 20) for alternatives too."""
        if self.logprobs not in (None, True, False):
            raise ProtocolError("logprobs must be true or false on /v1/chat/completions", "logprobs")
        if self.top_logprobs not in (None, 0) and not self.logprobs:
            raise ProtocolError("top_logprobs needs logprobs: true", "top_logprobs")
        if not self.logprobs:
            return None
        top = self.top_logprobs or 0
        if not 0 <= top <= MAX_LOGPROBS:
            raise ProtocolError(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {top}", "top_logprobs")
        return top

    def plain_messages(self) -> list[dict]:
        """Messages as the chat template expects them: text content (OpenAI's content parts joined)."""
        out = []
        for i, m in enumerate(self.messages):
            content = m.content
            if isinstance(content, list):
                if not all(p.get("type") == "text" and isinstance(p.get("text", ""), str) for p in content):
                    raise ProtocolError("only text content parts (with a string text) are supported",
                                        f"messages[{i}].content")
                content = "".join(p.get("text", "") for p in content)
            message: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": content or ""}
            if m.tool_calls:
                message["tool_calls"] = m.tool_calls
            for key in ("tool_call_id", "name"):
                if getattr(m, key) is not None:
                    message[key] = getattr(m, key)
            out.append(message)
        return out


def _prompt_error(message: str) -> PydanticCustomError:
    return PydanticCustomError("prompt_type", "{message}", {"message": message})


def _token_ids(ids: list, where: str) -> list[int]:
    for i, t in enumerate(ids):
        if type(t) is not int or not 0 <= t < TOKEN_ID_LIMIT:    # type(): a bool is not a token id
            raise _prompt_error(f"{where}[{i}] must be a token id (an integer in [0, 2**31)), got {_short(t)}")
    return ids


class CompletionRequest(SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    suffix: str | None = None

    @field_validator("prompt", mode="plain")
    @classmethod
    def _prompt(cls, value: Any) -> str | list[int] | list[str] | list[list[int]]:
        """A string, a list of token ids, a list of strings or a list of lists of token ids (one
        error naming the first bad element, where pydantic would report each shape of the union)."""
        shape = "a string, a list of token ids, a list of strings or a list of lists of token ids"
        if isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise _prompt_error(f"must be {shape}, got {_short(value)}")
        if value and isinstance(value[0], str):
            bad = next((i for i, p in enumerate(value) if not isinstance(p, str)), None)
            if bad is not None:
                raise _prompt_error(f"prompt[{bad}] must be a string (a list of prompts), got {_short(value[bad])}")
            return value
        if value and isinstance(value[0], list):
            for i, p in enumerate(value):
                if not isinstance(p, list):
                    raise _prompt_error(f"prompt[{i}] must be a list of token ids, got {_short(p)}")
                _token_ids(p, f"prompt[{i}]")
            return value
        return _token_ids(value, "prompt")

    def check_supported(self) -> None:
        super().check_supported()
        _refusals([
            ("echo", not self.echo, "echo is not supported"),
            ("suffix", not self.suffix, "suffix is not supported"),
        ])

    def single_prompt(self) -> str | list[int]:
        """One prompt (text or token ids); a batch of prompts in one request is refused."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise ProtocolError("send one prompt per request (a list of prompts is not supported)", "prompt")
            p = p[0]
        if isinstance(p, list) and not p:
            raise ProtocolError("the prompt is empty", "prompt")
        return cast("str | list[int]", p)     # a list of prompts was unwrapped above


# ---- responses -------------------------------------------------------------------------------

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def model_card(name: str, created: int) -> dict:
    return {"id": name, "object": "model", "created": created, "owned_by": "engine"}


def token_text(tokenizer, token: int) -> tuple[str, list[int]]:
    """A token as OpenAI's logprobs show it: its text (a piece of a UTF-8 character shows as U+FFFD)
    and its bytes."""
    raw = tokenizer.token_bytes([token]) if tokenizer is not None else b""
    return raw.decode("utf-8", errors="replace"), list(raw)


def chat_logprobs(tokenizer, token_ids: list[int], entries: list | None) -> dict | None:
    """A chat choice's `logprobs`: {"content": [{token, logprob, bytes, top_logprobs}, ...]}."""
    if entries is None:
        return None
    content = []
    for token, (lp, top) in zip(token_ids, entries, strict=True):
        text, raw = token_text(tokenizer, token)
        alternatives = []
        for alt, alt_lp in top:
            alt_text, alt_raw = token_text(tokenizer, alt)
            alternatives.append({"token": alt_text, "logprob": alt_lp, "bytes": alt_raw})
        content.append({"token": text, "logprob": lp, "bytes": raw, "top_logprobs": alternatives})
    return {"content": content}


def completion_logprobs(tokenizer, token_ids: list[int], entries: list | None, offset: int = 0) -> dict | None:
    """A completion choice's `logprobs`: tokens, token_logprobs, top_logprobs ({text: logprob}),
    text_offset (each token's character offset in the choice's text, from `offset`)."""
    if entries is None:
        return None
    tokens, offsets = [], []
    for token in token_ids:
        offsets.append(offset)
        text = token_text(tokenizer, token)[0]
        tokens.append(text)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": [lp for lp, _ in entries],
            "top_logprobs": [{token_text(tokenizer, t)[0]: v for t, v in top} for _, top in entries],
            "text_offset": offsets}


def chat_completion(rid: str, model: str, answers: list[tuple[dict, str, dict | None]], use: dict) -> dict:
    """answers: (assistant message, finish reason, logprobs or None) of each choice."""
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": i, "message": message, "finish_reason": finish_reason, "logprobs": logprobs}
                        for i, (message, finish_reason, logprobs) in enumerate(answers)],
            "usage": use}


def chat_chunk(rid: str, model: str, created: int, delta: dict, finish_reason: str | None = None,
               use: dict | None = None, index: int = 0, logprobs: dict | None = None) -> dict:
    choices = [] if use is not None and not delta else \
        [{"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}]
    chunk = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": choices}
    if use is not None:
        chunk["usage"] = use
    return chunk


def text_completion(rid: str, model: str, created: int, answers: list[tuple[str, str | None, dict | None]],
                    use: dict | None = None, first_index: int = 0) -> dict:
    """answers: (text, finish reason or None, logprobs or None) of each choice in the body, from first_index on."""
    choices = [{"index": first_index + i, "text": text, "finish_reason": finish_reason, "logprobs": logprobs}
               for i, (text, finish_reason, logprobs) in enumerate(answers)]
    body = {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices}
    if use is not None:
        body["usage"] = use
    return body

