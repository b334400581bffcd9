"""Logits processing between the model and the draw (chapter 08's sampler, extended): what a request's
penalties, logit bias, min-p and structured output do to its row of logits before temperature, top-k
and top-p. The order is vLLM's:

    allowed      a structured output's mask: every token the automaton refuses gets -inf
    logit_bias   the request's bias added to its tokens' logits
    repetition   a token of the prompt or the output: z / r if z > 0, else z * r (r > 1 discourages)
    presence     minus presence_penalty for each token the output holds, minus frequency_penalty
    frequency    times its count there (OpenAI's definition: the output only, not the prompt)
    min_p        after temperature T, p_i / p_max < min_p drops a token: z_i < z_max + T * ln(min_p)

`process_row_ref` is the readable one-row reference. For a batch on the backend (NumPy or CuPy),
`masked_logits` makes the float32 copy the sampler reads with every structured output's mask applied
(on the GPU one kernel, kernels_cu/logits_mask.cu: a step of hundreds of constrained rows is one launch,
not a chain of gathers and scatters), and `process_logits` does the rest, touching only the (row,
token) pairs concerned: a request's unique tokens, not the whole [R, V] matrix, so its cost is the
tokens of the requests that ask for penalties.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from engine.backend import load_kernel

MASK_THREADS = 256

def process_row_ref(z: np.ndarray, params, prompt: list[int], output: list[int],
                    allowed: np.ndarray | None = None) -> np.ndarray:
    """One row [V] of logits after the request's processing (a copy, float32)."""
    z = z.astype(np.float32).copy()
    V = z.size
    if allowed is not None:
        z[~allowed[:V]] = -np.inf
    for token, bias in params.logit_bias:
        if token < V:
            z[token] += np.float32(bias)
    if params.repetition_penalty != 1.0:
        for token in set(prompt) | set(output):
            if token < V:
                z[token] = z[token] / params.repetition_penalty if z[token] > 0 else z[token] * params.repetition_penalty
    if params.presence_penalty or params.frequency_penalty:
        for token in set(output):
            if token < V:
                z[token] -= np.float32(params.presence_penalty + params.frequency_penalty * output.count(token))
    if params.min_p > 0 and params.temperature > 0:
        z[z < z.max() + np.float32(params.temperature * math.log(params.min_p))] = -np.inf
    return z


def masked_logits(xp, logits, table, slots: np.ndarray):
    """A float32 copy of logits [R, V] with -inf wherever row r's mask refuses a token: the mask is
    table[slots[r]] (bool [S, >= V], on the backend), and a row whose slot is -1 has none."""
    R, V = logits.shape
    if table is None or not (slots >= 0).any():
        return logits.astype(xp.float32, copy=True)
    if xp is np:
        out = logits.astype(np.float32, copy=True)
        rows = np.flatnonzero(slots >= 0)
        out[rows] = np.where(table[slots[rows], :V], out[rows], np.float32(-np.inf))
        return out
    src = xp.ascontiguousarray(logits, dtype=xp.float32)
    out = xp.empty((R, V), dtype=xp.float32)
    blocks = min(-(-V // (4 * MASK_THREADS)), 64)       # each thread a few tokens of its row
    load_kernel("logits_mask", "masked_copy_rows")((blocks, R), (MASK_THREADS,), (
        src, table, xp.asarray(slots.astype(np.int32, copy=False)), out, np.int32(V), np.int32(table.shape[1])))
    return out


def process_logits(xp, logits, rows: list[tuple[int, Any, list[int], list[int]]]):
    """logits [R, V] (float32, modified in place and returned) after each listed row's logit bias,
    penalties and min-p (a structured output's mask comes first: masked_logits).

    rows: (row index, params, prompt ids, output ids) of the rows that ask for any of them."""
    V = logits.shape[1]
    bias_r, bias_t, bias_v = [], [], []
    rep_r, rep_t, rep_f = [], [], []
    pen_r, pen_t, pen_v = [], [], []
    for r, params, prompt, output in rows:
        for token, bias in params.logit_bias:
            if token < V:
                bias_r.append(r)
                bias_t.append(token)
                bias_v.append(bias)
        if params.repetition_penalty != 1.0:
            seen = np.unique(np.asarray(list(prompt) + list(output), dtype=np.int64))
            seen = seen[seen < V]
            rep_r += [r] * seen.size
            rep_t += seen.tolist()
            rep_f += [params.repetition_penalty] * seen.size
        if (params.presence_penalty or params.frequency_penalty) and output:
            tokens, counts = np.unique(np.asarray(output, dtype=np.int64), return_counts=True)
            keep = tokens < V
            pen_r += [r] * int(keep.sum())
            pen_t += tokens[keep].tolist()
            pen_v += (params.presence_penalty + params.frequency_penalty * counts[keep]).tolist()

    def at(r_list, t_list):
        return tuple(np.asarray(v, dtype=np.int64) if xp is np else xp.asarray(np.asarray(v, dtype=np.int64))
                     for v in (r_list, t_list))

    def values(v):
        a = np.asarray(v, dtype=np.float32)
        return a if xp is np else xp.asarray(a)

    if bias_r:        # one (row, token) pair per entry: no duplicates within a row, so += is exact
        logits[at(bias_r, bias_t)] += values(bias_v)
    if rep_r:
        where = at(rep_r, rep_t)
        z, f = logits[where], values(rep_f)
        logits[where] = xp.where(z > 0, z / f, z * f)
    if pen_r:
        logits[at(pen_r, pen_t)] -= values(pen_v)
    min_p = [(r, params) for r, params, _, _ in rows if params.min_p > 0 and params.temperature > 0]
    if min_p:
        sel = np.asarray([r for r, _ in min_p]) if xp is np else xp.asarray([r for r, _ in min_p])
        cut = values([p.temperature * math.log(p.min_p) for _, p in min_p])[:, None]     # [M, 1]
        z = logits[sel]
        logits[sel] = xp.where(z < z.max(axis=1, keepdims=True) + cut, xp.float32(-np.inf), z)
    return logits


def token_logprobs(xp, logits, rows, token_ids, k: int):
    """Log-probabilities under the rows' own distribution (log-softmax of the logits as given).

    logits [R, V]; rows: indices of the rows asked for; token_ids [R] (on the backend): the sampled ids;
    k: alternatives per row. Returns (chosen [L], top ids [L, k], top logprobs [L, k]) on the backend,
    the alternatives most likely first."""
    sel = np.asarray(rows) if xp is np else xp.asarray(rows)
    z = logits[sel].astype(xp.float32)                                                   # [L, V]
    m = z.max(axis=1, keepdims=True)
    lp = z - (m + xp.log(xp.exp(z - m).sum(axis=1, keepdims=True)))                      # [L, V]
    chosen = xp.take_along_axis(lp, token_ids[sel].astype(xp.int64)[:, None], axis=1)[:, 0]   # [L]
    top = xp.argsort(-lp, axis=1)[:, :k]                                                 # [L, k]
    return chosen, top, xp.take_along_axis(lp, top, axis=1)
