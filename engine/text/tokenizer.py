"""Byte-level BPE from scratch: read a Hugging Face tokenizer.json, encode and decode exactly like it.

The path from text to ids (chapter 02 draws each step on a real sentence):

    text --added tokens--> chunks --pre-tokenizers--> pieces --UTF-8 + byte map--> words --BPE--> ids

1. Added tokens ("<|eot_id|>", "<|im_start|>", ...) are cut out of the raw text first and become one id each;
   a Unicode normalizer (Qwen's NFC), if the file has one, then applies to the text between them.
2. Pre-tokenizers split every other chunk into pieces (a regex Split, Digits, the GPT-2 regex of ByteLevel).
3. Each piece becomes UTF-8 bytes, and every byte one printable character (GPT-2's byte map), so that
   the 256 single-byte tokens cover any input: byte-level BPE never meets an unknown character
   (as long as the vocab kept all 256; see `_initial_ids_with_missing_bytes` for when it did not).
4. BPE starts from those single bytes and merges the adjacent pair with the lowest rank until no
   pair in the merge table is left. Results are cached per piece: English repeats its words a lot.

Decoding maps the characters back to bytes and decodes UTF-8 (invalid bytes become U+FFFD).
Only the components that byte-level BPE models use are implemented; anything else is refused with a
`TokenizerError` rather than approximated.

A tokenizer.json is input like any other file a model directory brings, and may be hostile. Loading
it ends in a `TokenizerError` (a ValueError) in bounded time and memory for anything malformed:
- the path must be a regular file (a FIFO would block the read, a link to /dev/zero never end it)
  of at most MAX_TOKENIZER_BYTES, and is read through one descriptor checked with fstat;
- every field the loader reads is checked for its type before use (`_expect`), so a wrong type
  names the field instead of escaping as TypeError/AttributeError/KeyError;
- the vocabulary must be non-empty, its ids distinct, non-negative and inside the id space
  (no id at or past len(vocab) + len(added_tokens)).

Pre-tokenizer regexes are the one place where a small file can cost unbounded time: a pattern like
`(a|a)+$` backtracks exponentially on a run of "a"s. The guard is a time budget, enforced by the
`regex` engine itself (its `timeout=` argument, checked inside the matching loop, so a match stuck
in backtracking is interrupted, not only the gaps between matches): each finditer over a piece gets
REGEX_BASE_SECONDS plus REGEX_SECONDS_PER_CHAR per character of the piece, and running past it
raises TokenizerError naming the pattern. The budget is counted from the start of a split through
the downstream BPE work it streams into; real text needs well under 1 us a character for all of it,
so the margin is over 20x on a loaded machine.
The engine's clock checks triple the cost of a split, so the patterns known to split in linear time
run without them (`_LINEAR_PATTERNS`: GPT-2's, which SmolLM2 uses after Digits, Llama 3's and
Qwen2's, and the escaped literal of a String split); any other pattern gets the budget. A budget
rather than a static "no nested quantifiers" rule: the ambiguity that backtracks hides in shapes
no short rule lists (overlapping alternatives under a star, as above), and the budget bounds them all.
"""
from __future__ import annotations

import codecs
import functools
import heapq
import json
import threading
import types
import unicodedata
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import regex

from engine.checks import path_exists, read_regular_file

__all__ = ["Tokenizer", "TokenizerError", "IncrementalDetokenizer", "load_tokenizer", "bytes_to_unicode", "byte_chars",
           "bpe_merge", "use_merge_loop"]


class TokenizerError(ValueError):
    """A tokenizer file that is malformed or uses a component this engine does not implement."""


MAX_TOKENIZER_BYTES = 64 << 20     # Llama 3's tokenizer.json is 9 MB, Qwen's 7 MB
MAX_CONFIG_BYTES = 16 << 20        # tokenizer_config.json, chat_template.jinja
MAX_PATTERN_CHARS = 10_000         # the longest real pre-tokenizer regex has ~200 characters
REGEX_BASE_SECONDS = 1.0
REGEX_SECONDS_PER_CHAR = 20e-6


def _expect(value, kinds, where: str):
    """value if it is one of `kinds` (bool never counts as int), else TokenizerError naming the field."""
    if isinstance(value, kinds) and not (isinstance(value, bool) and bool not in _as_tuple(kinds)):
        return value
    names = " or ".join("null" if k is type(None) else k.__name__ for k in _as_tuple(kinds))
    shown = repr(value)
    raise TokenizerError(f"tokenizer.json {where} must be {names}, got {type(value).__name__} "
                         f"{shown[:60]}{'...' if len(shown) > 60 else ''}")


def _as_tuple(kinds) -> tuple:
    return kinds if isinstance(kinds, tuple) else (kinds,)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte map: each of the 256 byte values -> one printable character.

    Printable Latin-1 bytes map to themselves; the rest (control bytes, space, 0x7F-0xA0, 0xAD) are
    shifted to U+0100 and up, which is why a leading space shows up as 'Ġ' (U+0120) in vocabularies.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + shifted)
            shifted += 1
    return mapping


BYTE_TO_CHAR = bytes_to_unicode()
CHAR_TO_BYTE = {c: b for b, c in BYTE_TO_CHAR.items()}


