"""Speculative decoding (chapter 16): the acceptance rule is exact, verify rows keep every scheduling
invariant, and the engine's outputs do not change.

- The rule: the first emitted token is distributed as p[0], the second (after an accepted guess) as
  p[1] (chi-square on many draws), for deterministic and general proposers; two wrong rules fail.
- target_probs (the distribution a verify row checks against) is plain sampling's keep_mask.
- The scheduler with a fake model and a proposer that is right some of the time: every request ends
  exactly as it does alone, synchronous and async, with tight pools that preempt.
- engine.LLM: greedy outputs with speculation are the outputs without it (batched, preempted, stop
  strings, eos inside accepted guesses, both schedulings), and seeded sampling draws from the model's
  distribution (a tiny-vocabulary model, compared with plain sampling; a wrong rule is caught).
"""
from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from test_ch09_11_scheduler import EOS, VOCAB, fake_next_token, params, run_alone, setups
from test_ch14_async_scheduling import fresh

import engine
from engine.model.random_model import PRESETS, write_random_model
from engine.ops.sampling import keep_mask
from engine.runtime import speculative
from engine.runtime.kv_allocator import PageAllocator
from engine.runtime.scheduler import Scheduler
from engine.runtime.speculative import (
    SpeculativeConfig,
    SpeculativeError,
    accept_reference,
    ngram_propose,
    target_probs,
    use_acceptance_rule,
)

# ---- the rule --------------------------------------------------------------------------------------


def emitted_counts(rule, p, q, draft, trials, seed):
    """How often each token is emitted first, and second after the first guess was accepted. With a
    q that is not one-hot, each trial draws its guesses from q (the rule's premise: d_j ~ q_j)."""
    rng = np.random.default_rng(seed)
    V = p.shape[1]
    first, second = np.zeros(V), np.zeros(V)
    for _ in range(trials):
        guesses = draft if (q.max(axis=1) == 1).all() else [int(rng.choice(V, p=row)) for row in q]
        out = rule(p, q, guesses, rng.random(len(draft) + 1), rng.random(len(draft) + 1))
        first[out[0]] += 1
        if len(out) > 1:
            second[out[1]] += 1
    return first, second


Z_1E4 = 3.719     # the standard normal's 1 - 1e-4 quantile


def chi2_critical(df: int) -> float:
    """The chi-square statistic a test of `df` degrees of freedom passes with probability 1e-4 when
    the null holds (Wilson-Hilferty: within a percent of the exact quantile for df >= 1)."""
    return df * (1 - 2 / (9 * df) + Z_1E4 * (2 / (9 * df)) ** 0.5) ** 3


def fits(counts, expected_p) -> bool:
    """Counts drawn from expected_p, at the 1e-4 level (and never a count where p is 0)."""
    keep = expected_p > 0
    if counts[~keep].any():
        return False
    expected = counts.sum() * expected_p[keep] / expected_p[keep].sum()
    return ((counts[keep] - expected) ** 2 / expected).sum() < chi2_critical(int(keep.sum()) - 1)


def same_distribution(a, b) -> bool:
    """Two histograms from one distribution (a 2 x m contingency test at the 1e-4 level)."""
    table = np.stack([a, b])[:, (a + b) > 0]
    expected = table.sum(axis=1, keepdims=True) * table.sum(axis=0, keepdims=True) / table.sum()
    return ((table - expected) ** 2 / expected).sum() < chi2_critical(table.shape[1] - 1)


CASES = [   # p [k+1, V], q [k, V] (one-hot rows: a deterministic proposer), draft
    (np.array([[.5, .2, .2, .1, 0], [.1, .1, .1, .6, .1], [.2, .2, .2, .2, .2]]),
     None, [1, 3]),
    (np.array([[.05, .05, .8, .1, 0], [.3, .3, .2, .1, .1], [.9, .1, 0, 0, 0]]),
     np.array([[.1, .1, .3, .5, 0], [.2, .2, .2, .2, .2]]), [3, 0]),
]


def one_hot(draft, V):
    q = np.zeros((len(draft), V))
    q[np.arange(len(draft)), draft] = 1.0
    return q


