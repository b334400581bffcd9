"""Structured outputs in the runner (chapter 17): each constrained request's token automaton
(engine/structured/) and the mask of the tokens it allows next.

A request's automaton state is a function of its generated tokens, so the runner keeps one matcher per
request and advances it over the tokens generated since it last looked (row.history: one per step);
when they do not continue what it saw (a failed step was retried: its token is gone), it starts
again from the empty output. Matchers are kept for the most recent requests only (an evicted one is
rebuilt from its tokens), so nothing needs to tell the runner that a request ended. Compiled
constraints and per-state masks are cached by engine/structured, so a schema that many requests
share compiles once and each state's mask is built once; the runner keeps each (constraint, state)
mask in a table on the device as well, so a step of many constrained rows uploads only the masks of
states it has not seen and gathers the rows' masks with one index, not one [V] upload per row.

This runs for every constrained row of every step, on the engine loop's thread, so it is kept to a
few dictionary operations per row: with async scheduling it overlaps the device's forward pass
(ModelRunner.finish), and at hundreds of rows per step the loop's own time is what bounds a small
model's throughput.

What it costs is counted: `mask_seconds` (host time spent advancing matchers and finding masks, on
the engine loop), `masks_built` (states whose mask was made or uploaded) and `masks_reused`.
"""
from __future__ import annotations

import time
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
        self._matchers: dict[int, list] = {}      # request id -> [matcher, tokens it took, the last one, spec]
        # every (constraint, state, ended) mask met so far, one row each of a table on the device: a step
        # gathers its rows' masks with one index
        self.capacity = max(MIN_SLOTS, DEVICE_MASK_BYTES // max(1, vocab_size))
        self.table: Any = None                                  # bool [capacity, V], made on first use
        self._slots: dict[tuple, tuple[int, Any]] = {}
        self._rows_used = 0                   # rows of `table` written since it was last given up
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

    def slots(self, requests: list[tuple[int, tuple, list[int]]]) -> list[int]:
        """The rows of `table` holding the tokens each (request id, constraint, output ids) allows next."""
        from engine.structured.token_mask import TokenMatcher
        t0 = time.perf_counter()
        out = []
        matchers, slots = self._matchers, self._slots
        if self._rows_used + len(requests) > self.capacity:   # the table is full: every row is given up,
            slots.clear()                                     # and the masks in use come back one by one
            self._rows_used = 0
        built = self.masks_built
        for request_id, structured, output in requests:
            entry = matchers.get(request_id)
            n = len(output)
            # another request under a reused id (a hand-driven scheduler restarts ids), or a failed step
            # took its token back (tokens never change once a step completes)
            if entry is None or entry[3] is not structured or entry[1] > n \
                    or (entry[1] and output[entry[1] - 1] != entry[2]):
                entry = [TokenMatcher(self.compile(structured)), 0, None, structured]
                matchers.pop(request_id, None)
                matchers[request_id] = entry
                while len(matchers) > KEEP_MATCHERS:        # the least recently started requests go
                    del matchers[next(iter(matchers))]
            matcher = entry[0]
            for token in output[entry[1]:]:
                matcher.advance(token)
            entry[1], entry[2] = n, (output[-1] if n else None)
            key = (id(matcher.compiled), matcher.state, matcher.ended)
            held = slots.get(key)
            if held is None or held[1] is not matcher.compiled:     # (an id reused by a newer constraint)
                held = slots[key] = (self._upload(matcher), matcher.compiled)
                self.masks_built += 1
            out.append(held[0])
        self.masks_reused += len(out) - (self.masks_built - built)
        self.mask_seconds += time.perf_counter() - t0
        return out

    def _upload(self, matcher) -> int:
        """The next free row of `table`, with the matcher's mask written in it (a row is never reused
        before the table is given up: a key whose constraint id was reused gets a new row too)."""
        if self.table is None:
            self.table = self.xp.zeros((self.capacity, self.vocab_size), dtype=bool)
        slot, self._rows_used = self._rows_used, self._rows_used + 1
        self.table[slot] = self.xp.asarray(matcher.allowed_mask())
        return slot
