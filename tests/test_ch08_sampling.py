"""Sampling (chapter 08): parameter validation, the reference sampler's distribution, keep_mask
semantics, and seeded reproducibility through the whole engine.

The expected distribution is computed independently in float64: softmax(z / T), keep the tokens at
least as likely as the k-th (ties kept), then the smallest most-likely set holding top_p of what
top-k kept, renormalize. sample_ref is an inverse CDF, so a uniform grid of u gives frequencies that
must match those probabilities to within 1/N; seeded draws from step_uniform are checked with a
chi-square statistic.

Edge case where the engine differs from transformers' TopPLogitsWarper, by design: when several
tokens tie at the top-p cut, the engine keeps all of them (the cut is a value, like top-k's), while
transformers keeps only some, chosen by its sort order. With probabilities [0.4, 0.2, 0.2, 0.2] and
top_p=0.5 the engine keeps all four tokens, transformers keeps two. Without ties they agree (tested
live below).
"""
import math

import numpy as np
import pytest
from helpers.oracle import gen_model_dir, greedy_no_cache, needs_transformers
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.model.forward_pass import load_model
from engine.ops.sampling import keep_mask, sample, sample_ref
from engine.runtime.chat_session import ChatSession
from engine.runtime.llm import LLM
from engine.runtime.sampling_params import SamplingParams, step_uniform, step_uniforms

MAX_CONTEXT = 64


# ---- SamplingParams validation -----------------------------------------------------------------

@pytest.mark.parametrize("kwargs", [
    {"temperature": -0.1}, {"temperature": -1}, {"temperature": math.nan}, {"temperature": math.inf},
    {"temperature": True}, {"temperature": "1"}, {"temperature": None},
    {"top_p": 0.0}, {"top_p": -0.5}, {"top_p": 1.0001}, {"top_p": 2}, {"top_p": math.nan}, {"top_p": True},
    {"top_p": None},
    {"top_k": -1}, {"top_k": 1.5}, {"top_k": True}, {"top_k": None},
    {"max_new_tokens": -1}, {"max_new_tokens": 2.0}, {"max_new_tokens": True}, {"max_new_tokens": None},
    {"seed": -1}, {"seed": 1.5}, {"seed": True},
    {"ignore_eos": 1}, {"ignore_eos": "yes"}, {"ignore_eos": None},
], ids=repr)
def test_invalid_sampling_params_raise_value_error(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs", [
    {}, {"temperature": 0}, {"temperature": 2}, {"temperature": 1e-6}, {"top_p": 1}, {"top_p": 1e-9},
    {"top_k": 0}, {"top_k": 10**6}, {"max_new_tokens": 0}, {"seed": 0}, {"seed": 2**64 - 1},
    {"ignore_eos": True},
], ids=repr)
def test_valid_sampling_params(kwargs):
    params = SamplingParams(**kwargs)
    assert params.greedy == (params.temperature == 0)


@pytest.mark.parametrize("kwargs", [
    {"max_new_tokens": 3.0}, {"max_new_tokens": np.float64(3.0)}, {"top_k": 5.0}, {"seed": 7.0},
    {"max_new_tokens": np.bool_(True)}, {"top_k": np.bool_(False)}, {"seed": np.True_},
    {"top_k": 2**31}, {"seed": 2**64}, {"temperature": 1e-300}, {"temperature": 1e300},
    {"temperature": np.float64("nan")}, {"top_p": np.float32("nan")}, {"ignore_eos": np.int64(1)},
], ids=repr)
def test_floats_and_bools_are_never_counts(kwargs):
    """Counts take integers only: 3.0 is refused like 3.5 (one rule, not a judgement per value)."""
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_numpy_values_are_accepted_and_stored_as_python_values():
    p = SamplingParams(max_new_tokens=np.int64(5), temperature=np.float32(0.5), top_k=np.uint8(3),
                       top_p=np.float16(0.5), seed=np.uint64(2**64 - 1), ignore_eos=np.bool_(True))
    assert p == SamplingParams(max_new_tokens=5, temperature=0.5, top_k=3, top_p=0.5, seed=2**64 - 1, ignore_eos=True)
    assert [type(v) for v in (p.max_new_tokens, p.temperature, p.top_k, p.top_p, p.seed, p.ignore_eos)] == \
        [int, float, int, float, int, bool]
    step_uniform(p.seed, 3)                       # a NumPy seed would overflow the 64-bit mixing


def test_defaults_match_the_public_contract():
    assert SamplingParams() == SamplingParams(max_new_tokens=256, temperature=0.0, top_k=0, top_p=1.0,
                                              seed=None, ignore_eos=False)