@pytest.mark.parametrize("p, q, draft", CASES)
def test_the_rule_emits_exactly_the_models_distribution(p, q, draft):
    q = one_hot(draft, p.shape[1]) if q is None else q
    first, second = emitted_counts(accept_reference, p, q, draft, 20_000, seed=1)
    assert fits(first, p[0]) and fits(second, p[1])


def argmax_rule(p, q, draft, u_accept, u_resample):       # accepting by argmax: greedy's rule, applied to sampling
    out = []
    for j, d in enumerate(draft):
        if d != int(np.argmax(p[j])):
            return out + [int(np.argmax(p[j]))]
        out.append(d)
    return out + [int(np.argmax(p[len(draft)]))]


def no_residual_rule(p, q, draft, u_accept, u_resample):  # on rejection, draws from p instead of the residual
    out = []
    for j, d in enumerate(draft):
        if u_accept[j] * q[j, d] < p[j, d]:
            out.append(d)
            continue
        return out + [speculative.inverse_cdf(p[j], u_resample[j])]
    return out + [speculative.inverse_cdf(p[len(draft)], u_resample[len(draft)])]


@pytest.mark.parametrize("rule", [argmax_rule, no_residual_rule])
def test_wrong_rules_are_caught(rule):
    p, q, draft = CASES[0]
    q = one_hot(draft, p.shape[1])
    first, second = emitted_counts(rule, p, q, draft, 20_000, seed=2)
    assert not (fits(first, p[0]) and fits(second, p[1]))


@pytest.mark.parametrize("temperature, top_k, top_p", [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.7, 5, 1.0),
                                                       (1.3, 0, 0.8), (0.9, 12, 0.6), (2.0, 1, 1.0)])
def test_target_probs_are_what_plain_sampling_draws_from(temperature, top_k, top_p):
    rng = np.random.default_rng(4)
    logits = rng.normal(size=(3, 40)).astype(np.float32) * 3
    logits[0, [3, 9]] = logits[0].max() + 1          # a tie at the top
    probs = target_probs(np, logits, temperature, top_k, top_p)
    for row, got in zip(logits, probs, strict=True):
        if temperature == 0:
            assert got[int(np.argmax(row))] == 1.0 and got.sum() == 1.0
            continue
        p, keep = keep_mask(row, temperature, top_k, top_p)
        want = np.where(keep, p, 0) / np.where(keep, p, 0).sum()
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-9)


def test_ngram_lookup_follows_the_latest_earlier_occurrence_of_the_longest_suffix():
    assert ngram_propose([7, 1, 2, 3, 9, 1, 2, 3, 4, 1, 2, 3], 3) == [4, 1, 2]
    assert ngram_propose([1, 2, 3, 1, 2], 5) == [3, 1, 2, 3, 1]      # a loop goes on looping
    assert ngram_propose([1, 2, 3, 4], 3) == []
    assert ngram_propose([5, 8, 5], 2, ngram_max=2, ngram_min=2) == []
    assert ngram_propose([], 4) == [] and ngram_propose([3], 4) == []


@pytest.mark.parametrize("value, message", [
    ({"method": "draft", "draft": "x"}, "unknown speculative setting"),
    ({"method": "draft"}, "needs a model directory"),
    ({"method": "ngram", "model": "x"}, "only it takes one"),
    ({"method": "draft", "model": 3}, "must be a directory path"),
    ({"method": "ngram", "num_tokens": 0}, "positive int"),
    ({"method": "ngram", "num_tokens": 99}, "at most 16"),
    ({"num_tokens": True}, "positive int"),
    ("ngram", "must be None or a dict"),
])
def test_bad_settings_are_refused_by_name(value, message):
    with pytest.raises(SpeculativeError, match=message):
        SpeculativeConfig.parse(value)


# ---- the scheduler with a fake model ----------------------------------------------------------------


def guessing_proposer(seed: int, right: float):
    """Proposes the fake model's real continuation with probability `right` per token, else noise."""
    rng = random.Random(seed)

    def propose(tokens, k):
        out, seq = [], list(tokens)
        for _ in range(rng.randint(0, k)):
            token = fake_next_token(seq) if rng.random() < right else rng.randrange(VOCAB)
            out.append(token)
            seq.append(token)
        return out
    return propose