def byte_chars(text: str) -> str:
    """text -> its UTF-8 bytes written in byte-map characters, what BPE works on (" naïve" -> "ĠnaÃ¯ve")."""
    # Latin-1 turns each byte into the character of the same number; translate maps those to the byte map
    return text.encode("utf-8").decode("latin-1").translate(BYTE_TO_CHAR)

# The GPT-2 pre-tokenization regex, used by the ByteLevel pre-tokenizer when use_regex is true
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


# The pre-tokenizer patterns of the families this engine serves: alternatives of single-character
# classes under one quantifier each, never nested, so a split walks each character a bounded number
# of times. These run without the regex time budget; every other pattern runs with it.
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_LINEAR_PATTERNS = frozenset({GPT2_PATTERN, LLAMA3_PATTERN, QWEN2_PATTERN, r"\p{N}"})

# ---------------------------------------------------------------- pre-tokenizers

_BEHAVIORS = {"Isolated", "Removed", "MergedWithPrevious", "MergedWithNext", "Contiguous"}


class RegexSplit:
    """Split a piece around the matches of a regex, like `tokenizers`' Split / Digits pre-tokenizers.

    The piece is cut into alternating stretches of matches and gaps (text the regex skipped over);
    `behavior` says what happens to the matches: kept alone (Isolated), dropped (Removed), glued to the
    gap before/after (MergedWithPrevious/Next), or runs of consecutive matches fused (Contiguous).
    """

    def __init__(self, pattern: str, behavior: str = "Isolated", invert: bool = False, literal: bool = False):
        if behavior not in _BEHAVIORS:
            raise TokenizerError(f"unsupported Split behavior {behavior!r} (known: {sorted(_BEHAVIORS)})")
        if len(pattern) > MAX_PATTERN_CHARS:
            raise TokenizerError(f"pre-tokenizer regex of {len(pattern):,} characters "
                                 f"(at most {MAX_PATTERN_CHARS:,})")
        try:
            self.regex = regex.compile(pattern)
        except (regex.error, RecursionError, OverflowError, ValueError) as e:
            raise TokenizerError(f"cannot compile pre-tokenizer regex {pattern[:200]!r}: {e}") from None
        self.behavior, self.invert = behavior, invert
        # a known linear pattern or an escaped literal runs at full speed; anything else under the budget
        self.budgeted = not (literal or pattern in _LINEAR_PATTERNS)

    def __call__(self, piece: str) -> list[str]:
        return list(self.iter(piece))

    def iter(self, piece: str):
        """The pieces one at a time (the tokenizer streams them; a 10 MB text is millions of pieces)."""
        if self.behavior == "Isolated" and not self.invert:
            # every match and every gap is a piece: slices of one finditer pass, linear in the text
            # (a single regex for "match or gap" backtracks through a whole gap and runs out of memory)
            return (piece[s:e] for s, e, _ in self._spans(piece))
        return iter(self._split(piece))

    def _split(self, piece: str) -> list[str]:
        spans = list(self._spans(piece))  # [(start, end, is_match)] covering the piece
        kept: list[list] = []       # [start, end] of output pieces
        previous_match = False
        if self.behavior == "MergedWithNext":
            for start, end, is_match in reversed(spans):
                if is_match and not previous_match and kept:
                    kept[-1][0] = start
                else:
                    kept.append([start, end])
                previous_match = is_match
            kept.reverse()
        else:
            for start, end, is_match in spans:
                if self.behavior == "Removed":
                    if not is_match:
                        kept.append([start, end])
                    continue
                glue = (self.behavior == "Contiguous" and is_match == previous_match) or (
                    self.behavior == "MergedWithPrevious" and is_match and not previous_match
                )
                if glue and kept:
                    kept[-1][1] = end
                else:
                    kept.append([start, end])
                previous_match = is_match
        return [piece[s:e] for s, e in kept if e > s]

    def _spans(self, piece: str):
        """(start, end, is_match) covering the piece, in order, within the regex time budget."""
        position = 0
        budget = REGEX_BASE_SECONDS + REGEX_SECONDS_PER_CHAR * len(piece)
        matches = self.regex.finditer(piece, timeout=budget) if self.budgeted else self.regex.finditer(piece)
        try:
            for m in matches:
                if m.start() > position:
                    yield position, m.start(), self.invert
                yield m.start(), m.end(), not self.invert
                position = m.end()
        except TimeoutError:
            raise TokenizerError(
                f"pre-tokenizer regex {self.regex.pattern[:200]!r} ran past its {budget:.1f} s budget on "
                f"{len(piece):,} characters (stopped at character {position:,}): a pattern that backtracks "
                "catastrophically; this tokenizer.json cannot be used") from None
        if position < len(piece):
            yield position, len(piece), self.invert


class PrefixSpace:
    """ByteLevel(add_prefix_space=True): every piece that reaches it gets a leading space if it lacks one."""

    def __call__(self, piece: str) -> list[str]:
        return [piece if piece.startswith(" ") else " " + piece]

    def iter(self, piece: str):
        return iter(self(piece))


