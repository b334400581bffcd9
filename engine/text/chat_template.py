"""Chat templates: turn a list of messages into the exact prompt text a chat model was trained on.

A chat model never sees "messages"; it sees one string with special tokens marking who speaks:

    <|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n          (SmolLM2, ChatML)
    <|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?<|eot_id|>...     (Llama 3)

The model ships that format as a Jinja template (tokenizer_config.json "chat_template"). We render it
the way transformers does, so the text is byte-identical: a sandboxed, immutable Jinja environment,
trim_blocks + lstrip_blocks, the loopcontrols extension, and the helpers templates call:
raise_exception, strftime_now, a tojson that does not HTML-escape, dict() and namespace(). Variables:
messages, tools, documents, add_generation_prompt, the special tokens (bos_token, eos_token, ...) and
whatever the caller adds (e.g. date_string for Llama 3).

A template is untrusted code from the internet, so it runs with bounded time, memory and output
(engine/text/template_sandbox.py); whatever goes wrong, from a syntax error to a template that would loop
for an hour, ends in a ChatTemplateError within about a second. Compiling is bounded the same way: a
size limit, then limits on Jinja tokens and nesting checked before the costly steps run, so the worst
template that compiles takes well under a second, and a larger one is refused in a fraction of that.
The tokenizer compiles a model directory's template when it loads (check_template), so a bad template
is found then, not at the first request; its error is raised again by every render.
"""
from __future__ import annotations

import functools
import json
from datetime import datetime

import jinja2
import jinja2.ext

from engine.text.template_sandbox import (
    BudgetedEnvironment,
    RenderBudget,
    TemplateBudgetError,
    active_budget,
    budget_scope,
    check_percent_format,
    weight,
)

__all__ = ["ChatTemplateError", "render_chat_template", "validate_messages", "check_template", "ROLES"]

ROLES = ("system", "user", "assistant", "tool", "ipython")
RENDER_SECONDS = 0.5                 # template execution; real templates take a few ms
# Real templates are 1-20 kB (Llama 3.1's is 5 kB, Qwen3's 4 kB); 256 KiB is ten times the largest, and
# a first, free bound on compiling (the token limit in template_sandbox.py is the one that bounds its cost)
MAX_TEMPLATE_CHARS = 256 << 10
BASE_SIZE_LIMIT = 1 << 20            # any value or the output: 1 MiB + 4x the conversation's size


class ChatTemplateError(ValueError):
    """Bad messages, a template that does not compile, or a template that refused the conversation."""


def validate_messages(messages) -> list[dict]:
    """Check a conversation; returns copies of the messages without None-valued keys (as transformers does).

    Each message is a dict with a known role and a string content; an assistant message that only
    carries tool_calls may leave content out.
    """
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ChatTemplateError(f"messages must be a non-empty list of dicts, got {type(messages).__name__}")
    cleaned = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ChatTemplateError(f"message {i} must be a dict with 'role' and 'content', "
                                    f"got {type(message).__name__}")
        message = {k: v for k, v in message.items() if v is not None}
        role = message.get("role")
        if role not in ROLES:
            raise ChatTemplateError(f"message {i} has role {role!r}; known roles: {', '.join(ROLES)}")
        content = message.get("content")
        if content is None and not (role == "assistant" and message.get("tool_calls")):
            raise ChatTemplateError(f"message {i} ({role}) has no 'content'")
        if content is not None and not isinstance(content, str):
            raise ChatTemplateError(f"message {i} ({role}) content must be a str, got {type(content).__name__}")
        cleaned.append(message)
    return cleaned


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson escapes <, >, & and ' for HTML; chat templates need the plain JSON text
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    fmt = str(fmt)
    check_percent_format(active_budget(), fmt, ())   # '%10000000Y' pads like printf
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """dict() for templates, without exposing the dict type itself to attribute tricks."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """namespace() that refuses underscore names, so templates cannot reach Python internals."""

    def __init__(*args, **kwargs):  # same signature trick as jinja2.utils.Namespace
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore attributes ({name!r})")


def compile_template(source: str) -> jinja2.Template:
    """Compile once per template string (the chat loop renders the same template every turn)."""
    compiled = _compiled_or_error(source)
    if isinstance(compiled, ChatTemplateError):
        raise ChatTemplateError(*compiled.args)
    return compiled


def check_template(source: str) -> ChatTemplateError | None:
    """Compile now (when a tokenizer loads its model's template); the refusal is returned, not raised,
    and every later render of this template raises it."""
    compiled = _compiled_or_error(source)
    return compiled if isinstance(compiled, ChatTemplateError) else None


def _compiled_or_error(source: str) -> jinja2.Template | ChatTemplateError:
    if not isinstance(source, str):
        return ChatTemplateError(f"chat template must be a string, got {type(source).__name__}")
    if len(source) > MAX_TEMPLATE_CHARS:   # checked before the cache, which would keep the string
        return ChatTemplateError(f"chat template is {len(source):,} characters; "
                                 f"the limit is {MAX_TEMPLATE_CHARS:,}")
    return _compile(source)


@functools.lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template | ChatTemplateError:
    """The compiled template, or the error refusing it (kept too: a refused template is not compiled again)."""
    env = BudgetedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.add_filter("tojson", _tojson)
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now,
                       dict=_TemplateDict(), namespace=_Namespace)
    try:
        return env.from_string(env.parse_checked(source))
    except TemplateBudgetError as e:   # past a compile limit: refused before the costly steps
        return ChatTemplateError(str(e))   # "chat template has more than ... (the limit; line N)"
    except jinja2.exceptions.TemplateSyntaxError as e:
        return ChatTemplateError(f"chat template does not compile (line {e.lineno}): {e.message}")
    except (RecursionError, MemoryError) as e:   # (((((...))))) nested past what the parser can hold
        return ChatTemplateError(f"chat template does not compile: {type(e).__name__}")
    except SyntaxError as e:   # Python refused the generated code (nesting past its own limits)
        return ChatTemplateError(f"chat template does not compile: the generated code is nested too deep ({e.msg})")
    except Exception as e:     # the template is untrusted input: any other failure of Jinja is a refusal too
        return ChatTemplateError(f"chat template does not compile: {type(e).__name__}: {e}")


def render_chat_template(template: str, messages, add_generation_prompt: bool = True, tools=None, documents=None,
                         **template_kwargs) -> str:
    """messages -> prompt text. template_kwargs reach the template as variables (bos_token, date_string, ...)."""
    messages = validate_messages(messages)
    compiled = compile_template(template)
    inputs = (messages, tools, documents, template_kwargs)
    budget = RenderBudget(BASE_SIZE_LIMIT + 4 * weight(inputs), RENDER_SECONDS)
    pieces = []
    try:
        with budget_scope(budget):
            for piece in compiled.generate(messages=messages, tools=tools, documents=documents,
                                           add_generation_prompt=add_generation_prompt, **template_kwargs):
                pieces.append(piece)
                budget.tick()
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(f"chat template refused the conversation: {e}") from None
    except (RecursionError, MemoryError) as e:
        raise ChatTemplateError(f"chat template failed: {type(e).__name__} (runaway recursion or size)") from None
    except Exception as e:   # a template is code: TypeError, ZeroDivisionError, OverflowError, ...
        raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from None
    return "".join(pieces)
