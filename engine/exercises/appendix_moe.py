"""Appendix (mixture of experts) exercise: Qwen3-MoE's router, checked on its own and inside a model.

    from engine.exercises.appendix_moe import check_router, check_router_in_model
    check_router(my_router)            # fn(logits [T, E], k, norm_topk_prob) -> (weights [T, k], experts [T, k])
    check_router_in_model(my_router)   # the same function as the "moe_router" stage of a random Qwen3-MoE

The order of a token's k (expert, weight) pairs is free (the block sums over them); the pairs are not.
"""
from __future__ import annotations

import functools
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

from engine.exercises import call_learner, check_cases
from engine.ops.moe import router_ref, softmax_ref


def _cases(seed: int):
    """(logits [T, E], k, norm_topk_prob): Qwen3-30B-A3B's 128 experts and 8 per token, tiny ones, one
    expert, every expert, both settings of the renormalisation, tied logits."""
    rng = np.random.default_rng(seed)
    for T, E, k, norm in ((4, 8, 2, True), (5, 8, 2, False), (3, 128, 8, True), (6, 128, 8, False),
                          (2, 7, 7, False), (3, 5, 1, True), (4, 6, 3, True)):
        logits = (2 * rng.standard_normal((T, E))).astype(np.float32)
        if T >= 4:
            logits[-1] = 0.25                                # every expert tied: the lower indices win
            logits[-2, [1, E - 2]] = logits[-2].max() + 1    # two tied at the top
        yield logits, k, norm


def _pairs(answer, k: int):
    """The answer's rows as sorted (expert, weight) pairs: arrays [T, k] int64 and float64."""
    weights, experts = answer
    weights, experts = np.asarray(weights, dtype=np.float64), np.asarray(experts)
    if experts.dtype.kind not in "iu" or weights.shape != experts.shape or weights.ndim != 2 or weights.shape[1] != k:
        raise ValueError("not a pair of [T, k] arrays with integer experts")
    order = np.argsort(experts, axis=1, kind="stable")
    return np.take_along_axis(experts, order, 1).astype(np.int64), np.take_along_axis(weights, order, 1)


def _mismatch(got, want, k: int) -> str | None:
    """Why got (the learner's pair) is not want, or None when they agree (any order within a row)."""
    if not (isinstance(got, (tuple, list)) and len(got) == 2):
        return f"returned {type(got).__name__}; the router returns a pair (weights [T, k], experts [T, k])"
    try:
        got_e, got_w = _pairs(got, k)
    except (ValueError, TypeError):
        shapes = [getattr(np.asarray(a), "shape", "?") for a in got]
        return f"returned shapes {shapes}; weights and experts must both be [T, {k}], the experts integers"
    want_e, want_w = _pairs(want, k)
    if got_e.shape != want_e.shape:
        return f"returned {got_e.shape[0]} rows for {want_e.shape[0]} tokens"
    rows = np.flatnonzero((got_e != want_e).any(1))
    if rows.size:
        r = rows[0]
        return f"token {r}: experts {got_e[r].tolist()}, expected {want_e[r].tolist()}"
    bad = np.flatnonzero(~np.isclose(got_w, want_w, rtol=1e-5, atol=1e-7).all(1))
    if bad.size:
        r = bad[0]
        return f"token {r}: weights {np.round(got_w[r], 5).tolist()}, expected {np.round(want_w[r], 5).tolist()}"
    return None


def _top(probs: np.ndarray, k: int) -> np.ndarray:
    return np.argsort(-probs, axis=-1, kind="stable")[:, :k]


def _softmax_after_top_k(logits, k, norm):
    e = _top(logits, k)
    return softmax_ref(np.take_along_axis(logits, e, -1)), e


def _never_renormalised(logits, k, norm):
    return router_ref(logits, k, False)


def _smallest(logits, k, norm):
    p = softmax_ref(logits)
    e = np.argsort(p, axis=-1, kind="stable")[:, :k]
    w = np.take_along_axis(p, e, -1)
    return (w / w.sum(-1, keepdims=True) if norm else w), e


def _raw_logits(logits, k, norm):
    e = _top(logits, k)
    return np.take_along_axis(logits, e, -1), e


def _softmax_over_tokens(logits, k, norm):
    z = np.exp(logits - logits.max(0, keepdims=True))
    p = z / z.sum(0, keepdims=True)
    e = _top(p, k)
    w = np.take_along_axis(p, e, -1)
    return (w / w.sum(-1, keepdims=True) if norm else w), e