def _pre_tokenizer_stages(spec: dict | None) -> list:
    """tokenizer.json "pre_tokenizer" -> list of stages (piece -> pieces). ByteLevel must come last."""
    if spec is None:
        raise TokenizerError("no pre_tokenizer: byte-level BPE needs a ByteLevel pre-tokenizer")
    _expect(spec, dict, "pre_tokenizer")
    if spec.get("type") == "Sequence":
        specs = _expect(spec.get("pretokenizers"), list, "pre_tokenizer.pretokenizers")
    else:
        specs = [spec]
    stages: list[RegexSplit | PrefixSpace] = []
    for i, part in enumerate(specs):
        where = f"pre_tokenizer.pretokenizers[{i}]" if spec.get("type") == "Sequence" else "pre_tokenizer"
        _expect(part, dict, where)
        kind = part.get("type")
        if kind == "Split":
            pattern = _expect(part.get("pattern"), dict, f"{where}.pattern")
            literal = "Regex" not in pattern
            if "Regex" in pattern:
                source = _expect(pattern["Regex"], str, f"{where}.pattern.Regex")
            elif "String" in pattern:
                source = regex.escape(_expect(pattern["String"], str, f"{where}.pattern.String"))
            else:
                raise TokenizerError(f"unsupported Split pattern {str(pattern)[:80]!r}")
            behavior = _expect(part.get("behavior", "Isolated"), str, f"{where}.behavior")
            invert = _expect(part.get("invert", False), bool, f"{where}.invert")
            stages.append(RegexSplit(source, behavior, invert, literal=literal))
        elif kind == "Digits":
            stages.append(RegexSplit(r"\p{N}", "Isolated" if part.get("individual_digits") else "Contiguous"))
        elif kind == "ByteLevel":
            if i != len(specs) - 1:
                raise TokenizerError("ByteLevel must be the last pre-tokenizer (its byte map is applied by the model)")
            if part.get("add_prefix_space"):
                stages.append(PrefixSpace())
            if part.get("use_regex", True):
                stages.append(RegexSplit(GPT2_PATTERN))
        else:
            raise TokenizerError(f"unsupported pre-tokenizer {kind!r} "
                                 "(implemented: Sequence, Split, Digits, ByteLevel)")
    if not specs or specs[-1].get("type") != "ByteLevel":
        raise TokenizerError("byte-level BPE needs a ByteLevel pre-tokenizer as the last step")
    return stages


def _normalizer(spec: dict | None):
    """tokenizer.json "normalizer" -> str -> str, or None. Only the Unicode forms (Qwen uses NFC: "e" +
    U+0301 becomes "é", one character, before pre-tokenization) are implemented."""
    if spec is None:
        return None
    form = _expect(spec, dict, "normalizer").get("type")
    if form not in ("NFC", "NFD", "NFKC", "NFKD"):
        raise TokenizerError(f"unsupported normalizer {form!r} (implemented: NFC, NFD, NFKC, NFKD)")
    return functools.partial(unicodedata.normalize, form)


# ---------------------------------------------------------------- BPE


def bpe_merge(ids: list[int], merges: dict[tuple[int, int], tuple[int, int]], trace: list | None = None) -> list[int]:
    """Apply BPE merges to a word given as token ids; merges maps (left, right) -> (rank, merged id).

    Rule: merge the adjacent pair with the lowest rank, leftmost first on ties, until no pair has a
    rank. Done with a heap of candidate pairs over a linked list of symbols, O(n log n) instead of
    rescanning the word after each merge (a 10,000-byte word would take seconds otherwise). Entries
    whose symbols changed since they were pushed are stale and skipped when popped.
    `trace`, when given, receives (rank, left id, right id, merged id) for each merge, in order.
    """
    n = len(ids)
    if n < 2:
        return list(ids)
    symbol = list(ids)
    alive = [True] * n
    prev = list(range(-1, n - 1))
    nxt = list(range(1, n + 1))
    nxt[-1] = -1
    heap = []
    for i in range(n - 1):
        merge = merges.get((ids[i], ids[i + 1]))
        if merge is not None:
            heap.append((merge[0], i, merge[1]))
    heapq.heapify(heap)
    while heap:
        _, i, merged = heapq.heappop(heap)
        if not alive[i] or nxt[i] == -1:
            continue
        j = nxt[i]
        current = merges.get((symbol[i], symbol[j]))
        if current is None or current[1] != merged:
            continue  # stale: a neighbour was merged away since this pair was pushed
        if trace is not None:
            trace.append((current[0], symbol[i], symbol[j], merged))
        symbol[i] = merged
        alive[j] = False
        k = nxt[j]
        nxt[i] = k
        if k != -1:
            prev[k] = i
            right = merges.get((merged, symbol[k]))
            if right is not None:
                heapq.heappush(heap, (right[0], i, right[1]))
        p = prev[i]
        if p != -1:
            left = merges.get((symbol[p], merged))
            if left is not None:
                heapq.heappush(heap, (left[0], p, left[1]))
    return [s for s, a in zip(symbol, alive, strict=True) if a]


# The merge loop a learner plugs in (chapter 02), or None for bpe_merge. Read once per encode() call.
_MERGE_LOOP: Callable | None = None
_MERGE_LOOP_LOCK = threading.Lock()


