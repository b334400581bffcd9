"""Token masks: which token ids may come next, for a request decoding under a constraint.

The DFA (regex_dfa.py) works on bytes; the model emits tokens, each a byte string. A token is
allowed in DFA state s when walking all its bytes from s ends in a live state (one from which an
accepting state can still be reached). Doing that token by token is 49,152 walks per step; instead
the vocabulary is stored once as a byte trie, and a state's mask is one walk down the trie, level by
level with NumPy, that drops a whole subtree as soon as its prefix is dead:

    frontier = [root]                      states = [s]
    for each depth: children of the frontier -> their DFA states -> keep the live ones
    mask[token] = its trie node was reached alive

Inside a JSON key only a handful of prefixes survive the first bytes; inside a free string almost
all do, and the walk costs the whole trie (100,298 nodes for SmolLM2). Measured on a 2-core CPU over
the default model's 49,152 tokens (tests/test_structured.py::test_mask_build_time, pytest -s):

    state                               cold           cached      allowed
    a JSON object's start (structural)  0.36-0.61 ms   3-6 us      2 tokens
    inside a free JSON string           3.3-5.3 ms     4-8 us      47,090 tokens

(the spread is five runs on a machine shared with other work). `CompiledConstraint` keeps each
state's mask (LRU, MASK_CACHE_BYTES per constraint), so requests with the same schema share them;
"cached" is the cost of handing out a fresh bool array. Building the vocabulary (the bytes of every
id, then the trie) takes 0.17-0.28 s, once per tokenizer (cached on it).

Special tokens (eos, <|im_start|>, ...) are not text: they are never allowed inside the constraint.
The eos ids are allowed exactly where the DFA accepts, which is how a constrained request ends.
Ids past the tokenizer's (the model's vocab_size may be padded) are never allowed.

API (what the engine calls):
    vocab = TokenVocabulary.from_tokenizer(tokenizer, vocab_size=config.vocab_size, eos_token_ids={2})
    compiled = compile_constraint("json_schema", schema, vocab)   # cached per (kind, spec) per vocabulary
    m = TokenMatcher(compiled)                 # per request
    mask = m.allowed_mask()                    # bool [vocab_size]
    m.advance(token_id)                        # StructuredError if it was not allowed
    m.is_accepting, m.is_finished, m.is_dead
"""
from __future__ import annotations

import functools
import json
import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import numpy as np

from engine.structured.json_schema import json_object_tree, schema_to_tree
from engine.structured.regex_dfa import DFA, MAX_PATTERN_CHARS, Alt, Node, StructuredError, build_dfa, literal, parse, to_regex

__all__ = ["TokenVocabulary", "CompiledConstraint", "TokenMatcher", "compile_constraint", "constraint_regex", "KINDS"]

KINDS = ("regex", "choice", "json_schema", "json_object")
MAX_COMPILED = 32                  # compiled constraints kept per vocabulary (LRU)
MASK_CACHE_BYTES = 8 << 20         # cached masks per compiled constraint (LRU, stored packed or as id lists)
MAX_SPEC_CHARS = 200_000           # a schema or choice list, as canonical JSON
MAX_CHOICES = 10_000


