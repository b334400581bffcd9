"""What every chat front end shares (chapter 12): the conversation kept inside the context, the
per-turn figures, the "still reading your message" line. engine/chat/local.py answers the turns on
an engine.LLM in this process, engine/chat/remote.py on an OpenAI-compatible server.
"""
from __future__ import annotations

import time
from dataclasses import dataclass


class MessageTooLong(ValueError):
    """The new message cannot fit the context even with every earlier turn dropped."""


class TurnCancelled(Exception):
    """Ctrl-C before the first token of the answer (while the message was tokenized, sent or
    prefilled): the turn is dropped and the conversation is as it was before it."""


@dataclass
class TurnStats:
    prompt_tokens: int          # tokens of the rendered conversation
    reused_tokens: int          # of which the cache already held (not computed again)
    prefill_seconds: float      # submit -> first token
    decode_tokens: int          # tokens after the first
    decode_seconds: float       # first token -> last token
    finish_reason: str

    def line(self) -> str:
        computed = self.prompt_tokens - self.reused_tokens
        prefill = (f"prefill {computed} tokens ({self.reused_tokens} reused) in {self.prefill_seconds:.2f} s, "
                   f"{computed / max(self.prefill_seconds, 1e-9):.0f} tok/s") if self.prompt_tokens else \
            f"first token after {self.prefill_seconds:.2f} s"       # a server does not say how many
        decode = (f"decode {self.decode_tokens} tokens in {self.decode_seconds:.2f} s, "
                  f"{self.decode_tokens / max(self.decode_seconds, 1e-9):.1f} tok/s")
        return f"({prefill}; {decode})"


class Prefilling:
    """The 'still reading your message' line while the first token is awaited (TTY only). Once
    cleared it stays silent: a heartbeat between two slow tokens must not redraw over the answer."""

    def __init__(self, out, prompt_tokens: int, tokens_per_second: float | None):
        self.out, self.prompt_tokens, self.rate = out, prompt_tokens, tokens_per_second
        self.t0, self.shown, self.done = time.monotonic(), False, False

    def tick(self) -> None:
        if self.done:
            return
        elapsed = time.monotonic() - self.t0
        if elapsed < 1.0 or not getattr(self.out, "isatty", lambda: False)():
            return
        eta = f", ~{min(99, 100 * elapsed * self.rate / self.prompt_tokens):.0f}%" if self.rate else ""
        self.out.write(f"\r(reading {self.prompt_tokens} prompt tokens: {elapsed:.0f} s{eta})")
        self.out.flush()
        self.shown = True

    def clear(self) -> None:
        """Erase the line (if drawn) for good: the first token has arrived or the turn ended."""
        self.done = True
        if self.shown:
            self.out.write("\r" + " " * 60 + "\r")
            self.out.flush()
            self.shown = False


class Conversation:
    """The messages of one chat and the rule that keeps them inside the context."""

    def __init__(self, system: str | None):
        self.system = system
        self.messages: list[dict] = []      # user/assistant turns, oldest first

    def render(self, text: str, history: list[dict]) -> list[dict]:
        return ([{"role": "system", "content": self.system}] if self.system else []) + history + \
            [{"role": "user", "content": text}]

    def fit(self, text: str, count_tokens, budget: int) -> tuple[list[dict], int]:
        """(messages to send, turns dropped): the newest history whose rendering fits `budget` tokens."""
        history = list(self.messages)
        while count_tokens(self.render(text, history)) > budget:
            if not history:
                raise MessageTooLong(f"this message does not fit the context ({budget} tokens for the "
                                     f"conversation{', system prompt included' if self.system else ''}): not sent")
            history = history[2:]           # one user + assistant pair
        dropped = (len(self.messages) - len(history)) // 2
        self.messages = history
        return self.render(text, history), dropped

    def add(self, text: str, reply: str) -> None:
        self.messages += [{"role": "user", "content": text}, {"role": "assistant", "content": reply}]


class ConversationFrontEnd:
    """What the interactive loop reads and sets on a chat, local or remote: its system prompt, its
    messages, reset. Subclasses hold `self.conversation` and answer the turns."""

    conversation: Conversation

    @property
    def system(self) -> str | None:
        return self.conversation.system

    @system.setter
    def system(self, text: str | None) -> None:
        self.conversation.system = text

    @property
    def messages(self) -> list[dict]:
        return self.conversation.messages

    def reset(self) -> None:
        self.conversation.messages = []