def _ties_to_the_higher_index(logits, k, norm):
    flipped = router_ref(logits[:, ::-1].copy(), k, norm)
    return flipped[0], logits.shape[1] - 1 - flipped[1]


_HINTS = [
    # a softmax over the k chosen logits is the k probabilities renormalised: one mistake, two spellings
    ("the weights sum to 1: the softmax ran over the k chosen logits only (after top-k), or they were "
     "renormalised although norm_topk_prob is false; without it they are the probabilities of the softmax "
     "over all E experts, which sum to less than 1", _softmax_after_top_k),
    ("the k weights were not renormalised: with norm_topk_prob they are divided by their sum", _never_renormalised),
    ("these are the k smallest probabilities: top-k keeps the largest", _smallest),
    ("the weights are the raw logits: a router's weights are softmax probabilities", _raw_logits),
    ("the softmax ran over the tokens (axis 0), not over each token's E experts (the last axis)", _softmax_over_tokens),
    ("ties went to the higher expert index; top-k of equal probabilities keeps the lower indices", _ties_to_the_higher_index),
]


def check_router(fn: Callable) -> bool:
    """fn(logits [T, E] float32, k, norm_topk_prob) -> (weights [T, k], experts [T, k]): each token's k
    experts of highest softmax probability (over all E), their probabilities as weights, divided by
    their sum when norm_topk_prob. Any order of a token's k pairs passes."""
    cases = [((logits, k, norm), router_ref(logits, k, norm)) for logits, k, norm in _cases(0)]

    def label(f, args):
        logits, k, norm = args
        return f"{getattr(f, '__name__', 'fn')}(logits {logits.shape[0]}x{logits.shape[1]}, k={k}, norm_topk_prob={norm})"

    def same(got, want):
        return _mismatch(got, want, want[1].shape[1]) is None

    def explain(got, want):
        return _mismatch(got, want, want[1].shape[1])
    return check_cases("router", fn, cases, same=same, explain=explain, hints=_HINTS, label=label, copy_args=True)


@functools.lru_cache(maxsize=2)
def _model_dir(preset: str) -> Path:
    from engine.model.random_model import write_random_model
    return write_random_model(Path(tempfile.mkdtemp(prefix="appendix-moe-")) / preset, preset, seed=5)


def _run_with_router(fn: Callable, model, model_dir: Path, ids: list[int], params):
    """(logits of one full pass, greedy tokens through the KV cache) with fn as the "moe_router" stage."""
    import engine
    from engine.plugins import use_stage
    with use_stage("moe_router", fn):
        llm = engine.LLM(model_dir, backend="numpy")
        try:
            return model.logits(ids), llm.generate([ids], params)[0].token_ids
        finally:
            llm.close()


IN_MODEL_PRESETS = ("tiny-qwen3-moe", "tiny-qwen3-moe-mqa-untied")    # weights renormalised, then raw


def check_router_in_model(fn: Callable, prompt_ids=tuple(range(3, 43))) -> bool:
    """Run two random Qwen3-MoE models (one renormalising its weights, one not) with fn as their
    "moe_router" stage: True when their logits are the engine's (to 1e-5 relative) and greedy
    generation writes the same tokens."""
    import engine
    ids = list(prompt_ids)
    params = engine.SamplingParams(max_new_tokens=8, ignore_eos=True)
    for preset in IN_MODEL_PRESETS:
        model = engine.load_model(_model_dir(preset), backend="numpy")
        want = model.logits(ids)
        reference = engine.LLM(_model_dir(preset), backend="numpy")
        want_tokens = reference.generate([ids], params)[0].token_ids
        reference.close()

        ok, result = call_learner(f"your router inside {preset}", "the model", _run_with_router, fn, model,
                                  _model_dir(preset), ids, params)
        if not ok:
            return False
        got, tokens = result
        err = float(np.abs(got - want).max() / np.abs(want).max())
        if err > 1e-5 or tokens != want_tokens:
            print(f"[x] your router inside {preset} ({model.config.num_sparse_layers} sparse layers, "
                  f"norm_topk_prob={model.config.moe.norm_topk_prob}): logits off by {err:.3g} relative; "
                  f"greedy tokens {tokens} vs the engine's {want_tokens}")
            return False
    print(f"[OK] your router inside {' and '.join(IN_MODEL_PRESETS)}: the engine's logits and greedy tokens")
    return True