# ---- the vocabulary ------------------------------------------------------------------------------
class TokenVocabulary:
    """The bytes of every token id, as a trie, plus which ids are eos.

    token_bytes[i] is the text of id i, b"" for an id that is not text (special tokens, unused ids):
    such an id is never allowed, except an eos id where the constraint accepts.
    Trie arrays, nodes numbered by depth (root 0), then by parent, then by byte, so that each
    node's children are contiguous: parent int32 [N], byte uint8 [N], child_start int64 [N+1]
    (children of p: child_start[p] .. child_start[p+1]), token_node int64 [V].
    """

    def __init__(self, token_bytes: Sequence[bytes], eos_token_ids: Iterable[int] = (), vocab_size: int | None = None):
        size = len(token_bytes) if vocab_size is None else int(vocab_size)
        if size <= 0:
            raise StructuredError("a vocabulary needs at least one token id")
        self.vocab_size = size
        self.token_bytes = [bytes(b) for b in token_bytes[:size]] + [b""] * max(0, size - len(token_bytes))
        self.eos_token_ids = frozenset(int(i) for i in eos_token_ids if 0 <= int(i) < size)
        for i in self.eos_token_ids:
            self.token_bytes[i] = b""
        self.eos_ids = np.array(sorted(self.eos_token_ids), dtype=np.int64)
        self.is_text = np.array([len(b) > 0 for b in self.token_bytes], dtype=bool)    # [V]
        self._build_trie()
        self._compiled: OrderedDict[tuple[str, str], CompiledConstraint] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def from_tokenizer(cls, tokenizer, vocab_size: int | None = None,
                       eos_token_ids: Iterable[int] | None = None) -> TokenVocabulary:
        """From engine.text.tokenizer.Tokenizer: token_bytes([i]) per id, special tokens as no text.
        Cached per tokenizer object (and vocab_size, eos ids): the second call is free."""
        size = tokenizer.vocab_size if vocab_size is None else int(vocab_size)
        eos = frozenset(getattr(tokenizer, "eos_token_ids", ()) if eos_token_ids is None else eos_token_ids)
        key = (size, eos)
        with _VOCAB_LOCK:
            per_tokenizer = _VOCABS.setdefault(tokenizer, {})
            if key in per_tokenizer:
                return per_tokenizer[key]
        special = set(getattr(tokenizer, "special_token_ids", ()))
        n = min(size, tokenizer.vocab_size)
        token_bytes = [b"" if i in special else tokenizer.token_bytes([i]) for i in range(n)]
        vocab = cls(token_bytes, eos, size)
        with _VOCAB_LOCK:
            return per_tokenizer.setdefault(key, vocab)

    def _build_trie(self) -> None:
        nodes: dict[bytes, int] = {b"": 0}
        parent, byte, depth = [0], [0], [0]
        token_node = np.zeros(self.vocab_size, np.int64)
        for i, data in enumerate(self.token_bytes):
            node = nodes.get(data)
            if node is None:
                k = len(data) - 1
                while data[:k] not in nodes:        # the longest prefix already in the trie
                    k -= 1
                node = nodes[data[:k]]
                for j in range(k + 1, len(data) + 1):
                    nodes[data[:j]] = len(parent)
                    parent.append(node)
                    byte.append(data[j - 1])
                    depth.append(j)
                    node = len(parent) - 1
            token_node[i] = node
        # renumber: by depth, then by the parent's new number, then by byte (children contiguous)
        parent_a, byte_a, depth_a = np.array(parent), np.array(byte), np.array(depth)
        new_id = np.zeros(len(parent), np.int64)
        order_all = [np.array([0])]
        next_id = 1
        for d in range(1, int(depth_a.max(initial=0)) + 1):
            level = np.flatnonzero(depth_a == d)
            level = level[np.lexsort((byte_a[level], new_id[parent_a[level]]))]
            new_id[level] = np.arange(next_id, next_id + level.size)
            next_id += level.size
            order_all.append(level)
        order = np.concatenate(order_all)
        self.trie_parent = new_id[parent_a[order]].astype(np.int32)     # [N]; the root's parent is itself
        self.trie_byte = byte_a[order].astype(np.uint8)                 # [N]
        self.trie_child_start = 1 + np.searchsorted(self.trie_parent[1:], np.arange(len(order) + 1))   # [N+1]
        self.token_node = new_id[token_node]                            # [V]
        self.n_nodes = len(order)

    def __repr__(self) -> str:
        return (f"TokenVocabulary(vocab_size={self.vocab_size}, text_tokens={int(self.is_text.sum())}, "
                f"trie_nodes={self.n_nodes}, eos={sorted(self.eos_token_ids)})")


_VOCABS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_VOCAB_LOCK = threading.Lock()


