"""Structured outputs in the runner (chapter 17): each constrained request's token automaton
(engine/structured/) and the mask of the tokens it allows next.

A request's automaton state is a function of its generated tokens, so the runner keeps one matcher per
request and advances it over the tokens generated since it last looked (row.history); when they do not
continue what it saw (a failed step was retried), it starts again from the empty output. Matchers are
kept for the most recent requests only (an evicted one is rebuilt from its tokens), so nothing needs
to tell the runner that a request ended. Compiled constraints and per-state masks are cached by
engine/structured, so a schema that many requests share compiles once and each state's mask is built
once; the runner keeps each (constraint, state) mask in a table on the device as well, so a step of
many constrained rows uploads only the masks of states it has not seen and gathers the rows' masks
with one index, not one [V] upload per row.

What it costs is counted: `mask_seconds` (host time spent advancing matchers and finding masks, on
the engine loop), `masks_built` (states whose mask was made or uploaded) and `masks_reused`.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any

import numpy as np

KEEP_MATCHERS = 4096
DEVICE_MASK_BYTES = 256 * 2**20       # the device table of masks (more rows than a step holds: MIN_SLOTS)
MIN_SLOTS = 2048


class StructuredOutputs:
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: set[int], xp=np):
        self.tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, set(eos_token_ids)
        self.xp = xp
        self._vocab: Any = None               # engine.structured.TokenVocabulary, built on first use
        self._matchers: OrderedDict[int, tuple[Any, int, list[int]]] = OrderedDict()
        # every (constraint, state, ended) mask met so far, one row each of a table on the device: a step
        # gathers its rows' masks with one index (least recently used rows are written over)
        self.capacity = max(MIN_SLOTS, DEVICE_MASK_BYTES // max(1, vocab_size))
        self.table: Any = None                                  # bool [capacity, V], made on first use
        self._slots: OrderedDict[tuple, tuple[int, Any]] = OrderedDict()
        self.mask_seconds = 0.0
        self.masks_built = self.masks_reused = 0

    def compile(self, structured: tuple):
        """The compiled constraint (StructuredError, a ValueError, for a bad one)."""
        from engine.structured.regex_dfa import StructuredError
        from engine.structured.token_mask import TokenVocabulary, compile_constraint
        if self.tokenizer is None:
            raise StructuredError("structured outputs need the model's tokenizer.json")
        if self._vocab is None:
            self._vocab = TokenVocabulary.from_tokenizer(self.tokenizer, vocab_size=self.vocab_size,
                                                         eos_token_ids=self.eos_token_ids)
        kind, spec = structured
        return compile_constraint(kind, spec, self._vocab)

    def slot(self, request_id: int, structured: tuple, output: list[int]) -> int:
        """The row of `table` holding the tokens the request's constraint allows after `output`."""
        from engine.structured.token_mask import TokenMatcher
        t0 = time.perf_counter()
        entry = self._matchers.pop(request_id, None)
        if entry is None or entry[1] > len(output) or output[:entry[1]] != entry[2][:entry[1]]:
            entry = (TokenMatcher(self.compile(structured)), 0, [])
        matcher, seen, _ = entry
        for token in output[seen:]:
            matcher.advance(token)
        self._matchers[request_id] = (matcher, len(output), list(output))
        while len(self._matchers) > KEEP_MATCHERS:
            self._matchers.popitem(last=False)
        key = (id(matcher.compiled), matcher.state, matcher.ended)
        held = self._slots.pop(key, None)
        if held is None or held[1] is not matcher.compiled:     # (an id reused by a newer constraint)
            self.masks_built += 1
            if self.table is None:
                self.table = self.xp.zeros((self.capacity, self.vocab_size), dtype=bool)
            slot = len(self._slots) if len(self._slots) < self.capacity else self._slots.popitem(last=False)[1][0]
            self.table[slot] = self.xp.asarray(matcher.allowed_mask())
            held = (slot, matcher.compiled)
        else:
            self.masks_reused += 1
        self._slots[key] = held
        self.mask_seconds += time.perf_counter() - t0
        return held[0]