@contextmanager
def use_merge_loop(fn: Callable) -> Iterator[None]:
    """For the span of the block, every Tokenizer.encode merges each pre-token with `fn` instead of bpe_merge.

    fn(symbols, ranks) -> symbols: `symbols` is the pre-token as byte-map strings, one per byte
    (list("Ġtokenizer")), `ranks` the merge table {(left, right): rank} (read-only), and the result the
    tokens it merges into, each of which must be in the vocabulary. The per-piece cache is bypassed, so
    fn runs on every piece of every call. Blocks nest; the loop is process-wide while a block is open.
    """
    global _MERGE_LOOP
    if not callable(fn):
        raise TypeError(f"use_merge_loop needs a function, got {type(fn).__name__}")
    with _MERGE_LOOP_LOCK:
        previous, _MERGE_LOOP = _MERGE_LOOP, fn
    try:
        yield
    finally:
        with _MERGE_LOOP_LOCK:
            _MERGE_LOOP = previous


def _parse_merges(raw: list, vocab: dict[str, int]) -> dict[tuple[int, int], tuple[int, int]]:
    """merges in either form ("a b" or ["a", "b"]) -> {(id_a, id_b): (rank, id_ab)}; a later duplicate wins."""
    _expect(raw, list, "model.merges")
    pairs = [merge.split(" ") if isinstance(merge, str) else merge for merge in raw]
    for rank, parts in enumerate(pairs):
        if not (isinstance(parts, list) and len(parts) == 2 and all(isinstance(p, str) for p in parts)):
            raise TokenizerError(f"merge #{rank} {str(raw[rank])[:80]!r} is not a pair of tokens")
    try:  # one comprehension: Llama 3 has 280,147 merges and this runs at every load
        return {(vocab[a], vocab[b]): (rank, vocab[a + b]) for rank, (a, b) in enumerate(pairs)}
    except KeyError:
        rank = next(r for r, (a, b) in enumerate(pairs) if not {a, b, a + b} <= vocab.keys())
        raise TokenizerError(f"merge #{rank} {raw[rank]!r} uses a token missing from the vocab") from None


# ---------------------------------------------------------------- added tokens


class AddedTokens:
    """Finds added tokens in raw text the way `tokenizers`' AddedVocabulary does.

    Leftmost-longest matching; tokens marked normalized=false are cut out first, then those marked
    normalized=true in what is left (with no normalizer the text is the same, only the order matters).
    lstrip/rstrip swallow the whitespace beside a match; single_word only matches outside words.
    """

    def __init__(self, tokens: list[dict]):
        self.by_content = {t["content"]: t for t in tokens}
        self.passes = []   # (normalized, pattern): raw-text tokens first, then those matched after normalizing
        for normalized in (False, True):
            group = sorted((t["content"] for t in tokens if t.get("normalized", not t.get("special")) == normalized),
                           key=len, reverse=True)
            if group:  # alternatives longest first = leftmost-longest with a leftmost-first regex engine
                self.passes.append((normalized, regex.compile("|".join(regex.escape(c) for c in group))))

    def split(self, text: str, normalize=None) -> list[tuple[str, int | None]]:
        """text -> [(chunk, id of the added token or None for ordinary text)], in order. `normalize`
        (str -> str) applies to ordinary text once the normalized=false tokens are cut out."""
        chunks: list[tuple[str, int | None]] = [(text, None)]
        for normalized, pattern in [*self.passes, (True, None)]:
            if normalized and normalize is not None:
                chunks = [(normalize(c), None) if i is None else (c, i) for c, i in chunks]
                normalize = None
            if pattern is None:
                break
            chunks = [c for chunk in chunks for c in
                      ([chunk] if chunk[1] is not None else self._split_one(chunk[0], pattern))]
        return [c for c in chunks if c[0] or c[1] is not None]

    def _split_one(self, text: str, pattern) -> list[tuple[str, int | None]]:
        out: list[tuple[str, int | None]] = []
        position = 0
        for m in pattern.finditer(text):
            start, stop = m.span()
            token = self.by_content[m.group()]
            inside_word = _is_word_char(text[start - 1:start]) or _is_word_char(text[stop:stop + 1])
            if token.get("single_word") and inside_word:
                continue
            if token.get("lstrip"):
                start = max(len(text[:start].rstrip(_WHITE_SPACE)), position)
            if token.get("rstrip"):
                stop = len(text) - len(text[stop:].lstrip(_WHITE_SPACE))
            if start > position:
                out.append((text[position:start], None))
            out.append((text[start:stop], token["id"]))
            position = stop
        if position < len(text):
            out.append((text[position:], None))
        return out


# Unicode White_Space (Rust's char::is_whitespace); str.isspace() would also take U+001C..U+001F
_WHITE_SPACE = "\t\n\v\f\r \x85\xa0\u1680" + "".join(map(chr, range(0x2000, 0x200B))) + "\u2028\u2029\u202f\u205f\u3000"
_WORD_CHAR = regex.compile(r"\w")


def _is_word_char(char: str) -> bool:
    return bool(char) and _WORD_CHAR.match(char) is not None


# ---------------------------------------------------------------- post-processing