# ---- a compiled constraint -----------------------------------------------------------------------
class CompiledConstraint:
    """A constraint's DFA over one vocabulary, with the masks of the states seen so far (LRU).

    Shared by every request with the same (kind, spec): compile_constraint returns the same object.
    A cached mask is stored as a list of allowed ids when few are (most states inside JSON
    structure), else as packed bits (V/8 bytes), so MASK_CACHE_BYTES holds thousands of states.
    """

    def __init__(self, kind: str, spec_json: str, tree: Node, dfa: DFA, vocab: TokenVocabulary):
        self.kind, self.spec_json, self.tree, self.dfa, self.vocab = kind, spec_json, tree, dfa, vocab
        self._node_class = dfa.classes[vocab.trie_byte]          # [N] each trie edge's byte class
        self._table = dfa.table.reshape(-1)                       # [n_states * n_classes]
        self._masks: OrderedDict[int, tuple[np.ndarray, bool, int]] = OrderedDict()   # state -> (stored, packed, n_text)
        self._mask_bytes = 0
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    @functools.cached_property
    def regex(self) -> str:
        """The constraint as regex text (for logs and learners; a big schema's can be long)."""
        return to_regex(self.tree)

    def token_end_states(self, state: int) -> np.ndarray:
        """int32 [V]: the DFA state after each token's bytes from `state` (0: dead, or not a text token).
        One pruned walk down the vocabulary trie: only live prefixes are extended."""
        vocab = self.vocab
        node_state = np.zeros(vocab.n_nodes, np.int32)             # [N]
        node_state[0] = state
        frontier = np.zeros(1, np.int64)                          # live nodes of the current depth
        states = np.array([state], np.int64)
        width = self.dfa.n_classes
        while frontier.size:
            lo = vocab.trie_child_start[frontier]
            counts = vocab.trie_child_start[frontier + 1] - lo
            total = int(counts.sum())
            if total == 0:
                break
            # the children of every frontier node, concatenated: lo[i] .. lo[i] + counts[i]
            children = np.arange(total) + np.repeat(lo - (np.cumsum(counts) - counts), counts)
            child_states = self._table[np.repeat(states, counts) * width + self._node_class[children]]
            alive = child_states != 0
            frontier, states = children[alive], child_states[alive].astype(np.int64)
            node_state[frontier] = states
        end = node_state[vocab.token_node]
        end[~vocab.is_text] = 0
        return end

    def allowed(self, state: int) -> np.ndarray:
        """bool [V]: the ids allowed in DFA `state` (eos ids iff it accepts). A new array each call."""
        entry = self._cached(state)
        stored, packed, _ = entry
        if packed:
            return np.unpackbits(stored, count=self.vocab.vocab_size).view(bool)
        mask = np.zeros(self.vocab.vocab_size, bool)
        mask[stored] = True
        return mask

    def n_text_allowed(self, state: int) -> int:
        """How many non-eos tokens may follow `state` (0 at the end of the constraint)."""
        return self._cached(state)[2]

    def _cached(self, state: int) -> tuple[np.ndarray, bool, int]:
        with self._lock:
            entry = self._masks.get(state)
            if entry is not None:
                self._masks.move_to_end(state)
                self.hits += 1
                return entry
        mask = self.token_end_states(state) != 0
        n_text = int(mask.sum())
        if self.dfa.accepting[state]:
            mask[self.vocab.eos_ids] = True
        ids = np.flatnonzero(mask).astype(np.int32)
        entry = (ids, False, n_text) if ids.nbytes * 8 < mask.size else (np.packbits(mask), True, n_text)
        with self._lock:
            self.misses += 1
            if state not in self._masks:
                self._masks[state] = entry
                self._mask_bytes += entry[0].nbytes
                while self._mask_bytes > MASK_CACHE_BYTES and len(self._masks) > 1:
                    _, (old, _, _) = self._masks.popitem(last=False)
                    self._mask_bytes -= old.nbytes
        return entry

    def next_state(self, state: int, token_id: int) -> int:
        """The DFA state after `token_id` (a text token) from `state`; 0 if it is not allowed."""
        if not 0 <= token_id < self.vocab.vocab_size or state == 0:
            return 0
        return self.dfa.walk(state, self.vocab.token_bytes[token_id])     # b"" (not text) -> state: checked by caller

    def cache_info(self) -> dict:
        return {"states_cached": len(self._masks), "bytes": self._mask_bytes, "hits": self.hits, "misses": self.misses}

    def __repr__(self) -> str:
        return f"CompiledConstraint({self.kind}, {self.dfa!r}, {self.cache_info()})"


# ---- per request ---------------------------------------------------------------------------------
class TokenMatcher:
    """One request's position in a compiled constraint: cheap to make (a state number).

    After an eos token the matcher is ended: nothing more is allowed."""

    def __init__(self, compiled: CompiledConstraint):
        self.compiled = compiled
        self.state = compiled.dfa.start
        self.ended = False           # an eos token was taken

    def allowed_mask(self) -> np.ndarray:
        """bool [vocab_size] for the current state: text tokens that keep the output matchable, and
        the eos ids exactly when the output so far is a complete match."""
        if self.ended:
            return np.zeros(self.compiled.vocab.vocab_size, bool)
        return self.compiled.allowed(self.state)

    def advance(self, token_id: int) -> None:
        """Take the sampled token (StructuredError if the mask did not allow it)."""
        token_id = int(token_id)
        vocab = self.compiled.vocab
        if self.ended:
            raise StructuredError(f"token {token_id} after the constraint ended with eos")
        if token_id in vocab.eos_token_ids:
            if not self.is_accepting:
                raise StructuredError(f"eos token {token_id} before the output matches the constraint")
            self.ended = True
            return
        nxt = self.compiled.next_state(self.state, token_id) if 0 <= token_id < vocab.vocab_size \
            and vocab.is_text[token_id] else 0
        if nxt == 0:
            shown = vocab.token_bytes[token_id] if 0 <= token_id < vocab.vocab_size else b""
            raise StructuredError(f"token {token_id} ({shown!r}) is not allowed by the constraint here")
        self.state = nxt

    def copy(self) -> TokenMatcher:
        """An independent matcher at the same position (to try tokens ahead, e.g. speculative guesses)."""
        other = TokenMatcher.__new__(TokenMatcher)
        other.compiled, other.state, other.ended = self.compiled, self.state, self.ended
        return other

    @property
    def is_accepting(self) -> bool:
        """The output so far is a complete match (eos may come now)."""
        return self.ended or bool(self.compiled.dfa.accepting[self.state])

    @property
    def is_finished(self) -> bool:
        """Accepting, and no text token can extend the output: only eos is left (or it was taken)."""
        return self.ended or (self.is_accepting and self.compiled.n_text_allowed(self.state) == 0)

    @property
    def is_dead(self) -> bool:
        """Not accepting and no token allowed: the vocabulary cannot spell any continuation (never
        happens for constraints whose bytes the vocabulary covers)."""
        return not self.is_accepting and self.compiled.n_text_allowed(self.state) == 0


