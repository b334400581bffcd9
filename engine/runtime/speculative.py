"""Speculative decoding (chapter 16): propose k tokens cheaply, let the model check them in one pass.

A batch-1 decode step reads every weight to produce one token; the same read can score k + 1
positions. So a proposer guesses the next k tokens, the model runs one *verify row* of
[last token, d1 .. dk] through the paged cache (a short prefill-style row attending to its own
prefix), and the acceptance rule keeps the longest prefix of the guesses the model agrees with, plus
one token of the model's own: every verify row yields between 1 and k + 1 tokens.

The acceptance rule (Leviathan et al. 2023, Chen et al. 2023). p_j is the model's distribution at
position j (after temperature, top-k and top-p: exactly what plain sampling draws from), q_j the
proposer's (one-hot on d_j for a deterministic proposer such as n-gram lookup):

    for j = 1 .. k:   accept d_j with probability min(1, p_j(d_j) / q_j(d_j))
                      on rejection: emit a token from norm(max(0, p_j - q_j)) and stop
    all accepted:     emit a token from p_{k+1}

Each emitted token is distributed exactly as p at its position: P(emit x) = q(x) min(1, p(x)/q(x))
+ (1 - sum_y min(p(y), q(y))) * max(0, p(x) - q(x)) / sum_y max(0, p(y) - q(y)) = min(p, q) +
max(0, p - q) = p(x). Greedy (temperature 0) is the case p = one-hot(argmax): a guess is kept iff it
is the argmax, and the emitted token is the argmax, so the output is exactly plain greedy decoding.

Proposers: `ngram_propose` (prompt lookup: the request's own prompt and output; free, and right when
the answer quotes its input: code edits, summaries with quotes, repeated structure), and a draft model
(engine/runtime/draft_model.py: a smaller model of the same tokenizer, k greedy passes of its own per
verify step, with its own paged cache).

When speculation steps aside: verify rows cost k + 1 positions of compute each. A step with many
decoding requests is no longer memory-bound, and those positions would slow it down; so a step
speculates only while it holds at most `max_batch` decoding requests (SpeculativeConfig).

This module holds the settings, the proposer and the acceptance rule (the NumPy reference
`accept_reference`, and `verify_rows`, the same rule vectorized for a whole step on the backend).
"""
from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.ops.sampling import check_finite_rows
from engine.runtime.sampling_params import step_uniforms

METHODS = ("ngram", "draft")
MAX_NUM_TOKENS = 16
NGRAM_WINDOW = 8192       # the proposer looks back at most this many tokens (bounded cost per step)
RESAMPLE_STREAM = 0x5DEECE66D     # a second stream of draws per seed: accept tests vs resampling


