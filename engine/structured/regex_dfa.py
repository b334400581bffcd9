"""Regular expressions -> a DFA over UTF-8 bytes, the automaton behind constrained decoding.

A constraint must answer, after every token, "which bytes may come next?". A deterministic automaton
answers that with one table lookup per byte, so the pattern is compiled once, ahead of decoding:

    pattern --parse--> syntax tree --Thompson--> NFA over bytes --subsets--> DFA --Moore--> minimal DFA

Why bytes and not characters: tokens are byte strings, and a token may end in the middle of a UTF-8
character (byte-level BPE splits "é" = C3 A9 when it likes). So a character class over code points
becomes the byte sequences that encode it (`utf8_sequences`: [^"] is ten short chains of byte
ranges), and the automaton steps through a token's bytes without ever decoding them.

The subset: literals, escapes (\\d \\w \\s \\D \\W \\S \\n \\t \\r \\f \\v \\a \\xHH \\uXXXX \\UXXXXXXXX, and a
backslash before any punctuation), classes with ranges and negation ([a-z0-9_], [^"\\\\], over all of
Unicode), `.` (anything but a newline), groups ( ), (?: ), (?P<name> ), alternation |, and the
quantifiers * + ? {m} {m,} {,n} {m,n} (a lazy `?` after one is accepted: it does not change what a
whole string matches). \\d \\w \\s are ASCII (JSON Schema's ECMA-262 meaning; Python's re.ASCII).
Matching is full-match: the whole output must match, so a leading ^ and a trailing $ change nothing
and are dropped. Everything else (backreferences, lookaround, other anchors, \\b, inline flags,
possessive quantifiers, atomic groups, \\p{..}) is refused with a `StructuredError` naming it.

A pattern may come from a request, so compiling one is bounded in time and memory: its source
(MAX_PATTERN_CHARS), repetition counts (MAX_REPEAT), group nesting (MAX_GROUP_DEPTH), the NFA it
expands to (MAX_NFA_STATES, checked on the tree before anything is built), the DFA (MAX_DFA_STATES)
and the work of the subset construction (MAX_SUBSET_WORK). `(a|b)*a(a|b){20}` needs 2^21 DFA states
and is refused after building 20,000 of them, in 0.3 s; the slowest refusal (the work limit, e.g.
`(?:a|aa|aaa|aaaa){0,1000}b`) takes under a second, and the largest DFAs accepted about 1.5 s.

Trees need not come from pattern text: json_schema.py assembles them directly, including the one
node regex syntax lacks, `Subsequence` (JSON object members: any in-order subset, comma-joined),
whose NFA is linear where its regex text is quadratic.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NoReturn

import numpy as np

__all__ = ["StructuredError", "DFA", "compile_regex", "build_dfa", "parse", "to_regex", "escape", "anchors",
           "utf8_sequences", "Chars", "Concat", "Alt", "Repeat", "Subsequence", "Node", "literal",
           "MAX_PATTERN_CHARS", "MAX_REPEAT", "MAX_DFA_STATES"]

MAX_PATTERN_CHARS = 10_000      # a request's regex (JSON schemas build trees, bounded by the NFA limit)
MAX_REPEAT = 1000               # the largest m or n of {m,n}
MAX_GROUP_DEPTH = 100           # nested groups (the parser and the tree walks recurse on them)
MAX_NFA_STATES = 300_000        # what the tree expands to, counted before building it
MAX_DFA_STATES = 20_000         # the subset construction stops (and refuses) past this many states
MAX_SUBSET_WORK = 10_000_000    # NFA states and moves the subset construction may visit in all
MAX_MINIMIZE_WORK = 5_000_000   # rows x rounds of Moore's refinement; past it the DFA stays unminimized

MAX_CODE_POINT = 0x10FFFF


class StructuredError(ValueError):
    """A constraint (regex, choice list, JSON schema) this library refuses: malformed, unsupported or too large."""


# ---- the syntax tree ---------------------------------------------------------------------------
# Nodes compare and hash by identity (eq=False): a schema's tree shares subtrees (a $ref used twice),
# and a deep comparison or hash of one would walk them all.
@dataclass(frozen=True, eq=False)
class Chars:
    """One character out of a set of code points: sorted, disjoint, non-adjacent (lo, hi) ranges."""
    ranges: tuple[tuple[int, int], ...]


@dataclass(frozen=True, eq=False)
class Concat:
    items: tuple[Node, ...]          # () is the empty string


@dataclass(frozen=True, eq=False)
class Alt:
    options: tuple[Node, ...]


@dataclass(frozen=True, eq=False)
class Repeat:
    node: Node
    min: int
    max: int | None                  # None: unbounded


@dataclass(frozen=True, eq=False)
class Subsequence:
    """A non-empty subsequence of `items`, in order, joined by `separator`; the required ones must
    be in it. JSON object members are this: `"a":1,"c":3` out of optional a, b, c.

    No regex operator says it in linear size: where the commas go depends on which member comes
    first, so the regex text (`to_regex`) is an alternation over that first member, each with its
    own copy of the rest (quadratic, and exponential in the nesting of such objects). The NFA
    builds each item once (`_NFA.subsequence`)."""
    items: tuple[Node, ...]
    required: tuple[bool, ...]
    separator: Node


Node = Chars | Concat | Alt | Repeat | Subsequence


def _normalize(ranges) -> tuple[tuple[int, int], ...]:
    """Sort and merge overlapping or touching ranges."""
    out: list[list[int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return tuple((lo, hi) for lo, hi in out)


def _complement(ranges) -> tuple[tuple[int, int], ...]:
    out, nxt = [], 0
    for lo, hi in _normalize(ranges):
        if lo > nxt:
            out.append((nxt, lo - 1))
        nxt = hi + 1
    if nxt <= MAX_CODE_POINT:
        out.append((nxt, MAX_CODE_POINT))
    return tuple(out)


DIGIT = ((0x30, 0x39),)
WORD = ((0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A))
SPACE = ((0x09, 0x0D), (0x20, 0x20))           # \t \n \v \f \r and space: Python's ASCII \s
CLASS_ESCAPES = {"d": DIGIT, "w": WORD, "s": SPACE,
                 "D": _complement(DIGIT), "W": _complement(WORD), "S": _complement(SPACE)}
CHAR_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v", "a": "\a"}
ANY_BUT_NEWLINE = Chars(_complement([(0x0A, 0x0A)]))
REFUSED_ESCAPES = {"b": "word boundary \\b", "B": "non-boundary \\B", "A": "anchor \\A", "Z": "anchor \\Z",
                   "z": "anchor \\z", "G": "anchor \\G", "p": "Unicode property class \\p{...}",
                   "P": "Unicode property class \\P{...}", "N": "named character \\N{...}"}


def literal(text: str) -> Node:
    return Concat(tuple(Chars(((ord(c), ord(c)),)) for c in text))


# ---- parsing -----------------------------------------------------------------------------------
def parse(pattern: str, max_chars: int = MAX_PATTERN_CHARS) -> Node:
    """The syntax tree of `pattern` (full-match semantics), or StructuredError naming what is wrong."""
    if not isinstance(pattern, str):
        raise StructuredError(f"a regex must be a string, got {type(pattern).__name__}")
    if len(pattern) > max_chars:
        raise StructuredError(f"regex of {len(pattern):,} characters (at most {max_chars:,})")
    return _Parser(pattern).parse()


class _Parser:
    """Recursive descent: alternation > concatenation > quantified atom. Recursion only on groups."""

    def __init__(self, text: str):
        self.text, self.pos, self.depth = text, 0, 0
        self.end = len(text)
        if text.startswith("^"):
            self.pos = 1
        if self.end > self.pos and text.endswith("$") and _unescaped_at_end(text):
            self.end -= 1

    def parse(self) -> Node:
        node = self.alternation()
        if self.pos < self.end:          # only a ")" stops an alternation early
            self.fail("unbalanced parenthesis ')'")
        return node

    def fail(self, what: str) -> NoReturn:
        raise StructuredError(f"regex {self.text[:80]!r}{'...' if len(self.text) > 80 else ''}: {what} "
                              f"at position {self.pos}")

    def peek(self) -> str | None:
        return self.text[self.pos] if self.pos < self.end else None

    def take(self) -> str:
        if self.pos >= self.end:
            self.fail("unexpected end of pattern")
        c = self.text[self.pos]
        self.pos += 1
        return c

    def alternation(self) -> Node:
        options = [self.concatenation()]
        while self.peek() == "|":
            self.pos += 1
            options.append(self.concatenation())
        return options[0] if len(options) == 1 else Alt(tuple(options))

    def concatenation(self) -> Node:
        items: list[Node] = []
        while (c := self.peek()) is not None and c not in "|)":
            items.append(self.quantified(self.atom()))
        return items[0] if len(items) == 1 else Concat(tuple(items))

    def quantified(self, node: Node) -> Node:
        bounds = self.quantifier()
        if bounds is None:
            return node
        lo, hi = bounds
        if self.peek() == "?":           # lazy: the same set of full matches
            self.pos += 1
        elif self.peek() == "+":
            self.fail("possessive quantifier (unsupported)")
        following = self.peek()
        if following is not None and (following in "*+?" or self.braces() is not None):
            self.fail("multiple repeat")
        return Repeat(node, lo, hi)

    def quantifier(self) -> tuple[int, int | None] | None:
        c = self.peek()
        if c == "*":
            self.pos += 1
            return 0, None
        if c == "+":
            self.pos += 1
            return 1, None
        if c == "?":
            self.pos += 1
            return 0, 1
        braces = self.braces()
        if braces is None:
            return None
        lo, hi, length = braces
        if lo > MAX_REPEAT or (hi is not None and hi > MAX_REPEAT):
            self.fail(f"repetition count over {MAX_REPEAT}")
        if hi is not None and hi < lo:
            self.fail("min repeat greater than max repeat")
        self.pos += length
        return lo, hi

    def braces(self) -> tuple[int, int | None, int] | None:
        """{m} {m,} {,n} {m,n} {,} at pos as (min, max, length), or None where Python reads a literal '{'."""
        if self.peek() != "{":
            return None
        close = self.text.find("}", self.pos, self.end)
        if close < 0:
            return None
        body = self.text[self.pos + 1:close]
        lo_text, comma, hi_text = body.partition(",")
        if not (lo_text.isdigit() or lo_text == "") or not (hi_text.isdigit() or hi_text == "") or not body.isascii():
            return None
        if not comma and not lo_text:
            return None                 # "{}" is a literal
        if len(lo_text) > 6 or len(hi_text) > 6:
            self.fail(f"repetition count over {MAX_REPEAT}")
        lo = int(lo_text) if lo_text else 0
        hi = lo if not comma else (int(hi_text) if hi_text else None)
        return lo, hi, close + 1 - self.pos

    def atom(self) -> Node:
        c = self.take()
        if c == "(":
            return self.group()
        if c == "[":
            return self.char_class()
        if c == ".":
            return ANY_BUT_NEWLINE
        if c == "\\":
            return self.escape(in_class=False)
        if c in "*+?":
            self.pos -= 1
            self.fail("nothing to repeat")
        if c == "{" and self.braces_at(self.pos - 1):
            self.pos -= 1
            self.fail("nothing to repeat")
        if c == "^":
            self.pos -= 1
            self.fail("anchor '^' other than at the start (unsupported)")
        if c == "$":
            self.pos -= 1
            self.fail("anchor '$' other than at the end (unsupported)")
        return Chars(((ord(c), ord(c)),))

    def braces_at(self, pos: int) -> bool:
        saved, self.pos = self.pos, pos
        try:
            return self.braces() is not None
        finally:
            self.pos = saved

    def group(self) -> Node:
        if self.text.startswith("?", self.pos):
            rest = self.text[self.pos:self.pos + 4]
            if rest.startswith("?:"):
                self.pos += 2
            elif rest.startswith("?P<"):
                close = self.text.find(">", self.pos, self.end)
                name = self.text[self.pos + 3:close] if close > 0 else ""
                if not name.isidentifier():
                    self.fail("bad group name")
                self.pos = close + 1
            else:
                kinds = {"?=": "lookahead", "?!": "negative lookahead", "?<=": "lookbehind", "?<!": "negative lookbehind",
                         "?P=": "backreference (?P=name)", "?>": "atomic group", "?#": "comment group",
                         "?(": "conditional group"}
                for prefix, what in sorted(kinds.items(), key=lambda kv: -len(kv[0])):
                    if rest.startswith(prefix):
                        self.fail(f"{what} (unsupported)")
                self.fail("inline flags or unknown group extension (unsupported)")
        self.depth += 1
        if self.depth > MAX_GROUP_DEPTH:
            self.fail(f"groups nested deeper than {MAX_GROUP_DEPTH}")
        node = self.alternation()
        self.depth -= 1
        if self.peek() != ")":
            self.fail("missing ')'")
        self.pos += 1
        return node

    def escape(self, in_class: bool) -> Node:
        """After a backslash: a class (\\d) or one character; refusals name what they are."""
        c = self.take()
        if c in CLASS_ESCAPES:
            return Chars(CLASS_ESCAPES[c])
        if c in CHAR_ESCAPES:
            return literal(CHAR_ESCAPES[c])     # one character: a Concat of one Chars
        if c == "b" and in_class:
            return literal("\b")
        if c in REFUSED_ESCAPES:
            self.pos -= 1
            self.fail(f"{REFUSED_ESCAPES[c]} (unsupported)")
        if c in "xuU":
            width = {"x": 2, "u": 4, "U": 8}[c]
            digits = self.text[self.pos:self.pos + width]
            if len(digits) != width or any(d not in "0123456789abcdefABCDEF" for d in digits):
                self.fail(f"\\{c} needs {width} hex digits")
            self.pos += width
            code = int(digits, 16)
            if code > MAX_CODE_POINT:
                self.fail(f"\\{c}{digits} is past U+10FFFF")
            return Chars(((code, code),))
        if c.isdigit():
            self.pos -= 1
            self.fail("backreference or octal escape (unsupported)")
        if c.isascii() and c.isalnum():
            self.pos -= 1
            self.fail(f"unknown escape \\{c}")
        return Chars(((ord(c), ord(c)),))

    def class_item(self) -> tuple[tuple[tuple[int, int], ...], bool]:
        """One member of [...]: (its ranges, whether it is a single character that may start a range)."""
        c = self.take()
        if c != "\\":
            return ((ord(c), ord(c)),), True
        node = self.escape(in_class=True)
        if isinstance(node, Concat):          # \n, \t ...: one character
            node = node.items[0]
        assert isinstance(node, Chars)
        single = len(node.ranges) == 1 and node.ranges[0][0] == node.ranges[0][1]
        return node.ranges, single

    def char_class(self) -> Chars:
        start = self.pos - 1
        negate = self.peek() == "^"
        if negate:
            self.pos += 1
        ranges: list[tuple[int, int]] = []
        first = True
        while True:
            if self.peek() is None:
                self.pos = start
                self.fail("unterminated character set")
            if self.peek() == "]" and not first:
                self.pos += 1
                break
            first = False
            item, single = self.class_item()
            if self.peek() == "-" and self.text[self.pos + 1:self.pos + 2] not in ("]", "") and self.pos + 1 < self.end:
                self.pos += 1
                hi_item, hi_single = self.class_item()
                if not (single and hi_single):
                    self.fail("bad character range")
                lo, hi = item[0][0], hi_item[0][0]
                if lo > hi:
                    self.fail("bad character range (reversed)")
                ranges.append((lo, hi))
            else:
                ranges.extend(item)
        return Chars(_complement(ranges) if negate else _normalize(ranges))


def anchors(pattern: str) -> tuple[bool, bool]:
    """(leading ^, trailing $): what `parse` drops. Full-match ignores them; JSON Schema's `pattern`,
    which is a search, needs them back."""
    return pattern.startswith("^"), len(pattern) > 1 and pattern.endswith("$") and _unescaped_at_end(pattern)


def _unescaped_at_end(text: str) -> bool:
    """Whether the final '$' is an anchor: preceded by an even number of backslashes."""
    n = 0
    while n < len(text) - 1 and text[-2 - n] == "\\":
        n += 1
    return n % 2 == 0


# ---- printing a tree back as a pattern ----------------------------------------------------------
_META = set("\\.^$|?*+()[]{}")


_PRINTED_ESCAPES = {"\n": "\\n", "\t": "\\t", "\r": "\\r"}


def _char_text(code: int, in_class: bool) -> str:
    c = chr(code)
    if c in _PRINTED_ESCAPES:
        return _PRINTED_ESCAPES[c]
    if not c.isprintable():          # controls, unassigned and private-use code points, surrogates
        return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"
    if (in_class and c in "\\]^-[") or (not in_class and c in _META):
        return "\\" + c
    return c


def escape(text: str) -> str:
    """`text` as a pattern that matches exactly it (in this module's syntax and in Python's re)."""
    return "".join(_char_text(ord(c), in_class=False) for c in text)


MAX_REGEX_TEXT = 20_000_000      # to_regex output (a tree of nested optional members spells out exponentially)


def to_regex(node: Node, max_chars: int = MAX_REGEX_TEXT) -> str:
    """A tree as pattern text that `parse` (and Python's re) read back as the same language.
    StructuredError if the text would pass max_chars."""
    return _to_regex(node, {}, max_chars)


def _to_regex(node: Node, memo: dict[int, tuple[Node, str]], max_chars: int) -> str:
    """Memoized per node (a shared subtree is printed once); the memo holds the node too, so that
    no id is reused by a temporary node while the walk runs."""
    done = memo.get(id(node))
    if done is not None:
        return done[1]
    text = _node_text(node, memo, max_chars)
    if len(text) > max_chars:
        raise StructuredError(f"the regex text is over {max_chars:,} characters")
    memo[id(node)] = (node, text)
    return text


def _node_text(node: Node, memo: dict[int, tuple[Node, str]], max_chars: int) -> str:
    def sub(child: Node) -> str:
        return _to_regex(child, memo, max_chars)

    if isinstance(node, Chars):
        if len(node.ranges) == 1 and node.ranges[0][0] == node.ranges[0][1]:
            return _char_text(node.ranges[0][0], in_class=False)
        if not node.ranges:
            return "[^\\x00-\\U0010ffff]"     # matches nothing
        body = "".join(_char_text(lo, True) if lo == hi else f"{_char_text(lo, True)}-{_char_text(hi, True)}"
                       for lo, hi in node.ranges)
        return f"[{body}]"
    if isinstance(node, Concat):
        return "".join(f"(?:{sub(item)})" if isinstance(item, (Alt, Subsequence)) else sub(item) for item in node.items)
    if isinstance(node, Alt):
        return "|".join(sub(option) for option in node.options)
    if isinstance(node, Subsequence):
        return sub(_subsequence_as_alternation(node))
    inner = sub(node.node)
    if not isinstance(node.node, Chars):          # one character or one [class] needs no group
        inner = f"(?:{inner})"
    short = {(0, None): "*", (1, None): "+", (0, 1): "?"}.get((node.min, node.max))
    if short:
        return inner + short
    if node.min == node.max:
        return f"{inner}{{{node.min}}}"
    return f"{inner}{{{node.min},{'' if node.max is None else node.max}}}"


def _subsequence_as_alternation(node: Subsequence) -> Node:
    """The same language without Subsequence: an alternation over the first item present."""
    options: list[Node] = []
    for k, (item, required) in enumerate(zip(node.items, node.required)):
        rest: list[Node] = [Concat((node.separator, other)) if req else Repeat(Concat((node.separator, other)), 0, 1)
                            for other, req in zip(node.items[k + 1:], node.required[k + 1:])]
        options.append(Concat((item, *rest)))
        if required:
            break
    return options[0] if len(options) == 1 else Alt(tuple(options))


# ---- code points -> UTF-8 byte sequences ---------------------------------------------------------
@functools.lru_cache(maxsize=4096)
def utf8_sequences(lo: int, hi: int) -> tuple[tuple[tuple[int, int], ...], ...]:
    """The code points lo..hi as sequences of byte ranges, each sequence one fixed-length UTF-8 form.

    [U+0000, U+10FFFF] minus the surrogates becomes nine sequences, e.g. (E1-EC)(80-BF)(80-BF) for
    U+1000..U+CFFF. Splitting rule (as in Rust's regex-syntax): cut the range where the encoded
    length changes, then wherever a byte other than the last would not cover its full 80-BF span,
    until every sequence is a plain product of byte ranges. Surrogates (D800-DFFF) have no UTF-8.
    """
    out = []
    stack = [(lo, hi)]
    while stack:
        lo, hi = stack.pop()
        if lo <= 0xDFFF and hi >= 0xD800:
            if hi > 0xDFFF:
                stack.append((0xE000, hi))
            if lo < 0xD800:
                stack.append((lo, 0xD7FF))
            continue
        split = _split_point(lo, hi)
        if split is not None:
            stack.append((split + 1, hi))
            stack.append((lo, split))
            continue
        out.append(tuple(zip(chr(lo).encode(), chr(hi).encode())))
    return tuple(out)


def _split_point(lo: int, hi: int) -> int | None:
    """Where lo..hi must be cut (the last code point of its first part), or None if it is one product."""
    for bound in (0x7F, 0x7FF, 0xFFFF):        # the encoded length changes after these
        if lo <= bound < hi:
            return bound
    if hi <= 0x7F:
        return None
    for i in range(1, 4):                      # the lowest i continuation bytes must span 80-BF fully
        mask = (1 << (6 * i)) - 1
        if lo & ~mask != hi & ~mask:
            if lo & mask != 0:
                return lo | mask
            if hi & mask != mask:
                return (hi & ~mask) - 1
    return None


# ---- the NFA -----------------------------------------------------------------------------------
def nfa_size(node: Node, memo: dict[int, int] | None = None) -> int:
    """The NFA states `node` expands to (repetitions multiply), to refuse before building. Shared
    subtrees are counted once per use but computed once (a tree can be a DAG of exponential size)."""
    memo = {} if memo is None else memo
    key = id(node)
    if key in memo:
        return memo[key]
    if isinstance(node, Chars):
        size = sum(len(seq) + 1 for lo, hi in node.ranges for seq in utf8_sequences(lo, hi)) + 1
    elif isinstance(node, Concat):
        size = sum(nfa_size(item, memo) for item in node.items) + len(node.items) + 1
    elif isinstance(node, Alt):
        size = sum(nfa_size(option, memo) for option in node.options)
    elif isinstance(node, Subsequence):
        size = sum(nfa_size(item, memo) + 3 for item in node.items) + len(node.items) * nfa_size(node.separator, memo) + 1
    else:
        copies = node.max if node.max is not None else node.min + 1
        size = (nfa_size(node.node, memo) + 2) * max(copies, 1) + 2
    memo[key] = size
    return size


class _NFA:
    """Thompson's construction over bytes. Each state has epsilon moves and at most one byte-range edge."""

    def __init__(self) -> None:
        self.eps: list[list[int]] = []
        self.edge: list[tuple[int, int, int] | None] = []     # (lo byte, hi byte, target)

    def new(self) -> int:
        self.eps.append([])
        self.edge.append(None)
        return len(self.eps) - 1

    def build(self, node: Node, start: int, end: int) -> None:
        """Wire `node` from `start` to `end`. Never adds a move out of `end` or into `start`, so
        alternatives can share both."""
        if isinstance(node, Chars):
            for lo, hi in node.ranges:
                for seq in utf8_sequences(lo, hi):
                    cur = self.new()
                    self.eps[start].append(cur)
                    for i, (blo, bhi) in enumerate(seq):
                        nxt = end if i == len(seq) - 1 else self.new()
                        self.edge[cur] = (blo, bhi, nxt)
                        cur = nxt
        elif isinstance(node, Concat):
            if not node.items:
                self.eps[start].append(end)
            cur = start
            for i, item in enumerate(node.items):
                nxt = end if i == len(node.items) - 1 else self.new()
                self.build(item, cur, nxt)
                cur = nxt
        elif isinstance(node, Alt):
            for option in node.options:
                self.build(option, start, end)
        elif isinstance(node, Subsequence):
            self.subsequence(node, start, end)
        else:
            cur = self.new()
            self.eps[start].append(cur)
            for _ in range(node.min):
                nxt = self.new()
                self.build(node.node, cur, nxt)
                cur = nxt
            if node.max is None:                     # cur -> x -> back to a fresh loop head, or out
                head, tail = self.new(), self.new()
                self.eps[cur] += [head, end]
                self.build(node.node, head, tail)
                self.eps[tail] += [head, end]
            else:                                    # (x(x(x)?)?)?: nested optional copies
                for _ in range(node.max - node.min):
                    self.eps[cur].append(end)
                    nxt = self.new()
                    self.build(node.node, cur, nxt)
                    cur = nxt
                self.eps[cur].append(end)


    def subsequence(self, node: Subsequence, start: int, end: int) -> None:
        """Two rows of states: head[j], nothing taken yet and item j next (head[0] = start); tail[j],
        something taken and item j next (tail[n] = end). Item j is built once, from its own entry
        state: head[j] enters it directly, tail[j] through a separator, and either way it leads to
        tail[j+1]. An optional item may be skipped (head[j] -> head[j+1], tail[j] -> tail[j+1]);
        the head row stops at the first required item, which cannot be skipped."""
        n = len(node.items)
        tail = [self.new() for _ in range(n)] + [end]
        head = start
        heads_open = True
        for j, (item, required) in enumerate(zip(node.items, node.required)):
            entry = self.new()
            self.build(item, entry, tail[j + 1])
            if j > 0:
                self.build(node.separator, tail[j], entry)
                if not required:
                    self.eps[tail[j]].append(tail[j + 1])
            if heads_open:
                self.eps[head].append(entry)
                if required or j == n - 1:
                    heads_open = False
                else:
                    head_next = self.new()
                    self.eps[head].append(head_next)
                    head = head_next


# ---- the DFA -----------------------------------------------------------------------------------
class DFA:
    """A complete DFA over bytes. State 0 is dead: every byte leads back to it, and only it can
    never reach an accepting state (the table is minimal, or at least pruned, so all others can).

    Bytes that no transition tells apart share a class (a JSON schema's DFA has ~40 classes, not
    256), so the table is per class: next state = table[state, classes[byte]].
    table: int32 [n_states, n_classes]; classes: int32 [256]; accepting: bool [n_states].
    """

    def __init__(self, table: np.ndarray, classes: np.ndarray, accepting: np.ndarray, start: int, name: str = ""):
        self.table = np.ascontiguousarray(table, dtype=np.int32)
        self.classes = np.ascontiguousarray(classes, dtype=np.int32)
        self.accepting = np.ascontiguousarray(accepting, dtype=bool)
        self.start, self.name = start, name
        for array in (self.table, self.classes, self.accepting):
            array.setflags(write=False)
        self._flat = self.table.reshape(-1).data         # a memoryview: fast scalar reads in walk()
        self._class_of = self.classes.tolist()

    @property
    def n_states(self) -> int:
        return int(self.table.shape[0])

    @property
    def n_classes(self) -> int:
        return int(self.table.shape[1])

    def byte_table(self) -> np.ndarray:
        """int32 [n_states, 256]: the table per byte rather than per class."""
        return self.table[:, self.classes]

    def walk(self, state: int, data: bytes) -> int:
        """The state after reading `data` from `state` (0 once dead)."""
        flat, class_of, width = self._flat, self._class_of, self.n_classes
        for byte in data:
            state = flat[state * width + class_of[byte]]
            if state == 0:
                return 0
        return state

    def fullmatch(self, text: str | bytes) -> bool:
        data = text.encode("utf-8") if isinstance(text, str) else text
        return bool(self.accepting[self.walk(self.start, data)])

    def distances_to_accept(self) -> np.ndarray:
        """int32 [n_states]: the fewest bytes from each state to an accepting one (-1: never, the dead state)."""
        n, width = self.table.shape
        pairs = np.unique(self.table.reshape(-1).astype(np.int64) * n + np.repeat(np.arange(n), width))
        dst, src = pairs // n, pairs % n                 # sorted by destination
        starts = np.searchsorted(dst, np.arange(n + 1))
        dist = np.full(n, -1, np.int32)
        frontier = np.flatnonzero(self.accepting)
        dist[frontier] = 0
        d = 0
        while frontier.size:
            d += 1
            preds = np.unique(np.concatenate([src[starts[s]:starts[s + 1]] for s in frontier]))
            preds = preds[dist[preds] < 0]
            dist[preds] = d
            frontier = preds
        return dist

    def __repr__(self) -> str:
        return (f"DFA(states={self.n_states}, classes={self.n_classes}, "
                f"{self.name[:70]}{'...' if len(self.name) > 70 else ''})")


def _byte_classes(nfa: _NFA) -> tuple[np.ndarray, int]:
    """Bytes that every NFA edge treats alike share a class: [256] class ids, and the class count.
    The subset construction then works on ~20-60 classes instead of 256 bytes."""
    cuts = {0, 256}
    for e in nfa.edge:
        if e is not None:
            cuts.add(e[0])
            cuts.add(e[1] + 1)
    bounds = np.array(sorted(cuts))
    classes = np.searchsorted(bounds, np.arange(256), side="right") - 1
    return classes.astype(np.int32), len(bounds) - 1


def _subsets(nfa: _NFA, start: int, accept: int, classes: np.ndarray, n_classes: int,
             max_states: int, what: str) -> tuple[np.ndarray, np.ndarray]:
    """The subset construction: each DFA state is the set of NFA states the input so far can be in.
    Returns table [n, n_classes] (state 0 = the empty set, dead) and accepting [n]."""
    edge_cls = [None if e is None else (int(classes[e[0]]), int(classes[e[1]]), e[2]) for e in nfa.edge]
    eps = nfa.eps
    work = 0

    closures: dict[frozenset, frozenset] = {}

    def closure(targets: frozenset) -> frozenset:
        nonlocal work
        got = closures.get(targets)
        if got is None:
            seen, stack = set(targets), list(targets)
            while stack:
                moves = eps[stack.pop()]
                work += len(moves) + 1
                for t in moves:
                    if t not in seen:
                        seen.add(t)
                        stack.append(t)
            got = closures[targets] = frozenset(s for s in seen if edge_cls[s] is not None or s == accept)
        return got

    ids: dict[frozenset, int] = {frozenset(): 0}
    sets: list[frozenset] = [frozenset()]
    rows: list[list[int]] = [[0] * n_classes]
    first = closure(frozenset([start]))
    ids[first] = 1
    sets.append(first)
    i = 1
    while i < len(sets):
        edges = [e for e in (edge_cls[s] for s in sets[i]) if e is not None]
        row = [0] * n_classes
        if edges:
            cuts = sorted({lo for lo, _, _ in edges} | {hi + 1 for _, hi, _ in edges})
            work += len(edges) * len(cuts)
            for a, b in zip(cuts, cuts[1:]):
                targets = frozenset(t for lo, hi, t in edges if lo <= a <= hi)
                if not targets:
                    continue
                target_set = closure(targets)
                j = ids.get(target_set)
                if j is None:
                    if len(sets) >= max_states:
                        raise StructuredError(f"{what} needs more than {max_states:,} DFA states")
                    j = ids[target_set] = len(sets)
                    sets.append(target_set)
                row[a:b] = [j] * (b - a)
        rows.append(row)
        work += len(sets[i])
        if work > MAX_SUBSET_WORK:
            raise StructuredError(f"{what} is too complex to compile (subset construction past {MAX_SUBSET_WORK:,} steps)")
        i += 1
    accepting = np.array([accept in s for s in sets], dtype=bool)
    return np.array(rows, dtype=np.int32), accepting


def _prune_dead(table: np.ndarray, accepting: np.ndarray) -> np.ndarray:
    """[n] new ids after sending every state that cannot reach acceptance to 0 (the others renumbered)."""
    n = table.shape[0]
    live = accepting.copy()
    preds: list[set[int]] = [set() for _ in range(n)]
    for s, row in enumerate(table.tolist()):
        for t in set(row):
            preds[t].add(s)
    stack: list[int] = np.flatnonzero(accepting).tolist()
    while stack:
        for p in preds[stack.pop()]:
            if not live[p]:
                live[p] = True
                stack.append(p)
    live[0] = False
    return np.where(live, np.cumsum(live), 0).astype(np.int32)


def _minimize(table: np.ndarray, accepting: np.ndarray) -> np.ndarray | None:
    """Moore's partition refinement: [n] block ids of the minimal DFA (dead state in block 0), or None
    past MAX_MINIMIZE_WORK. Split blocks by (own block, blocks of the successors per class) until no
    block splits; states with the same future (every string accepted from one is from the other) end
    up together. Merging matters for JSON: `x(,x)*` spells x twice, and the DFA needs it only once."""
    n, n_classes = table.shape
    blocks = accepting.astype(np.int64)       # the states that cannot accept join the dead state 0
    count = int(blocks.max()) + 1
    rounds = 0
    while True:
        rounds += 1
        if rounds * n > MAX_MINIMIZE_WORK:
            return None
        signature = np.ascontiguousarray(np.concatenate([blocks[:, None], blocks[table]], axis=1).astype(np.int32))
        keys = signature.view(np.dtype((np.void, 4 * (n_classes + 1)))).ravel()
        _, new_blocks = np.unique(keys, return_inverse=True)
        new_blocks = new_blocks.reshape(-1)
        new_count = int(new_blocks.max()) + 1
        blocks = new_blocks
        if new_count == count:
            break
        count = new_count
    # renumber so that the dead state's block is 0 and the others follow in first-seen order
    order = np.full(count, -1, np.int64)
    seen = 0
    order[blocks[0]] = 0
    for b in blocks.tolist():
        if order[b] < 0:
            seen += 1
            order[b] = seen
    return order[blocks].astype(np.int32)


def _quotient(table: np.ndarray, accepting: np.ndarray, start: int, ids: np.ndarray):
    """The DFA with state s renamed ids[s] (states with the same id merged; it must be a congruence)."""
    n_new = int(ids.max()) + 1
    new_table = np.zeros((n_new, table.shape[1]), np.int32)
    new_accepting = np.zeros(n_new, bool)
    new_table[ids] = ids[table]
    new_accepting[ids] = accepting
    return new_table, new_accepting, int(ids[start])


def build_dfa(node: Node, what: str = "the constraint", max_states: int = MAX_DFA_STATES) -> DFA:
    """Tree -> minimal DFA over bytes (StructuredError past the limits). `what` names it in errors."""
    size = nfa_size(node)
    if size > MAX_NFA_STATES:
        raise StructuredError(f"{what} expands to {size:,} NFA states (at most {MAX_NFA_STATES:,}): "
                              "repetitions multiply")
    nfa = _NFA()
    start, accept = nfa.new(), nfa.new()
    nfa.build(node, start, accept)
    classes, n_classes = _byte_classes(nfa)
    table, accepting = _subsets(nfa, start, accept, classes, n_classes, max_states, what)
    ids = _minimize(table, accepting)
    if ids is None:
        ids = _prune_dead(table, accepting)
    table, accepting, start_state = _quotient(table, accepting, 1, ids)
    if start_state == 0:
        raise StructuredError(f"{what} matches no string at all")
    # classes the minimal DFA no longer tells apart (identical columns) merge too
    columns, merged = np.unique(table, axis=1, return_inverse=True)
    return DFA(columns, merged.reshape(-1)[classes], accepting, start_state, what)


@functools.lru_cache(maxsize=16)
def compile_regex(pattern: str, max_chars: int = MAX_PATTERN_CHARS, max_states: int = MAX_DFA_STATES) -> DFA:
    """`pattern` (full-match) as a minimal DFA over UTF-8 bytes; cached per pattern.
    StructuredError for unsupported syntax or a pattern past the limits."""
    return build_dfa(parse(pattern, max_chars), f"regex {pattern[:60]!r}{'...' if len(pattern) > 60 else ''}", max_states)