# ---- compiling, with a cache ---------------------------------------------------------------------
def _canonical(kind: str, spec) -> str:
    """The cache key of a spec: its JSON, compact, keys in the given order (a schema's property order
    is the order of the output, so {"a", "b"} and {"b", "a"} are different constraints)."""
    if kind not in KINDS:
        raise StructuredError(f"unknown constraint kind {kind!r} (known: {', '.join(KINDS)})")
    if kind == "regex" and not isinstance(spec, str):
        raise StructuredError(f"a regex constraint needs a string, got {type(spec).__name__}")
    if kind == "choice" and (not isinstance(spec, (list, tuple)) or not spec or not all(isinstance(c, str) for c in spec)):
        raise StructuredError("a choice constraint needs a non-empty list of strings")
    if kind == "choice" and len(spec) > MAX_CHOICES:
        raise StructuredError(f"a choice constraint takes at most {MAX_CHOICES:,} choices, got {len(spec):,}")
    if kind == "json_schema" and not isinstance(spec, (dict, bool)):
        raise StructuredError(f"a json_schema constraint needs a schema object, got {type(spec).__name__}")
    if kind == "json_object" and spec not in (None, {}):
        raise StructuredError("a json_object constraint takes no spec (None)")
    if kind == "regex" and len(spec) > MAX_PATTERN_CHARS:
        raise StructuredError(f"regex of {len(spec):,} characters (at most {MAX_PATTERN_CHARS:,})")
    try:
        text = json.dumps(None if kind == "json_object" else spec, ensure_ascii=False, separators=(",", ":"),
                          allow_nan=False)
    except (TypeError, ValueError, RecursionError) as e:
        raise StructuredError(f"the {kind} spec is not plain JSON: {e}") from None
    if len(text) > MAX_SPEC_CHARS:
        raise StructuredError(f"the {kind} spec is {len(text):,} characters as JSON (at most {MAX_SPEC_CHARS:,})")
    return text


def constraint_regex(kind: str, spec) -> str:
    """The regex a constraint compiles to (for logs, tests and learners)."""
    return to_regex(_tree(kind, json.loads(_canonical(kind, spec))))


def _tree(kind: str, spec) -> Node:
    if kind == "regex":
        return parse(spec)
    if kind == "choice":
        options = tuple(literal(choice) for choice in spec)
        return options[0] if len(options) == 1 else Alt(options)
    if kind == "json_schema":
        return schema_to_tree(spec)
    return json_object_tree()


def compile_constraint(kind: str, spec, vocab: TokenVocabulary) -> CompiledConstraint:
    """The constraint (kind: regex / choice / json_schema / json_object) compiled for `vocab`.
    The same (kind, spec) compiles once per vocabulary (an LRU of MAX_COMPILED); the mask cache
    lives in the returned object, so it is shared too. StructuredError if refused."""
    key = (kind, _canonical(kind, spec))
    with vocab._lock:
        compiled = vocab._compiled.get(key)
        if compiled is not None:
            vocab._compiled.move_to_end(key)
            return compiled
    what = f"regex {spec[:60]!r}" if kind == "regex" else f"the {kind} constraint"
    try:
        tree = _tree(kind, json.loads(key[1]))
        dfa = build_dfa(tree, what)
    except RecursionError:
        raise StructuredError(f"the {kind} constraint nests too deeply") from None
    compiled = CompiledConstraint(kind, key[1], tree, dfa, vocab)
    with vocab._lock:
        compiled = vocab._compiled.setdefault(key, compiled)
        vocab._compiled.move_to_end(key)
        while len(vocab._compiled) > MAX_COMPILED:
            vocab._compiled.popitem(last=False)
    return compiled
