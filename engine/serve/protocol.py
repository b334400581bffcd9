"""The OpenAI HTTP API's request and response shapes, as far as this engine serves them (chapter 12).

Requests are pydantic models: a wrong type becomes a 400 with an OpenAI error object naming the
field. Fields that clients send but this engine does not act on (user, logit_bias=None, ...) are
accepted and ignored, as vLLM does; fields whose value would change the answer in a way the engine
cannot honour (n > 1, logprobs, tools) are refused with a 400 rather than silently dropped.

Responses are plain dicts built by the helpers at the bottom, one per object type:
"chat.completion", "chat.completion.chunk", "text_completion", "model", "list".
"""
from __future__ import annotations

import time
import uuid
from typing import cast

from pydantic import BaseModel, ConfigDict, Field

from engine.runtime.sampling_params import SamplingParams

DEFAULT_MAX_TOKENS = 256


class ProtocolError(ValueError):
    """A request the server understands but cannot serve; becomes a 400 naming `param`."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict] | None = None


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingRequest(BaseModel):
    """Fields shared by both endpoints. temperature defaults to 1.0, as in OpenAI's API."""
    model_config = ConfigDict(extra="allow")
    model: str
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                 # not in OpenAI's API; vLLM and others accept it
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    logprobs: bool | int | None = None
    ignore_eos: bool = False       # benchmarks: keep going past eos

    def check_supported(self) -> None:
        if self.n != 1:
            raise ProtocolError("only n=1 is supported", "n")
        if self.logprobs:
            raise ProtocolError("logprobs are not supported", "logprobs")

    def sampling_params(self, max_tokens_field: str = "max_tokens") -> SamplingParams:
        """ValueError (a 400) on invalid values: SamplingParams validates them all."""
        max_tokens = DEFAULT_MAX_TOKENS if self.max_tokens is None else self.max_tokens
        stop = [] if self.stop is None else self.stop
        try:
            return SamplingParams(max_new_tokens=max_tokens, temperature=self.temperature, top_k=self.top_k,
                                  top_p=self.top_p, seed=self.seed, ignore_eos=self.ignore_eos,
                                  stop=stop)  # type: ignore[arg-type]  # SamplingParams takes a str or list and stores a tuple
        except ValueError as exc:
            message = str(exc)
            param = next((f for f in ("max_new_tokens", "temperature", "top_k", "top_p", "seed", "stop")
                          if message.startswith(f)), None)
            raise ProtocolError(message.replace("max_new_tokens", max_tokens_field),
                                "max_tokens" if param == "max_new_tokens" else param) from None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None    # the newer name of max_tokens
    tools: list | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.tools:
            raise ProtocolError("tools are not supported", "tools")
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens

    def plain_messages(self) -> list[dict]:
        """Messages as the chat template expects them: text content (OpenAI's content parts joined)."""
        out = []
        for i, m in enumerate(self.messages):
            content = m.content
            if isinstance(content, list):
                if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                    raise ProtocolError("only text content parts are supported", f"messages[{i}].content")
                content = "".join(str(p.get("text", "")) for p in content)
            out.append({"role": m.role, "content": content or ""})
        return out


class CompletionRequest(SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise ProtocolError("echo is not supported", "echo")
        if self.suffix:
            raise ProtocolError("suffix is not supported", "suffix")

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


def chat_completion(rid: str, model: str, text: str, finish_reason: str, use: dict) -> dict:
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "finish_reason": finish_reason, "logprobs": None}],
            "usage": use}


def chat_chunk(rid: str, model: str, created: int, delta: dict, finish_reason: str | None = None,
               use: dict | None = None) -> dict:
    choices = [] if use is not None and not delta else \
        [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}]
    chunk = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": choices}
    if use is not None:
        chunk["usage"] = use
    return chunk


def text_completion(rid: str, model: str, created: int, text: str, finish_reason: str | None,
                    use: dict | None = None, with_choice: bool = True) -> dict:
    choices = [{"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}] if with_choice else []
    body = {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices}
    if use is not None:
        body["usage"] = use
    return body

