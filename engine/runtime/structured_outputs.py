"""Structured outputs in the runner (chapter 17): each constrained request's token automaton
(engine/structured/) and the mask of the tokens it allows next.

A request's automaton state is a function of its generated tokens, so the runner keeps one matcher per
request and advances it over the tokens generated since it last looked (row.history); when they do not
continue what it saw (a failed step was retried), it starts again from the empty output. Matchers are
kept for the most recent requests only (an evicted one is rebuilt from its tokens), so nothing needs
to tell the runner that a request ended. Compiled constraints and per-state masks are cached by
engine/structured, so a schema that many requests share compiles once and each state's mask is built
once.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np

KEEP_MATCHERS = 4096


class StructuredOutputs:
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: set[int]):
        self.tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, set(eos_token_ids)
        self._vocab: Any = None               # engine.structured.TokenVocabulary, built on first use
        self._matchers: OrderedDict[int, tuple[Any, int, list[int]]] = OrderedDict()

    def compile(self, structured: tuple):
        """The compiled constraint (StructuredError, a ValueError, for a bad one)."""
        from engine.structured import StructuredError, TokenVocabulary, compile_constraint
        if self.tokenizer is None:
            raise StructuredError("structured outputs need the model's tokenizer.json")
        if self._vocab is None:
            self._vocab = TokenVocabulary.from_tokenizer(self.tokenizer, vocab_size=self.vocab_size,
                                                         eos_token_ids=self.eos_token_ids)
        kind, spec = structured
        return compile_constraint(kind, spec, self._vocab)

    def mask(self, request_id: int, structured: tuple, output: list[int]) -> np.ndarray:
        """bool [V]: the tokens the request's constraint allows after `output`."""
        from engine.structured import TokenMatcher
        entry = self._matchers.pop(request_id, None)
        if entry is None or entry[1] > len(output) or output[:entry[1]] != entry[2][:entry[1]]:
            entry = (TokenMatcher(self.compile(structured)), 0, [])
        matcher, seen, _ = entry
        for token in output[seen:]:
            matcher.advance(token)
        self._matchers[request_id] = (matcher, len(output), list(output))
        while len(self._matchers) > KEEP_MATCHERS:
            self._matchers.popitem(last=False)
        return matcher.allowed_mask()
