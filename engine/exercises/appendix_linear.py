"""Appendix (linear attention) exercises: the gated delta rule's recurrent step and its chunked form.

Both work on ONE head whose q and k are already L2-normalised (q also scaled by 1/sqrt(Dk)):
    step(S [Dk, Dv], q [Dk], k [Dk], v [Dv], g, beta) -> (o [Dv], S_new [Dk, Dv])
    chunked(q [T, Dk], k [T, Dk], v [T, Dv], g [T], beta [T], S0 [Dk, Dv], chunk_size) -> (o [T, Dv], S [Dk, Dv])
The checkers hold them to the engine's references (engine/ops/gated_delta.py), each on cases chosen so
that the usual mistakes show (Dk != Dv, strong and weak decay, sequences over several chunks and not
a multiple of the chunk, a nonzero initial state), and name the mistake a wrong answer looks like.
`as_stage(chunked)` turns a chunked function into the engine's "gated_delta" stage, so the Qwen3.5
model runs through it (engine.use_stage("gated_delta", as_stage(chunked))).
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np

from engine.exercises.ch03 import run_array_checks
from engine.ops.gated_delta import gated_delta_step_ref, l2norm, solve_unit_lower


def _part(fn: Callable, i: int) -> Callable:
    """Half i of fn's (o, S): each half is checked on its own, so a wrong value is shown where it is."""
    def part(*args):
        result = fn(*args)
        if not (isinstance(result, tuple) and len(result) == 2):
            raise TypeError(f"return a pair (o, S), got {type(result).__name__}")
        return np.asarray(result[i], dtype=np.float32)
    part.__name__ = getattr(fn, "__name__", "fn")
    return part


def _check_pair(title: str, fn: Callable, reference: Callable, cases: list, hints=()) -> bool:
    """fn's output o, then its state S, against the reference's on every case (stops at the first failure)."""
    return all(run_array_checks(f"{title}, {what}", _part(fn, i), [(args, _part(reference, i)(*args)) for args in cases],
                                rtol=1e-4, atol=1e-5, hints=[(text, _part(mistake, i)) for text, mistake in hints])
               for i, what in enumerate(("the output o", "the new state S")))


def _head(rng, T: int, Dk: int, Dv: int, decay: float):
    """One head's q (normalised, scaled), k (normalised), v, g [T] (about -decay per token), beta [T]."""
    q = l2norm(rng.standard_normal((T, Dk)).astype(np.float32)) * np.float32(Dk ** -0.5)
    k = l2norm(rng.standard_normal((T, Dk)).astype(np.float32))
    v = rng.standard_normal((T, Dv)).astype(np.float32)
    g = (-decay * rng.uniform(0.2, 1.8, T)).astype(np.float32)
    beta = rng.uniform(0.05, 0.95, T).astype(np.float32)
    return q, k, v, g, beta


# ---- the recurrent step --------------------------------------------------------------------------

def reference_step(S, q, k, v, g, beta):
    """The engine's step on one head: (o [Dv], S_new [Dk, Dv]); S is not modified."""
    S = np.array(S, dtype=np.float32)[None]
    o = gated_delta_step_ref(q[None], k[None], v[None], np.float32([g]), np.float32([beta]), S)
    return o[0], S[0]


def _step_mistake(kind: str) -> Callable:
    def step(S, q, k, v, g, beta):
        S = np.asarray(S, np.float32)
        decay = np.float32(g) if kind == "g not exponentiated" else np.exp(np.float32(g))
        Sd = S * decay
        if kind == "no delta":                                     # plain (gated) linear attention
            new = Sd + beta * np.outer(k, v)
        elif kind == "decay after the write":
            new = (S + beta * np.outer(k, v - S.T @ k)) * decay
        elif kind == "prediction from the old state":
            new = Sd + beta * np.outer(k, v - S.T @ k)
        elif kind == "no beta":
            new = Sd + np.outer(k, v - Sd.T @ k)
        else:
            new = Sd + beta * np.outer(k, v - Sd.T @ k)
        o = (Sd if kind == "read before the write" else new).T @ q
        return o.astype(np.float32), new.astype(np.float32)
    return step


STEP_HINTS = [
    ("the state was read before this token's write: o = S_new^T q, after the update", "read before the write"),
    ("no delta: that is plain linear attention (S += beta k v^T); the delta rule writes the correction "
     "beta k (v - S^T k)^T, so an old value stored under k is replaced, not added to", "no delta"),
    ("the decay came after the write: decay the state first (S <- e^g S), then correct it", "decay after the write"),
    ("the prediction k^T S was taken from the state before its decay: decay first, then predict", "prediction from "
     "the old state"),
    ("beta is missing: the correction is scaled by beta (the step size, in (0, 1))", "no beta"),
    ("g is the LOG of the decay: the state is multiplied by exp(g), not by g", "g not exponentiated"),
]


def _step_cases():
    rng = np.random.default_rng(0)
    for Dk, Dv, decay in ((4, 6, 0.3), (16, 8, 2.0), (8, 8, 0.01), (32, 24, 0.5)):
        q, k, v, g, beta = _head(rng, 1, Dk, Dv, decay)
        S = (0.7 * rng.standard_normal((Dk, Dv))).astype(np.float32)
        yield S, q[0], k[0], v[0], float(g[0]), float(beta[0])


def check_delta_step(fn: Callable) -> bool:
    """fn(S [Dk, Dv], q [Dk], k [Dk], v [Dv], g, beta) -> (o [Dv], S_new [Dk, Dv])."""
    hints = [(text, _step_mistake(kind)) for text, kind in STEP_HINTS]
    return _check_pair("gated delta step", fn, reference_step, list(_step_cases()), hints)


# ---- the chunked form ----------------------------------------------------------------------------