def verify(sched, row, in_flight=None):
    """The fake model's greedy verification of a verify row (or one token for a plain row).
    in_flight: request -> the tokens the batch still in flight yields for it (async: PENDING inputs)."""
    seq = sched._requests[row.request_id].tokens + (in_flight or {}).get(row.request_id, [])
    if not row.draft:
        return fake_next_token(seq)
    out = []
    for d in row.draft:
        best = fake_next_token(seq + out)
        if best != d:
            return out + [best]
        out.append(d)
    return out + [fake_next_token(seq + out)]


def run_speculating(setup, async_scheduling: bool):
    pool = setup["allocator"]
    sched = Scheduler(pool, setup["max_seqs"], setup["max_batch_tokens"], setup["max_context"], eos_token_ids=[EOS],
                      admission=setup["admission"], chunked_prefill=setup["chunked"], async_scheduling=async_scheduling,
                      prefix_caching=isinstance(pool, PageAllocator),
                      speculative=SpeculativeConfig(num_tokens=3, max_batch=4),
                      proposer=guessing_proposer(setup["seed"], 0.7))
    rng = random.Random(setup["seed"])
    arrivals = sorted(((t, [rng.randrange(1, VOCAB) for _ in range(n)], params(new, ign))
                       for t, n, new, ign in setup["requests"]), key=lambda a: a[0])
    prompts, results, t, in_flight = {}, {}, 0, None
    while arrivals or sched.has_unfinished() or in_flight:
        while arrivals and arrivals[0][0] <= t:
            _, prompt, p = arrivals.pop(0)
            try:
                prompts[sched.submit(prompt, p)] = (prompt, p)
            except ValueError:
                pass
        results.update((r.request_id, r) for r in sched.pop_finished())
        t += 1
        batch = sched.schedule() if sched.has_unfinished() else None
        if not async_scheduling:
            if batch is not None:
                out = sched.complete(batch.batch_id, [verify(sched, r) for r in batch.rows if r.samples])
                results.update((r.request_id, r) for r in out.finished)
        else:      # the batch runs at launch, after the one in flight (one stream): its tokens are inputs
            yields: dict[int, list[int]] = {}
            if in_flight is not None:
                for row, entry in zip([r for r in in_flight[0].rows if r.samples], in_flight[1], strict=True):
                    yields[row.request_id] = entry if isinstance(entry, list) else [entry]
            sampled = None if batch is None else [verify(sched, r, yields) for r in batch.rows if r.samples]
            if in_flight is not None:
                out = sched.complete(in_flight[0].batch_id, in_flight[1])
                results.update((r.request_id, r) for r in out.finished)
            in_flight = None if batch is None else (batch, sampled)
        pool.check_invariants()
        assert t < 10_000, "no progress"
    results.update((r.request_id, r) for r in sched.pop_finished())
    for rid, (prompt, p) in prompts.items():
        assert (results[rid].token_ids, results[rid].finish_reason) == run_alone(prompt, p, setup["max_context"])
    assert pool.num_free == pool.num_pages
    return sched


@pytest.mark.slow
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(setup=setups())
def test_random_workloads_with_verify_rows_match_running_alone(setup):
    if setup["policy"] != "continuous":
        return
    run_speculating(fresh(setup), async_scheduling=False)


def test_a_tight_pool_with_verify_rows_still_ends_every_request_as_alone():
    for seed in range(40):
        rng = random.Random(seed)
        requests = [(rng.randint(0, 3), rng.randint(1, 12), rng.randint(4, 24), True) for _ in range(8)]
        setup = dict(admission="on_demand", max_context=40, max_seqs=rng.randint(1, 5), chunked=seed % 2 == 0,
                     allocator=PageAllocator(rng.randint(10, 18), 4), max_batch_tokens=rng.randint(6, 12),
                     requests=requests, seed=seed)
        sched = run_speculating(setup, async_scheduling=False)
        assert sched.verify_rows > 0 and 0 < sched.accepted_tokens <= sched.draft_tokens