# ---- the distribution of sample_ref ------------------------------------------------------------

def expected_distribution(logits, temperature, top_k, top_p):
    """float64 probabilities after temperature, top-k (ties kept) and top-p, renormalized."""
    z = logits.astype(np.float64) / temperature
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    if 0 < top_k < len(probs):
        probs = np.where(probs >= np.sort(probs)[::-1][top_k - 1], probs, 0)
        probs /= probs.sum()
    if top_p < 1:
        ranked = np.sort(probs)[::-1]
        n = np.argmax(np.cumsum(ranked) >= top_p * (1 - 1e-12)) + 1     # smallest set with that mass
        probs = np.where(probs >= ranked[n - 1], probs, 0)
        probs /= probs.sum()
    return probs


CASES = [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (1.0, 7, 0.9), (2.0, 3, 0.5), (0.5, 0, 0.3)]


def random_logits(seed, V=41, scale=2.0):
    return (scale * np.random.default_rng(seed).standard_normal(V)).astype(np.float32)


@pytest.mark.parametrize("temperature,top_k,top_p", CASES)
def test_sample_ref_inverse_cdf_on_a_uniform_grid(temperature, top_k, top_p):
    logits = random_logits(int(temperature * 10 + top_k))
    expected = expected_distribution(logits, temperature, top_k, top_p)
    N = 4000
    draws = [sample_ref(logits, temperature, top_k, top_p, (i + 0.5) / N) for i in range(N)]
    freq = np.bincount(draws, minlength=len(logits)) / N
    assert np.max(np.abs(freq - expected)) <= 1.0 / N + 1e-5
    assert set(np.flatnonzero(freq)) == set(np.flatnonzero(expected))   # nothing outside the kept set


@pytest.mark.parametrize("temperature,top_k,top_p", CASES)
def test_seeded_draws_follow_the_distribution(temperature, top_k, top_p):
    """Chi-square of N draws with u = step_uniform(seed, step) against the expected distribution."""
    logits = random_logits(100 + int(temperature * 10 + top_k), V=23)
    expected = expected_distribution(logits, temperature, top_k, top_p)
    N = 3000
    draws = [sample_ref(logits, temperature, top_k, top_p, step_uniform(12345, step)) for step in range(N)]
    observed = np.bincount(draws, minlength=len(logits))
    kept = expected > 0
    assert observed[~kept].sum() == 0
    chi2 = float(np.sum((observed[kept] - N * expected[kept]) ** 2 / (N * expected[kept])))
    dof = max(int(kept.sum()) - 1, 1)
    assert chi2 < dof + 6 * math.sqrt(2 * dof) + 10, (chi2, dof)   # far in the tail of chi2(dof)


def test_step_uniform_is_deterministic_and_uniform():
    u = np.array([step_uniform(seed, step) for seed in (0, 1, 2**63) for step in range(7000)])
    assert np.all((u >= 0) & (u < 1))
    assert step_uniform(7, 3) == step_uniform(7, 3) != step_uniform(7, 4) != step_uniform(8, 3)
    ks = np.max(np.abs(np.sort(u) - (np.arange(1, len(u) + 1) - 0.5) / len(u)))
    assert ks < 1.63 / math.sqrt(len(u)) + 1e-3                       # Kolmogorov-Smirnov at 1%
    assert abs(np.corrcoef(u[:-1], u[1:])[0, 1]) < 0.03                # consecutive steps unrelated


@given(st.lists(st.tuples(st.integers(0, 2**64 - 1), st.integers(0, 2**31)), min_size=1, max_size=40))
def test_step_uniforms_equal_step_uniform_bit_for_bit(pairs):
    seeds, steps = zip(*pairs, strict=True)
    batch = step_uniforms(list(seeds), list(steps))
    assert batch.dtype == np.float64
    assert batch.tolist() == [step_uniform(seed, step) for seed, step in pairs]


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**16), V=st.integers(1, 30), temperature=st.sampled_from([0.0, 0.3, 1.0, 5.0]),
       top_k=st.integers(0, 32), top_p=st.floats(0.01, 1.0), u=st.floats(0.0, 1.0, exclude_max=True),
       ties=st.booleans())
def test_sample_ref_returns_a_kept_token(seed, V, temperature, top_k, top_p, u, ties):
    rng = np.random.default_rng(seed)
    logits = (rng.integers(-3, 3, V) if ties else rng.standard_normal(V) * 3).astype(np.float32)
    token = sample_ref(logits, temperature, top_k, top_p, u)
    p, keep = keep_mask(logits, temperature, top_k, top_p)
    assert 0 <= token < V and keep[token]
    assert keep[np.argmax(logits)]                                      # the most likely always survives
    assert sample_ref(logits, temperature, top_k, top_p, np.nextafter(1.0, 0)) in np.flatnonzero(keep)