def _post_processor(spec: dict | None, depth: int = 0):
    """tokenizer.json "post_processor" -> function(ids) -> ids used when add_special_tokens=True."""
    if spec is None:
        return lambda ids: ids
    kind = _expect(spec, dict, "post_processor").get("type")
    if kind == "ByteLevel":  # only trims offsets, never changes ids
        return lambda ids: ids
    if kind == "Sequence":
        if depth > 8:
            raise TokenizerError("post_processor Sequences nested more than 8 deep")
        steps = [_post_processor(s, depth + 1)
                 for s in _expect(spec.get("processors"), list, "post_processor.processors")]
        return functools.reduce(lambda f, g: (lambda ids: g(f(ids))), steps, lambda ids: ids)
    if kind == "TemplateProcessing":
        special = {}
        for name, entry in _expect(spec.get("special_tokens", {}), dict, "post_processor.special_tokens").items():
            ids = _expect(_expect(entry, dict, f"post_processor.special_tokens[{name!r}]").get("ids"), list,
                          f"post_processor.special_tokens[{name!r}].ids")
            for token_id in ids:
                if _expect(token_id, int, f"post_processor.special_tokens[{name!r}].ids[]") < 0:
                    raise TokenizerError(f"post_processor special token {name!r} has negative id {token_id}")
            special[name] = ids
        template = []
        for item in _expect(spec.get("single"), list, "post_processor.single"):
            _expect(item, dict, "post_processor.single[]")
            if "SpecialToken" in item:
                name = _expect(_expect(item["SpecialToken"], dict, "post_processor.single[].SpecialToken").get("id"),
                               str, "post_processor.single[].SpecialToken.id")
                if name not in special:
                    raise TokenizerError(f"TemplateProcessing uses undeclared special token {name!r}")
                template.append(special[name])
            elif isinstance(item.get("Sequence"), dict) and item["Sequence"].get("id") == "A":
                template.append(None)  # where the encoded text goes
            else:
                raise TokenizerError(f"unsupported TemplateProcessing item {item!r}")
        return lambda ids: [i for part in template for i in (ids if part is None else part)]
    raise TokenizerError(f"unsupported post_processor {kind!r} (implemented: ByteLevel, TemplateProcessing, Sequence)")


# ---------------------------------------------------------------- structure of the file


def _checked_vocab(value) -> dict[str, int]:
    """model.vocab: a non-empty {token: id} with distinct non-negative int ids."""
    vocab = _expect(value, dict, "model.vocab")
    if not vocab:
        raise TokenizerError("tokenizer.json model.vocab is empty")
    seen: dict[int, str] = {}
    for token, token_id in vocab.items():
        if not isinstance(token_id, int) or isinstance(token_id, bool):
            raise TokenizerError(f"tokenizer.json vocab entry {token[:40]!r} has id {str(token_id)[:40]!r}, "
                                 "not an integer")
        if token_id < 0:
            raise TokenizerError(f"tokenizer.json vocab entry {token[:40]!r} has negative id {token_id}")
        other = seen.setdefault(token_id, token)
        if other is not token:
            raise TokenizerError(f"tokenizer.json vocab gives id {token_id} to both {other[:40]!r} and "
                                 f"{token[:40]!r} (duplicate id)")
        if not token:
            raise TokenizerError(f"tokenizer.json vocab has an empty token (id {token_id})")
    return dict(vocab)


def _checked_added(value) -> list[dict]:
    """added_tokens: a list of {"id": int >= 0, "content": non-empty str, flags}."""
    tokens = _expect(value if value is not None else [], list, "added_tokens")
    for i, token in enumerate(tokens):
        _expect(token, dict, f"added_tokens[{i}]")
        content = _expect(token.get("content"), str, f"added_tokens[{i}].content")
        if not content:
            raise TokenizerError(f"tokenizer.json added_tokens[{i}] has empty content")
        token_id = _expect(token.get("id"), int, f"added_tokens[{i}].id")
        if token_id < 0:
            raise TokenizerError(f"tokenizer.json added token {content[:40]!r} has negative id {token_id}")
    return tokens


# Ids may leave holes (reserved special tokens), so the id space is not len(vocab) + len(added); whether
# the ids fit the model's embedding table is the model's check (check_vocab_fits). This bound only stops
# an absurd id (10**12) that would size tables: it is far past any real vocabulary (~10**5 to 10**6).
MAX_TOKEN_ID = 1 << 24


def _check_id_space(vocab: dict[str, int], added: list[dict], id_to_token: dict[int, str]) -> None:
    """Ids are distinct across vocab and added tokens, and none lies past MAX_TOKEN_ID."""
    limit = MAX_TOKEN_ID
    claimed = dict(id_to_token)
    for token in added:
        token_id, content = token["id"], token["content"]
        other = claimed.setdefault(token_id, content)
        if other != content:
            raise TokenizerError(f"tokenizer.json gives id {token_id} to both {other[:40]!r} and added token "
                                 f"{content[:40]!r} (duplicate id)")
    past = max(claimed)
    if past >= limit:
        raise TokenizerError(f"tokenizer.json has id {past:,}, past the vocabulary: ids above {limit - 1:,} are "
                             f"refused ({len(vocab):,} vocab entries, {len(added):,} added tokens)")


# ---------------------------------------------------------------- the tokenizer