def reference_recurrence(q, k, v, g, beta, S0):
    """(o [T, Dv], S [Dk, Dv]): the step, token after token."""
    S, out = np.array(S0, np.float32), []
    for t in range(len(q)):
        o, S = reference_step(S, q[t], k[t], v[t], g[t], beta[t])
        out.append(o)
    return np.stack(out), S


def chunked_variant(q, k, v, g, beta, S0, chunk_size: int, mistake: str | None = None):
    """The chunked form on one head, or (mistake) a version with one of the usual errors in it."""
    T, Dk = k.shape
    S, out = np.array(S0, np.float32), np.empty((T, v.shape[1]), np.float32)
    for c0 in range(0, T, chunk_size):
        Q, K, V, B = q[c0:c0 + chunk_size], k[c0:c0 + chunk_size], v[c0:c0 + chunk_size], beta[c0:c0 + chunk_size]
        G = np.cumsum(g[c0:c0 + chunk_size]).astype(np.float32)
        n = len(G)
        below = np.tril(np.ones((n, n), bool), -1)
        on_or_below = below if mistake == "strict mask" else np.tril(np.ones((n, n), bool))
        gap = np.zeros((n, n), np.float32) if mistake == "no decay inside" else G[:, None] - G[None, :]
        decay = np.exp(np.where(np.tril(np.ones((n, n), bool)), gap, -np.inf))
        A = np.where(below, (B[:, None] * K) @ K.T * decay, 0.0).astype(np.float32)
        rhs = np.concatenate([B[:, None] * V, B[:, None] * K * np.exp(G)[:, None]], axis=1)
        X = rhs if mistake == "no solve" else solve_unit_lower(A, rhs)
        U, W = X[:, :V.shape[1]], X[:, V.shape[1]:]
        v_new = U if mistake == "no correction" else U - W @ S
        reads = Q @ S if mistake == "state not decayed" else (Q * np.exp(G)[:, None]) @ S
        out[c0:c0 + n] = reads + np.where(on_or_below, Q @ K.T * decay, 0.0) @ v_new
        to_end = K if mistake == "keys not decayed" else K * np.exp(G[-1] - G)[:, None]
        S = (S * np.exp(G[-1]) + to_end.T @ v_new).astype(np.float32)
    return out, S


CHUNKED_HINTS = [
    ("the chunk's own attention left out the diagonal: token i reads its own write, mask j <= i", "strict mask"),
    ("the decays inside the chunk were left out: entry (i, j) carries exp(G_i - G_j), the decay between "
     "positions j and i", "no decay inside"),
    ("the triangular system was not solved: U and W come from (I + A)^-1 applied to [beta V | beta K e^G], "
     "because each write in the chunk changes what the next one corrects", "no solve"),
    ("the correction W S is missing: v_new = U - W S subtracts what the state entering the chunk already "
     "predicts (it only shows from the second chunk on, or with an initial state)", "no correction"),
    ("the state entering the chunk was read without its decay: position i sees it times exp(G_i)",
     "state not decayed"),
    ("the new state's keys were not decayed to the end of the chunk: K exp(G_last - G) before K^T v_new",
     "keys not decayed"),
]


def _chunked_cases():
    rng = np.random.default_rng(1)
    for T, Dk, Dv, chunk, decay, start in ((5, 4, 6, 8, 0.3, False), (37, 8, 5, 16, 0.2, True),
                                           (16, 6, 6, 4, 1.0, True), (50, 12, 7, 8, 0.05, False)):
        q, k, v, g, beta = _head(rng, T, Dk, Dv, decay)
        S0 = (0.5 * rng.standard_normal((Dk, Dv)) if start else np.zeros((Dk, Dv))).astype(np.float32)
        yield q, k, v, g, beta, S0, chunk


def check_chunked(fn: Callable, step: Callable | None = None) -> bool:
    """fn(q [T, Dk], k [T, Dk], v [T, Dv], g [T], beta [T], S0 [Dk, Dv], chunk_size) -> (o [T, Dv], S):
    the same numbers as the recurrence (the engine's, and your `step` when given, token after token)."""
    cases = list(_chunked_cases())
    hints = [(text, functools.partial(chunked_variant, mistake=kind)) for text, kind in CHUNKED_HINTS]
    ok = _check_pair("chunked gated delta", fn, lambda *a: reference_recurrence(*a[:6]), cases, hints)
    if ok and step is not None:
        def your_recurrence(q, k, v, g, beta, S0, chunk_size):
            S, out = np.array(S0, np.float32), []
            for t in range(len(q)):
                o, S = step(S, q[t], k[t], v[t], float(g[t]), float(beta[t]))
                out.append(np.asarray(o, np.float32))
            return np.stack(out), np.asarray(S, np.float32)
        ok = _check_pair("your chunked form == your recurrent step", your_recurrence, fn, cases)
    return ok


def as_stage(chunked: Callable, chunk_size: int = 64) -> Callable:
    """Your one-head chunked function as the engine's "gated_delta" stage (engine/plugins.py): q and k
    normalised, q scaled, key heads repeated for the value heads, then your function once per head."""
    def stage(q, k, v, g, beta, state):
        Hk, Dk = k.shape[1:]
        Hv = v.shape[1]
        q = np.repeat(l2norm(q.astype(np.float32)), Hv // Hk, axis=1) * np.float32(Dk ** -0.5)
        k = np.repeat(l2norm(k.astype(np.float32)), Hv // Hk, axis=1)
        out, new = np.empty(v.shape, np.float32), np.empty(state.shape, np.float32)
        for h in range(Hv):
            out[:, h], new[h] = chunked(q[:, h], k[:, h], v[:, h], g[:, h], beta[:, h], state[h], chunk_size)
        return out, new
    return stage