def test_verify_rows_with_a_batch_in_flight_match_running_alone():
    """Async: a verifying request sits out the lookahead; the rest of the batch overlaps as usual."""
    for seed in range(30):
        rng = random.Random(seed)
        requests = [(rng.randint(0, 3), rng.randint(1, 12), rng.randint(4, 24), True) for _ in range(6)]
        setup = dict(admission=rng.choice(["conservative", "on_demand"]), max_context=48, max_seqs=4,
                     chunked=True, allocator=PageAllocator(64, 4), max_batch_tokens=16, requests=requests, seed=seed)
        sched = run_speculating(setup, async_scheduling=True)
        assert sched.verify_rows > 0


def test_guesses_never_pass_max_new_tokens_or_the_context():
    sched = Scheduler(PageAllocator(16, 4), 2, 32, max_context=12, speculative=SpeculativeConfig(num_tokens=8),
                      proposer=lambda tokens, k: [1] * k)
    sched.submit([1, 1, 1], params(5))
    sched.submit([1, 1, 1, 1, 1, 1, 1, 1, 1], params(20))
    seen = []
    while sched.has_unfinished():
        batch = sched.schedule()
        seen += [(r.request_id, len(r.draft)) for r in batch.rows if r.draft]
        sched.complete(batch.batch_id, [([1] * len(r.draft) + [1]) if r.draft else 1 for r in batch.rows if r.samples])
    results = sched.step_log[-1]["finished"]
    assert results and all(n <= 8 for _, n in seen)
    # request 0: 5 tokens = its first, then one verify row of 3 guesses + 1; request 1: the context ends at 12
    assert (0, 3) in seen and (1, 1) in seen and (1, 2) not in seen


# ---- engine.LLM ---------------------------------------------------------------------------------------

SPEC = {"method": "ngram", "num_tokens": 4, "max_batch": 16}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_random_model(tmp_path_factory.mktemp("spec") / "tiny", "tiny", seed=1)


def repetitive_prompts(vocab: int, n: int = 6):
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        motif = [int(x) for x in rng.integers(1, vocab, size=3 + i)]
        out.append((motif * 4)[: 5 + 4 * i] if i % 2 else [int(x) for x in rng.integers(1, vocab, size=7 + 5 * i)])
    return out


def greedy_pair(model_dir, spec=SPEC, **options):
    plain = engine.LLM(model_dir, backend="numpy", **options)
    fast = engine.LLM(model_dir, backend="numpy", speculative=spec, **options)
    return plain, fast