class Tokenizer:
    """A byte-level BPE tokenizer read from tokenizer.json (+ tokenizer_config.json roles and chat template)."""

    def __init__(self, spec: dict, config: dict | None = None, chat_template: str | None = None):
        try:
            self._build(spec, config, chat_template)
        except (TypeError, AttributeError, KeyError, IndexError) as e:
            # a shape _expect does not check: still a refusal of the file, never a bare traceback
            raise TokenizerError(f"malformed tokenizer.json: {type(e).__name__}: {e}") from None

    def _build(self, spec: dict, config: dict | None, chat_template: str | None) -> None:
        _expect(spec, dict, "(the whole file)")
        self._check_supported(spec)
        model = spec["model"]
        self.vocab: dict[str, int] = _checked_vocab(model.get("vocab"))
        self._merges = _parse_merges(model.get("merges", []), self.vocab)
        self._ignore_merges = bool(model.get("ignore_merges", False))
        # A trained vocab may lack some of the 256 byte tokens (SmolLM2 lacks 21: bytes that never
        # occur in UTF-8 like 0xFF, and rare control bytes). Such a byte becomes the unk token if the
        # model has one (runs fused into one with fuse_unk), and is silently dropped otherwise.
        unk = _expect(model.get("unk_token"), (str, type(None)), "model.unk_token")
        if unk is not None and unk not in self.vocab:
            raise TokenizerError(f"unk_token {unk!r} is not in the vocab")
        self._unk_id = None if unk is None else self.vocab[unk]
        self._fuse_unk = bool(model.get("fuse_unk", False))
        self._normalize = _normalizer(spec.get("normalizer"))
        self._stages = _pre_tokenizer_stages(spec.get("pre_tokenizer"))
        self._post_process = _post_processor(spec.get("post_processor"))

        # An added token already in the vocab keeps its vocab id (tokenizers does the same, whatever the file says)
        added = [dict(t, id=self.vocab.get(t["content"], t["id"])) for t in _checked_added(spec.get("added_tokens"))]
        self._id_to_token = {i: t for t, i in self.vocab.items()}
        _check_id_space(self.vocab, added, self._id_to_token)
        self._added = AddedTokens(added)
        self._id_to_token.update({t["id"]: t["content"] for t in added})
        self._token_to_id = {**self.vocab, **{t["content"]: t["id"] for t in added}}
        self.special_token_ids: set[int] = {t["id"] for t in added if t.get("special")}
        self.vocab_size = max(self._id_to_token) + 1
        # Per-token bytes for decoding: byte-map characters -> their bytes; a token with any other
        # character (an added token like "<tool call>") is taken as its raw UTF-8, as `tokenizers` does.
        self._token_bytes = {i: _token_to_bytes(t) for i, t in self._id_to_token.items()}
        self._bpe_word = functools.lru_cache(maxsize=1 << 16)(self._bpe_word_uncached)
        self._merge_ranks_view: types.MappingProxyType | None = None   # built on first use_merge_loop encode

        config = config or {}
        self.special_tokens_map = {role: content for role in ("bos_token", "eos_token", "unk_token", "pad_token")
                                   if (content := _token_content(config.get(role))) is not None}
        self.bos_token_id = self._role_id("bos_token")
        self.eos_token_id = self._role_id("eos_token")
        self.pad_token_id = self._role_id("pad_token")
        self.eos_token_ids: set[int] = {self.eos_token_id} if self.eos_token_id is not None else set()
        if chat_template is None:
            chat_template = config.get("chat_template")
            try:
                chat_template = _default_template(chat_template)
            except ValueError:
                pass   # kept as found: a malformed field fails apply_chat_template, never encode/decode
        self.chat_template = chat_template
        if isinstance(chat_template, str):   # compiled (and checked) now; a refusal fails apply_chat_template
            from engine.text.chat_template import check_template
            check_template(chat_template)

    @staticmethod
    def _check_supported(spec: dict) -> None:
        model = _expect(spec.get("model"), dict, "model")
        if model.get("type", "BPE") != "BPE" or "merges" not in model:
            raise TokenizerError(f"unsupported model type {model.get('type')!r}: only byte-level BPE is implemented")
        for option in ("continuing_subword_prefix", "end_of_word_suffix"):
            if model.get(option):
                raise TokenizerError(f"unsupported BPE option {option}={model[option]!r}")
        if model.get("dropout"):
            raise TokenizerError("BPE dropout is a training-time randomization; refusing a tokenizer that uses it")
        if model.get("byte_fallback"):
            raise TokenizerError("byte_fallback BPE (SentencePiece style) is not implemented")
        _normalizer(spec.get("normalizer"))     # raises for one that is not implemented
        decoder = _expect(spec.get("decoder"), (dict, type(None)), "decoder")
        if decoder is None or decoder.get("type") != "ByteLevel":
            kind = decoder and decoder.get("type")
            raise TokenizerError(f"unsupported decoder {kind!r}: only ByteLevel is implemented")

    def _role_id(self, role: str) -> int | None:
        content = self.special_tokens_map.get(role)
        return None if content is None else self._token_to_id.get(content)

    # ------------------------------------------------------------ encode

    def encode(self, text: str, add_special_tokens: bool = False, max_tokens: int | None = None) -> list[int]:
        """Text -> token ids, identical to `tokenizers.Tokenizer.encode(text, add_special_tokens).ids`.

        Memory beyond the ids stays bounded on any text: pieces stream through the pre-tokenizer
        stages one at a time instead of as lists of millions of strings. With `max_tokens`, a text
        that needs more raises TokenizerError as soon as it is known (a 10 MB prompt against a
        2,048-token context stops after the first few kB).
        """
        if not isinstance(text, str):
            raise TokenizerError(f"encode expects a str, got {type(text).__name__}")
        if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 0):
            raise TokenizerError(f"max_tokens must be a non-negative int, got {max_tokens!r}")
        limit = None if max_tokens is None else max_tokens - len(self._post_process([])) * add_special_tokens
        merge_loop = _MERGE_LOOP
        bpe_word = self._bpe_word if merge_loop is None else functools.partial(self._bpe_word_through, merge_loop)
        ids: list[int] = []
        for chunk, added_id in self._added.split(text, self._normalize):
            if added_id is not None:
                ids.append(added_id)
            else:
                for piece in self._iter_pieces(chunk):
                    ids.extend(bpe_word(piece))
                    if limit is not None and len(ids) > limit:
                        break
            if limit is not None and len(ids) > limit:
                raise TokenizerError(f"text needs more than {max_tokens} tokens "
                                     f"(stopped after {len(ids)} tokens at {len(text):,} characters of input)")
        return self._post_process(ids) if add_special_tokens else ids

    def pre_tokenize(self, chunk: str) -> list[str]:
        """One chunk of ordinary text (no added tokens in it) -> the pieces BPE sees, before the byte map."""
        return list(self._iter_pieces(chunk))

    def _iter_pieces(self, chunk: str, stage: int = 0):
        """The pieces of `chunk` after stages[stage:], depth first: one piece per stage alive at a time."""
        if not chunk:
            return
        if stage == len(self._stages):
            yield chunk
            return
        for piece in self._stages[stage].iter(chunk):
            if piece:
                yield from self._iter_pieces(piece, stage + 1)

    def _bpe_word_uncached(self, piece: str) -> tuple[int, ...]:
        word = byte_chars(piece)
        if self._ignore_merges and word in self.vocab:
            return (self.vocab[word],)  # the whole piece is a token: take it without merging
        try:
            ids = [self.vocab[c] for c in word]
        except KeyError:
            ids = self._initial_ids_with_missing_bytes(word)
        return tuple(bpe_merge(ids, self._merges))

    def _bpe_word_through(self, merge_loop: Callable, piece: str) -> tuple[int, ...]:
        """_bpe_word_uncached with a plugged-in merge loop (use_merge_loop) in place of bpe_merge."""
        word = byte_chars(piece)
        if self._ignore_merges and word in self.vocab:
            return (self.vocab[word],)
        try:
            ids = [self.vocab[c] for c in word]
        except KeyError:
            ids = self._initial_ids_with_missing_bytes(word)
        if self._merge_ranks_view is None:
            self._merge_ranks_view = types.MappingProxyType(self.merge_ranks())
        merged = merge_loop([self._id_to_token[i] for i in ids], self._merge_ranks_view)
        if not isinstance(merged, (list, tuple)):
            raise TokenizerError(f"the merge loop turned {word!r} into a {type(merged).__name__}; it must return "
                                 "the list of symbols")
        try:
            return tuple(self._token_to_id[symbol] for symbol in merged)
        except (KeyError, TypeError):
            bad = next((s for s in merged if not isinstance(s, str) or s not in self._token_to_id), merged)
            raise TokenizerError(f"the merge loop turned {word!r} into {list(merged)!r}: {bad!r} is not a "
                                 "token of the vocabulary") from None

    def merge_steps(self, piece: str) -> list[tuple[int, str, str, list[str]]]:
        """The merges BPE applies to one pre-token, in order: [(rank, left, right, symbols after)].

        For teaching: Llama 3's ignore_merges shortcut is not taken here, so this shows how the merges
        alone build the piece (the result can differ from encode() when the whole piece is a token)."""
        symbols = [c for c in byte_chars(piece) if c in self.vocab]
        trace: list = []
        bpe_merge([self.vocab[c] for c in symbols], self._merges, trace)
        steps = []
        for rank, left_id, right_id, _ in trace:
            left, right = self._id_to_token[left_id], self._id_to_token[right_id]
            # the merged occurrence is the leftmost one: equal ranks merge left to right
            i = next(i for i in range(len(symbols) - 1) if symbols[i] == left and symbols[i + 1] == right)
            symbols = symbols[:i] + [left + right] + symbols[i + 2:]
            steps.append((rank, left, right, symbols))
        return steps

    def merge_ranks(self) -> dict[tuple[str, str], int]:
        """The merge table as strings: {(left token, right token): rank}; a lower rank merges first."""
        return {(self._id_to_token[a], self._id_to_token[b]): rank for (a, b), (rank, _) in self._merges.items()}

    def _initial_ids_with_missing_bytes(self, word: str) -> list[int]:
        ids, previous_unknown = [], False
        for c in word:
            token_id = self.vocab.get(c)
            if token_id is not None:
                ids.append(token_id)
            elif self._unk_id is not None and not (self._fuse_unk and previous_unknown):
                ids.append(self._unk_id)
            previous_unknown = token_id is None
        return ids

    # ------------------------------------------------------------ decode

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        """Token ids -> text, identical to `tokenizers.Tokenizer.decode`. Unknown ids are skipped, like there."""
        return self.token_bytes(ids, skip_special_tokens).decode("utf-8", errors="replace")

    def token_bytes(self, ids, skip_special_tokens: bool = False) -> bytes:
        """The raw bytes behind some ids (may end inside a UTF-8 sequence)."""
        skip = self.special_token_ids if skip_special_tokens else ()
        table = self._token_bytes
        return b"".join(table[i] for i in map(int, ids) if i in table and i not in skip)

    def detokenizer(self, skip_special_tokens: bool = False) -> IncrementalDetokenizer:
        """A streaming decoder: push ids one at a time, get text as soon as it is complete UTF-8."""
        return IncrementalDetokenizer(self, skip_special_tokens)

    # ------------------------------------------------------------ vocabulary and chat

    def token_to_id(self, token: str) -> int | None:
        return self._token_to_id.get(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._id_to_token.get(int(token_id))

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, chat_template: str | None = None,
                            **template_kwargs) -> str:
        """Render a conversation with the model's chat template, identical to transformers' tokenize=False text."""
        from engine.text.chat_template import ChatTemplateError, render_chat_template

        template = chat_template if chat_template is not None else _default_template(self.chat_template)
        if template is None:
            raise ChatTemplateError("this tokenizer has no chat template (tokenizer_config.json has none); "
                                    "pass chat_template=")
        return render_chat_template(template, messages, add_generation_prompt=add_generation_prompt,
                                    **{**self.special_tokens_map, **template_kwargs})

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self.vocab_size}, merges={len(self._merges)}, "
                f"added={len(self._added.by_content)}, chat_template={'yes' if self.chat_template else 'no'})")