class SpeculativeError(ValueError):
    """A `speculative=` setting the engine cannot run."""


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_tokens: int = 4          # k: tokens proposed per verify row
    ngram_max: int = 3           # the longest suffix looked up
    ngram_min: int = 1           # the shortest
    max_batch: int = 8           # a step speculates only with at most this many decoding requests
    model: str | None = None     # method "draft": the draft model's directory (engine/runtime/draft_model.py)

    @classmethod
    def parse(cls, value) -> SpeculativeConfig | None:
        """None / False: off; a dict {"method": "ngram", "num_tokens": 4, ...}; or a SpeculativeConfig."""
        if value is None or value is False:
            return None
        if isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise SpeculativeError(f"speculative must be None or a dict like {{'method': 'ngram', 'num_tokens': 4}}, "
                                   f"got {value!r}")
        unknown = set(value) - {"method", "num_tokens", "ngram_max", "ngram_min", "max_batch", "model"}
        if unknown:
            raise SpeculativeError(f"unknown speculative setting(s) {sorted(unknown)}; known: method, num_tokens, "
                                   "ngram_max, ngram_min, max_batch, model")
        config = cls(**value)
        if config.method not in METHODS:
            raise SpeculativeError(f"speculative method must be one of {METHODS}, got {config.method!r}")
        if (config.method == "draft") != (config.model is not None):
            raise SpeculativeError("speculative method 'draft' needs a model directory ('model': DIR), and "
                                   "only it takes one")
        if config.model is not None and not isinstance(config.model, (str, os.PathLike)):
            raise SpeculativeError(f"speculative model must be a directory path, got {config.model!r}")
        for name in ("num_tokens", "ngram_max", "ngram_min", "max_batch"):
            v = getattr(config, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise SpeculativeError(f"speculative {name} must be a positive int, got {v!r}")
        if config.num_tokens > MAX_NUM_TOKENS:
            raise SpeculativeError(f"speculative num_tokens is at most {MAX_NUM_TOKENS}, got {config.num_tokens}")
        if config.ngram_min > config.ngram_max:
            raise SpeculativeError("speculative ngram_min must be <= ngram_max")
        return config

    def describe(self) -> str:
        return f"{self.method}, k={self.num_tokens}" + (f", {Path(self.model).name}" if self.model else "")

    @classmethod
    def from_cli(cls, text: str | None) -> dict | None:
        """A command line's --speculative: "ngram", "ngram:6" (k = 6), "draft:DIR" (a draft model) or a
        JSON object; None: off."""
        if text is None or text in ("", "off", "none"):
            return None
        if text.lstrip().startswith("{"):
            try:
                value = json.loads(text)
            except ValueError as exc:
                raise SpeculativeError(f"--speculative is not valid JSON: {exc}") from None
        else:
            method, _, k = text.partition(":")
            value = {"method": method}
            if method == "draft":
                value["model"] = k or None
            elif k:
                if not k.isdigit():
                    raise SpeculativeError(f"--speculative METHOD:K needs an integer K, got {text!r}")
                value["num_tokens"] = int(k)
        cls.parse(value)               # refused here, before a model loads
        return value


# ---- the proposer --------------------------------------------------------------------------------
def ngram_propose(tokens, k: int, ngram_max: int = 3, ngram_min: int = 1, window: int = NGRAM_WINDOW) -> list[int]:
    """Prompt lookup: the k tokens that followed the most recent earlier occurrence of the longest
    suffix of `tokens` (ngram_max down to ngram_min tokens long) within the last `window` tokens.
    When that continuation reaches the end of `tokens`, it goes on repeating (a sequence that loops
    with period P is predicted to keep looping). [] when no suffix occurred before. Cost: a few
    vectorized passes over the window."""
    seq = np.asarray(tokens[-window:], dtype=np.int64)
    n_tokens = seq.size
    for n in range(min(ngram_max, n_tokens - 1), ngram_min - 1, -1):
        suffix = seq[n_tokens - n:]
        # starts i < n_tokens - n with seq[i:i+n] == suffix (the suffix itself excluded)
        hits = np.flatnonzero(seq[:n_tokens - n] == suffix[0])
        for j in range(1, n):
            hits = hits[seq[hits + j] == suffix[j]]
        if hits.size:
            start = int(hits[-1]) + n            # the most recent occurrence: what followed it
            out = seq[start:start + k].tolist()
            while len(out) < k:                  # it runs into the end: the repetition goes on
                out.append(out[start + len(out) - n_tokens])
            return out
    return []


# ---- the acceptance rule -------------------------------------------------------------------------
def accept_reference(p: np.ndarray, q: np.ndarray, draft, u_accept, u_resample) -> list[int]:
    """The rule for one verify row, readable. p: [k+1, V] the model's distributions at the k + 1
    positions (rows sum to 1); q: [k, V] the proposer's for its k guesses; draft: the k guesses;
    u_accept, u_resample: k + 1 uniforms in [0, 1) each. Returns the emitted tokens: the accepted
    guesses, then one token of the model's (between 1 and k + 1 tokens)."""
    out: list[int] = []
    for j, d in enumerate(draft):
        if u_accept[j] * q[j, d] < p[j, d]:         # u < p/q, without dividing by q = 0
            out.append(int(d))
            continue
        residual = np.maximum(p[j] - q[j], 0.0)
        return out + [inverse_cdf(residual, u_resample[j])]
    return out + [inverse_cdf(p[len(draft)], u_resample[len(draft)])]


def inverse_cdf(weights: np.ndarray, u: float) -> int:
    """The token whose cumulative weight first passes u * total (weights need not sum to 1)."""
    cum = np.cumsum(weights, dtype=np.float64)
    i = int(np.searchsorted(cum, u * cum[-1], side="right"))
    return min(i, int(np.flatnonzero(weights > 0)[-1]))


@contextlib.contextmanager
def use_acceptance_rule(fn):
    """Chapter 16: run the engine's verify rows through your acceptance rule (same signature as
    accept_reference) for the span of the block (process-wide, like engine.use_stage; greedy rows
    too, as the rule with p one-hot on the argmax)."""
    previous = _ACTIVE[0]
    _ACTIVE[0] = fn
    try:
        yield fn
    finally:
        _ACTIVE[0] = previous


_ACTIVE: list = [None]          # the learner's rule while a use_acceptance_rule block is open


def verify_uniforms(seeds, steps, k: int) -> tuple[np.ndarray, np.ndarray]:
    """[R, k+1] accept-test and resample draws for R verify rows: row r's j-th position uses draws
    keyed on (seed, step + j), so a seeded request draws the same numbers on every run."""
    seeds = np.asarray(seeds, dtype=np.uint64)
    offsets = np.asarray(steps, dtype=np.uint64)[:, None] + np.arange(k + 1, dtype=np.uint64)[None, :]
    flat_seeds = np.repeat(seeds, k + 1)
    accept = step_uniforms(flat_seeds, offsets.ravel()).reshape(-1, k + 1)
    resample = step_uniforms(flat_seeds ^ np.uint64(RESAMPLE_STREAM), offsets.ravel()).reshape(-1, k + 1)
    return accept, resample


def target_probs(xp, logits, temperature: float, top_k: int, top_p: float):
    """[N, V] the distribution plain sampling draws from (engine/ops/sampling.py keep_mask: top-k with
    ties at the k-th value kept, then the smallest top set holding top_p of the mass), normalized;
    temperature 0: one-hot on the first argmax. One setting for the N rows (the positions of one row)."""
    z = logits.astype(xp.float32)
    N, V = z.shape
    if temperature == 0:
        probs = xp.zeros((N, V), dtype=xp.float32)
        probs[xp.arange(N), xp.argmax(z, axis=1)] = 1.0
        return probs
    p = xp.exp((z - z.max(axis=1, keepdims=True)) / xp.float32(temperature))
    keep = xp.ones(p.shape, dtype=bool)
    if 0 < top_k < V:
        kth = xp.sort(p, axis=1)[:, V - top_k][:, None]
        keep = p >= kth
    if top_p < 1.0:
        kept = xp.sort(xp.where(keep, p, 0), axis=1)[:, ::-1].astype(xp.float64)
        cum = xp.cumsum(kept, axis=1)
        n = (cum < top_p * cum[:, -1:]).sum(axis=1)                 # searchsorted(side="left") per row
        n = xp.minimum(n, keep.sum(axis=1) - 1)
        threshold = kept[xp.arange(N), n][:, None]
        keep &= p >= threshold.astype(xp.float32)
    mass = xp.where(keep, p, 0).astype(xp.float64)
    return mass / mass.sum(axis=1, keepdims=True)


def verify_step(xp, logits, rows, seeds: dict[int, int], is_live=None) -> list[list[int]]:
    """The tokens each verify row of a step yields. logits: [S, V] the step's logits rows (on the
    backend); rows: (Row, offset) with the row's 1 + k positions at logits[offset : offset + 1 + k].
    Greedy rows compare argmaxes (one argmax over all their positions, one copy to the host); sampled
    rows apply the rule to their target distributions. A row whose logits are not finite raises
    NonFiniteLogitsError, unless is_live(request_id) says its request has ended."""
    spans = [np.arange(offset, offset + 1 + len(row.draft)) for row, offset in rows]
    index = np.concatenate(spans)
    block = logits[index if xp is np else xp.asarray(index)]                              # [N, V]
    finite = xp.isfinite(block).all(axis=1)
    greedy_rule = _ACTIVE[0] is None
    best = xp.argmax(block, axis=1)
    both = xp.stack([best.astype(xp.int64), finite.astype(xp.int64)])
    both = both.get() if hasattr(both, "get") else both                                   # one copy
    best_host, finite_host = both[0].tolist(), both[1].astype(bool)
    out, start = [], 0
    for row, _ in rows:
        n = 1 + len(row.draft)
        ok = finite_host[start:start + n].all()
        if not ok and (is_live is None or is_live(row.request_id)):
            check_finite_rows([False], [f"request {row.request_id}, step {row.num_generated}"])
        if not ok:
            out.append([0])               # an ended request's row: its token is dropped
        elif greedy_rule and row.params.greedy:
            out.append(_accept_greedy(row.draft, best_host[start:start + n]))
        else:
            u_accept, u_resample = verify_uniforms([seeds[row.request_id]], [row.num_generated], len(row.draft))
            p = target_probs(xp, block[start:start + n], row.params.temperature, row.params.top_k, row.params.top_p)
            p = p.get() if hasattr(p, "get") else p
            q = np.zeros((len(row.draft), p.shape[1]))
            q[np.arange(len(row.draft)), row.draft] = 1.0      # n-gram lookup proposes deterministically
            rule = _ACTIVE[0] or accept_reference
            out.append([int(t) for t in rule(p, q, list(row.draft), u_accept[0], u_resample[0])])
        start += n
    return out


def _accept_greedy(draft: list[int], best: list[int]) -> list[int]:
    """Greedy: keep the guesses while each is the argmax at its position, then the argmax."""
    out: list[int] = []
    for j, d in enumerate(draft):
        if best[j] != d:
            return out + [int(best[j])]
        out.append(int(d))
    return out + [int(best[len(draft)])]