def test_a_verify_row_cut_into_decode_rows_computes_the_same_logits(tiny_dir):
    """The runner feeds a verify row as one-token sequences sharing its page table (decode kernels,
    decode graphs); they give the logits of the row run as one chunk over the cache."""
    from engine.model.forward_pass import ForwardBatch
    from engine.model.kv_cache import KVCache
    from engine.runtime.model_runner import split_verify_rows
    from engine.runtime.scheduler import Batch, Row
    model = engine.load_model(tiny_dir, backend="numpy")
    cache = KVCache.paged(model.config, 1, page_size=4)
    prompt, table = list(range(5, 18)), [3, 0, 5, 1, 2]           # 13 cached tokens, pages out of order
    model.forward(ForwardBatch.single(prompt, 0, table, 4), cache)
    verify = Row(0, [40, 41, 42, 43], 13, table, engine.SamplingParams(), 1, kind="decode", draft=[41, 42, 43])
    plain = Row(1, [7], 2, [4], engine.SamplingParams(), 1, kind="decode")
    model.forward(ForwardBatch.single([9, 8], 0, [4], 4), cache)
    batch = Batch(0, "decode", [plain, verify], 4)
    cu, tables = split_verify_rows(batch)
    assert cu.tolist() == [0, 1, 2, 3, 4, 5] and tables.tolist() == [[4, -1, -1, -1, -1]] + [table] * 4
    as_chunk = model.forward(ForwardBatch(batch.token_ids, batch.positions, batch.cu_seqlens, batch.page_tables,
                                          batch.slot_mapping), cache)
    as_rows = model.forward(ForwardBatch(batch.token_ids, batch.positions, cu, tables, batch.slot_mapping), cache)
    np.testing.assert_allclose(as_rows, as_chunk, rtol=1e-4, atol=1e-5)
    alone = model.forward(ForwardBatch.single([40, 41, 42, 43], 13, table, 4), cache)
    np.testing.assert_allclose(as_rows[1:], alone, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen2", "tiny-qwen3-mqa-untied", "tiny-qwen3-moe-mqa-untied"])
def test_greedy_outputs_are_the_outputs_without_speculation(tmp_path, preset, both_schedulings):
    model_dir = write_random_model(tmp_path / preset, preset, seed=2)
    plain, fast = greedy_pair(model_dir, max_seqs=4)
    prompts = repetitive_prompts(plain.config.vocab_size)
    p = engine.SamplingParams(max_new_tokens=33, ignore_eos=True)
    assert [r.token_ids for r in fast.generate(prompts, p)] == [r.token_ids for r in plain.generate(prompts, p)]
    stats = fast.stats()["speculative"]
    assert stats["enabled"] and stats["verify_rows"] > 0 and stats["mean_accepted_length"] > 1.5


def test_a_small_pool_that_preempts_gives_the_same_tokens(tiny_dir):
    options = {"max_seqs": 6, "kv_cache_mib": 0.05, "page_size": 4, "admission": "on_demand", "max_batch_tokens": 24}
    plain, fast = greedy_pair(tiny_dir, **options)
    prompts = repetitive_prompts(plain.config.vocab_size, 8)
    p = engine.SamplingParams(max_new_tokens=40, ignore_eos=True)
    want = [r.token_ids for r in plain.generate(prompts, p)]
    assert [r.token_ids for r in fast.generate(prompts, p)] == want
    assert sum(len(e["preempted"]) for e in fast.last_step_log) > 0
    assert fast.stats()["pages_used"] == 0


def test_eos_and_stop_strings_inside_accepted_guesses_end_the_request_there(default_model_dir):
    plain, fast = greedy_pair(default_model_dir, max_seqs=2, max_context=512)
    prompt = "Repeat exactly: the cat sat on the mat. the cat sat on the mat. the cat sat on the mat."
    for p in (engine.SamplingParams(max_new_tokens=60), engine.SamplingParams(max_new_tokens=60, stop=["mat"]),
              engine.SamplingParams(max_new_tokens=60, stop=[" on the"])):
        a, b = plain.generate([prompt], p)[0], fast.generate([prompt], p)[0]
        assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason)
        streamed = list(fast.submit(prompt, p).stream())
        assert "".join(ev.text for ev in streamed) == a.text
        assert [t for ev in streamed for t in ev.token_ids] == a.token_ids
    assert fast.stats()["speculative"]["accepted_tokens"] > 0


def test_speculation_steps_aside_above_max_batch(tiny_dir):
    fast = engine.LLM(tiny_dir, backend="numpy", max_seqs=8, speculative={"method": "ngram", "max_batch": 2})
    prompts = repetitive_prompts(fast.config.vocab_size, 6)
    fast.generate(prompts, engine.SamplingParams(max_new_tokens=30, ignore_eos=True))
    for entry in fast.last_step_log:
        decoding = len(entry["request_ids"]) - len(entry["prefill_ids"])
        if entry.get("draft_tokens"):
            assert decoding <= 2


def test_speculation_needs_the_engines_continuous_scheduler(tiny_dir):
    with pytest.raises(ValueError, match="continuous batching"):
        engine.LLM(tiny_dir, backend="numpy", batching="static", speculative=SPEC)


# ---- sampling follows the model's distribution --------------------------------------------------------


@pytest.fixture(scope="module")
def small_vocab_dir(tmp_path_factory):
    config = {**PRESETS["tiny"], "vocab_size": 6}
    return write_random_model(tmp_path_factory.mktemp("v6") / "v6", config, seed=5)


def third_token_counts(llm, n: int, vocab: int, rule=None) -> np.ndarray:
    """How often each (1st, 2nd, 3rd) generated token triple came out of n seeded runs. (A random model's
    logits span tens of units: temperature 12 spreads its distribution over several tokens.)"""
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    params = [engine.SamplingParams(max_new_tokens=4, ignore_eos=True, temperature=12.0, seed=s) for s in range(n)]
    if rule is None:
        outs = llm.generate([prompt] * n, params)
    else:
        with use_acceptance_rule(rule):
            outs = llm.generate([prompt] * n, params)
    counts = np.zeros((vocab, vocab, vocab))
    for out in outs:
        counts[tuple(out.token_ids[:3])] += 1
    return counts.reshape(-1)