@pytest.mark.parametrize("temperature", [0.1, 1.0, 3.0])
def test_top_k_one_is_greedy(temperature):
    for seed in range(20):
        logits = random_logits(seed)
        for u in (0.0, 0.3, 0.999999):
            assert sample_ref(logits, temperature, 1, 1.0, u) == int(np.argmax(logits))


def test_temperature_zero_is_first_argmax_whatever_u():
    logits = np.array([0.5, 2.0, -1.0, 2.0], dtype=np.float32)
    for u in (0.0, 0.5, 0.9999):
        assert sample_ref(logits, 0.0, 0, 1.0, u) == 1
        assert sample_ref(logits, 0.0, 3, 0.2, u) == 1


# ---- keep_mask semantics -----------------------------------------------------------------------

def test_keep_mask_top_k_keeps_ties_at_the_kth_value():
    logits = np.array([2.0, 3.0, 1.0, 2.0, 0.0], dtype=np.float32)
    for k, kept in [(1, [1]), (2, [0, 1, 3]), (3, [0, 1, 3]), (4, [0, 1, 2, 3]), (5, range(5)), (9, range(5)),
                    (0, range(5))]:
        p, keep = keep_mask(logits, 1.0, k, 1.0)
        assert np.flatnonzero(keep).tolist() == list(kept), k
    assert p.max() == 1.0 and p.dtype == np.float32                     # exp(z - max z): unnormalized


def test_keep_mask_top_p_is_the_smallest_set_holding_top_p():
    probs = np.array([0.15, 0.5, 0.1, 0.25])
    logits = np.log(probs).astype(np.float32)
    for top_p, kept in [(0.4, [1]), (0.6, [1, 3]), (0.8, [0, 1, 3]), (0.95, [0, 1, 2, 3]), (1.0, [0, 1, 2, 3])]:
        assert np.flatnonzero(keep_mask(logits, 1.0, 0, top_p)[1]).tolist() == kept, top_p


def test_keep_mask_top_p_is_relative_to_what_top_k_kept():
    logits = np.log([0.4, 0.3, 0.2, 0.1]).astype(np.float32)
    # after top-2 the masses are 4/7 and 3/7: 0.55 is reached by the first alone
    assert np.flatnonzero(keep_mask(logits, 1.0, 2, 0.55)[1]).tolist() == [0]
    assert np.flatnonzero(keep_mask(logits, 1.0, 0, 0.55)[1]).tolist() == [0, 1]


def test_keep_mask_top_p_keeps_ties_at_the_cut():
    logits = np.log([0.4, 0.2, 0.2, 0.2]).astype(np.float32)
    assert keep_mask(logits, 1.0, 0, 0.5)[1].all()


def test_keep_mask_temperature_flattens_or_sharpens():
    logits = np.log([0.6, 0.3, 0.1]).astype(np.float32)
    assert np.flatnonzero(keep_mask(logits, 0.2, 0, 0.9)[1]).tolist() == [0]        # sharp: 0.6^5 dominates
    assert np.flatnonzero(keep_mask(logits, 5.0, 0, 0.9)[1]).tolist() == [0, 1, 2]  # flat: all needed


def test_sample_mixes_greedy_and_sampled_rows():
    logits = np.stack([random_logits(s) for s in range(4)])            # [R, V]
    params = [SamplingParams(), SamplingParams(temperature=1.0, top_k=5, seed=1),
              SamplingParams(temperature=0.8, top_p=0.5), SamplingParams(temperature=1.0, top_k=1)]
    uniforms = [0.9, 0.3, 0.7, 0.5]
    out = sample(logits, params, uniforms)
    assert out.dtype == np.int32
    assert out.tolist() == [sample_ref(logits[r], p.temperature, p.top_k, p.top_p, u)
                            for r, (p, u) in enumerate(zip(params, uniforms, strict=True))]
    assert out[0] == np.argmax(logits[0]) and out[3] == np.argmax(logits[3])