# str.translate table: byte-map characters -> the Latin-1 character of their byte; the Latin-1
# characters that are not byte-map characters (space, controls, ...) -> U+FFFF, which Latin-1 refuses
_UNMAP = {ord(c): b for c, b in CHAR_TO_BYTE.items()} | {b: 0xFFFF for b in range(256) if chr(b) not in CHAR_TO_BYTE}


def _token_to_bytes(token: str) -> bytes:
    try:
        return token.translate(_UNMAP).encode("latin-1")
    except UnicodeEncodeError:  # some character outside the byte map
        return token.encode("utf-8")


def _token_content(value) -> str | None:
    """tokenizer_config roles are a string or a serialized AddedToken {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _default_template(value) -> str | None:
    """chat_template is a string, or a list of {"name", "template"} of which "default" is the one used."""
    from engine.text.chat_template import ChatTemplateError

    if value is None or isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise ChatTemplateError(f"tokenizer_config.json chat_template must be a string or a list of "
                                f"{{'name', 'template'}} entries, got {type(value).__name__}")
    named = {}
    for i, entry in enumerate(value):
        if not (isinstance(entry, dict) and isinstance(entry.get("name"), str)
                and isinstance(entry.get("template"), str)):
            raise ChatTemplateError(f"tokenizer_config.json chat_template entry {i} is not "
                                    f"{{'name': str, 'template': str}}: {str(entry)[:80]!r}")
        named[entry["name"]] = entry["template"]
    if "default" not in named:
        raise ChatTemplateError(f"tokenizer_config.json has chat templates {sorted(named)} but none named "
                                "'default'; pass chat_template=")
    return named["default"]


class IncrementalDetokenizer:
    """Streaming decode: `push(id)` returns the new text, holding back a UTF-8 sequence split across tokens.

    A character like "é" or an emoji can be spread over several byte-level tokens; printing each
    token's bytes on its own would show U+FFFD garbage. The UTF-8 incremental decoder keeps the
    incomplete tail until the rest arrives, so "".join(pushes) + flush() == decode(all ids).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        return self._utf8.decode(self._tokenizer.token_bytes([token_id], self._skip_special_tokens))

    def flush(self) -> str:
        """End of stream: an unfinished sequence left over becomes U+FFFD, as in decode()."""
        return self._utf8.decode(b"", final=True)