@pytest.mark.slow
def test_sampled_outputs_follow_the_models_distribution_and_a_wrong_rule_is_caught(small_vocab_dir):
    options = {"max_seqs": 64, "max_batch_tokens": 512}
    plain = engine.LLM(small_vocab_dir, backend="numpy", **options)
    fast = engine.LLM(small_vocab_dir, backend="numpy", speculative={"method": "ngram", "num_tokens": 3,
                                                                      "max_batch": 64}, **options)
    n, V = 3000, 6
    want = third_token_counts(plain, n, V)
    got = third_token_counts(fast, n, V)
    assert fast.stats()["speculative"]["accepted_tokens"] > 500
    assert same_distribution(want, got)
    assert not same_distribution(want, third_token_counts(fast, n, V, rule=no_residual_rule))


def test_the_spec_decode_bench_runs_on_the_cpu(capsys, other_draft_dir):
    """The bench scenario end to end on a random tiny model: plain decoding, then n-gram speculation and
    a draft model, same run; a random model loops, which the lookup finds, so verify rows yield more
    than one token."""
    import json

    from engine.bench import run as bench
    bench.main(["--preset", "tiny", "--backend", "numpy", "--scenario", "spec-decode", "--new-tokens", "24",
                "--spec-k", "3", "--prompt-len", "32", "--spec-draft", str(other_draft_dir)])
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    runs = {(r["prompt"], r["speculative"]): r for r in records if r.get("scenario") == "spec-decode"}
    assert set(runs) == {(p, m) for p in ("repeat", "plain") for m in ("off", "ngram:3", "draft:3")}
    for prompt, mode in itertools.product(("repeat", "plain"), ("ngram:3", "draft:3")):
        spec = runs[prompt, mode]
        assert spec["same_tokens_as_plain"] and spec["same_leading_tokens"] == spec["new_tokens"] == 24
        assert spec["verify_rows"] > 0 and 1.0 <= spec["mean_tokens_per_verify_row"] <= 4.0
        assert spec["speedup"] > 0 and runs[prompt, "off"]["decode_tok_per_s"] > 0


# ---- a draft model as the proposer ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def untied_dir(tmp_path_factory):
    """A random model whose greedy output wanders (a tied one mostly repeats its last token)."""
    config = {**PRESETS["tiny"], "tie_word_embeddings": False}
    return write_random_model(tmp_path_factory.mktemp("untied") / "target", config, seed=1)


@pytest.fixture(scope="module")
def other_draft_dir(tmp_path_factory):
    """A different random model of the same vocabulary: its guesses are mostly wrong."""
    config = {**PRESETS["tiny"], "hidden_size": 48, "intermediate_size": 96, "num_hidden_layers": 1,
              "tie_word_embeddings": False}
    return write_random_model(tmp_path_factory.mktemp("draft") / "draft", config, seed=9)


def draft_spec(model_dir, k: int = 4) -> dict:
    return {"method": "draft", "model": str(model_dir), "num_tokens": k}


@pytest.mark.parametrize("draft", ["itself", "another model"])
def test_a_draft_models_greedy_outputs_are_the_outputs_without_speculation(untied_dir, other_draft_dir, draft,
                                                                           both_schedulings):
    draft_dir = untied_dir if draft == "itself" else other_draft_dir
    plain, fast = greedy_pair(untied_dir, spec=draft_spec(draft_dir), max_seqs=4)
    prompts = repetitive_prompts(plain.config.vocab_size)
    p = engine.SamplingParams(max_new_tokens=33, ignore_eos=True)
    assert [r.token_ids for r in fast.generate(prompts, p)] == [r.token_ids for r in plain.generate(prompts, p)]
    stats = fast.stats()["speculative"]
    assert stats["verify_rows"] > 0 and stats["method"] == f"draft, k=4, {draft_dir.name}"
    if draft == "itself":       # the draft is the target: every guess is the target's own token
        assert stats["acceptance_rate"] == 1.0
    else:
        assert stats["acceptance_rate"] < 0.5
    proposer = fast.runner.proposer
    assert proposer.allocator.num_used == 0 and not proposer._seqs     # every request gave its pages back