@needs_transformers
def test_keep_mask_matches_transformers_warpers_live():
    import torch
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper
    compared = 0
    for seed in range(30):
        logits = random_logits(seed, V=57, scale=2.5)                 # continuous: no ties
        for temperature in (0.7, 1.0, 1.3):
            for top_k in (0, 1, 5, 17):
                for top_p in (1.0, 0.9, 0.5, 0.2):
                    scores = TemperatureLogitsWarper(temperature)(None, torch.from_numpy(logits)[None].clone())
                    if top_k:
                        scores = TopKLogitsWarper(top_k)(None, scores)
                    if top_p < 1:
                        scores = TopPLogitsWarper(top_p)(None, scores)
                        # skip the rare case where the cumulative mass lands within float error of top_p
                        q = np.sort(torch.softmax(scores[0], -1).double().numpy())[::-1]
                        if np.min(np.abs(np.cumsum(q) - top_p)) < 1e-5:
                            continue
                    hf_keep = torch.isfinite(scores[0]).numpy()
                    np.testing.assert_array_equal(keep_mask(logits, temperature, top_k, top_p)[1], hf_keep,
                                                  err_msg=f"seed={seed} T={temperature} k={top_k} p={top_p}")
                    compared += 1
    assert compared > 1400


# ---- seeded sampling through the engine -------------------------------------------------------

@pytest.fixture(scope="module")
def llm():
    return LLM(gen_model_dir(), backend="numpy", max_context=MAX_CONTEXT)


def sampled(seed, **kw):
    return SamplingParams(max_new_tokens=12, temperature=1.0, top_k=40, top_p=0.95, seed=seed, ignore_eos=True, **kw)


PROMPT = [17, 3, 250, 99, 4]


def test_same_seed_same_tokens(llm):
    [a] = llm.generate([PROMPT], sampled(7))
    [b] = llm.generate([PROMPT], sampled(7))
    assert a.token_ids == b.token_ids and len(a.token_ids) == 12
    # the same request in a batch with others, under other batching and cache layouts
    others = [[5, 6, 7], list(range(30, 50)), [1]]
    batch = llm.generate(others + [PROMPT], [sampled(1), sampled(2), SamplingParams(max_new_tokens=5), sampled(7)])
    assert batch[-1].token_ids == a.token_ids
    for batching, kv_cache in [("static", "contiguous"), ("continuous", "contiguous")]:
        other = LLM(gen_model_dir(), backend="numpy", batching=batching, kv_cache=kv_cache, max_context=MAX_CONTEXT)
        assert other.generate([PROMPT], sampled(7))[0].token_ids == a.token_ids
    # the chat loop draws the same uniforms for the same (seed, step)
    session = ChatSession(load_model(gen_model_dir(), backend="numpy", max_context=MAX_CONTEXT))
    assert list(session.stream(PROMPT, sampled(7))) == a.token_ids


def test_different_seeds_differ(llm):
    outputs = {tuple(r.token_ids) for r in llm.generate([PROMPT] * 6, [sampled(s) for s in range(6)])}
    assert len(outputs) >= 4


def test_sampling_really_samples(llm):
    """Not greedy in disguise: a seeded sample differs from greedy somewhere."""
    greedy = llm.generate([PROMPT] * 4, SamplingParams(max_new_tokens=12, ignore_eos=True))[0].token_ids
    assert any(r.token_ids != greedy for r in llm.generate([PROMPT] * 4, [sampled(s) for s in range(4)]))


def test_top_k_one_through_the_engine_is_greedy(llm):
    model = load_model(gen_model_dir(), backend="numpy", max_context=MAX_CONTEXT)
    expected, _ = greedy_no_cache(model, PROMPT, 12, ignore_eos=True)
    params = [SamplingParams(max_new_tokens=12, temperature=t, top_k=1, seed=s, ignore_eos=True)
              for t, s in [(1.0, 0), (2.5, 1), (0.3, 2)]]
    assert all(r.token_ids == expected for r in llm.generate([PROMPT] * 3, params))


def test_seeded_sampling_survives_preemption():
    """Stateless per-step uniforms: a request preempted and recomputed draws the same tokens."""
    prompts = [list(range(10 + i, 20 + i)) for i in range(4)]
    params = [SamplingParams(max_new_tokens=20, temperature=1.0, top_k=40, seed=100 + i, ignore_eos=True)
              for i in range(4)]
    roomy = LLM(gen_model_dir(), backend="numpy", max_context=MAX_CONTEXT).generate(prompts, params)
    tight = LLM(gen_model_dir(), backend="numpy", max_context=MAX_CONTEXT, kv_cache_mib=4 * 16 * 384 / 2**20,
                admission="on_demand")
    results = tight.generate(prompts, params)
    assert any(entry["preempted"] for entry in tight.last_step_log), "the pool was meant to force preemption"
    assert [r.token_ids for r in results] == [r.token_ids for r in roomy]