def load_tokenizer(model_dir) -> Tokenizer:
    """Load from a model directory (tokenizer.json, optional tokenizer_config.json / chat_template.jinja)
    or from a path to a tokenizer.json file."""
    path = Path(model_dir)
    tokenizer_json = path if path_exists(path) and not path.is_dir() else path / "tokenizer.json"
    if not path_exists(tokenizer_json):
        raise TokenizerError(f"no tokenizer.json at {path}")
    spec = _read_json(tokenizer_json, MAX_TOKENIZER_BYTES)
    config_path = tokenizer_json.parent / "tokenizer_config.json"
    config = _read_json(config_path, MAX_CONFIG_BYTES) if path_exists(config_path) else None
    template_path = tokenizer_json.parent / "chat_template.jinja"  # newer transformers save the template here
    chat_template = None
    if path_exists(template_path):
        # undecodable bytes stay visible as U+FFFD; the template then fails to compile or renders them
        raw = read_regular_file(template_path, MAX_CONFIG_BYTES, TokenizerError)
        chat_template = raw.decode("utf-8", errors="replace")
    return Tokenizer(spec, config, chat_template)


def _read_json(path: Path, cap: int) -> dict:
    try:
        value = json.loads(read_regular_file(path, cap, TokenizerError).decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise TokenizerError(f"{path} is not valid JSON: {type(e).__name__}: {e}") from None
    if not isinstance(value, dict):
        raise TokenizerError(f"{path} must hold a JSON object, got {type(value).__name__}")
    return value