def test_the_draft_proposer_keeps_what_the_target_accepted_and_rewrites_the_rest(untied_dir):
    """propose_batch against the model's own greedy continuation: after each 'verify' only a prefix
    of the guesses is kept (a different token follows), and the next guesses are again the model's."""
    from engine.runtime.draft_model import DraftModelProposer
    target = engine.LLM(untied_dir, backend="numpy")
    prompts = repetitive_prompts(target.config.vocab_size, 3)
    p = engine.SamplingParams(max_new_tokens=40, ignore_eos=True)
    greedy = [r.token_ids for r in target.generate(prompts, p)]
    proposer = DraftModelProposer(untied_dir, target.backend, target.config, max_context=256, max_rows=8,
                                  page_size=4, kv_cache_mib=0.5)
    rng = np.random.default_rng(3)
    known = [list(prompt) + out[:1] for prompt, out in zip(prompts, greedy, strict=True)]
    while min(len(k) - len(prompt) for k, prompt in zip(known, prompts, strict=True)) < 30:
        items = [(rid, len(k), lambda a, b, k=k: k[a:b], 4) for rid, k in enumerate(known)]
        for rid, guesses in enumerate(proposer.propose_batch(items)):
            done = len(known[rid]) - len(prompts[rid])
            assert guesses == greedy[rid][done:done + 4]
            keep = int(rng.integers(0, 5))               # accepted guesses, then the target's own token
            known[rid] += greedy[rid][done:done + keep + 1]
    for rid in range(len(known)):
        proposer.release(rid)
    assert proposer.allocator.num_used == 0


def test_a_draft_pool_too_small_for_everyone_evicts_sequences_outside_the_step(tiny_dir):
    from engine.runtime.draft_model import DraftModelProposer
    target = engine.load_model(tiny_dir, backend="numpy")
    proposer = DraftModelProposer(tiny_dir, target.backend, target.config, max_context=256, max_rows=8,
                                  page_size=4, kv_cache_mib=0.05)
    pages = proposer.allocator.num_pages
    prompt = list(range(3, 3 + int(0.6 * 4 * pages) - 3))             # with its guesses, 60% of the pool
    assert proposer.propose_batch([(0, len(prompt), lambda a, b: prompt[a:b], 4)])
    assert proposer.propose_batch([(1, len(prompt), lambda a, b: prompt[a:b], 4)])      # takes 0's pages
    assert proposer.allocator.has_table(1) and not proposer.allocator.has_table(0)
    too_long = list(range(3, 3 + 4 * pages + 8))
    assert proposer.propose_batch([(2, len(too_long), lambda a, b: too_long[a:b], 4)]) == [[]]   # no guesses


def test_a_draft_of_another_tokenizer_or_a_shorter_context_is_refused(tmp_path, tiny_dir):
    bigger = write_random_model(tmp_path / "big", {**PRESETS["tiny"], "vocab_size": 500}, seed=1)
    smaller = write_random_model(tmp_path / "small", {**PRESETS["tiny"], "vocab_size": 300}, seed=1)
    short = write_random_model(tmp_path / "short", {**PRESETS["tiny"], "max_position_embeddings": 64}, seed=1)
    for draft, message in ((bigger, "larger than the target's"), (smaller, "no tokenizer.json"),
                           (short, "reaches 64 positions"), (tmp_path / "missing", "the draft model")):
        with pytest.raises(SpeculativeError, match=message):
            engine.LLM(tiny_dir, backend="numpy", max_context=128, speculative=draft_spec(draft))
    engine.LLM(tiny_dir, backend="numpy", max_context=64, speculative=draft_spec(short))   # fits


def test_the_command_line_names_a_draft_model():
    assert SpeculativeConfig.from_cli("draft:/models/small") == {"method": "draft", "model": "/models/small"}
    assert SpeculativeConfig.parse(SpeculativeConfig.from_cli("draft:/m")).describe() == "draft, k=4, m"
    with pytest.raises(SpeculativeError, match="needs a model directory"):
        SpeculativeConfig.parse(SpeculativeConfig.from_cli("draft"))
