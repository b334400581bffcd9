"""Penalties, logit bias and min-p (engine/ops/logits_processing.py): the batched version equals the
one-row NumPy reference, and the engine's outputs follow the processed logits (greedy: each token the
argmax of its recomputed, processed row), with async scheduling and next to speculating requests."""
import numpy as np
import pytest

import engine
from engine.model.random_model import PRESETS, write_random_model
from engine.ops.logits_processing import masked_logits, process_logits, process_row_ref
from engine.runtime.sampling_params import SamplingParams


def random_params(rng) -> SamplingParams:
    return SamplingParams(
        temperature=float(rng.choice([0.0, 0.7, 2.0])),
        presence_penalty=float(rng.choice([0.0, 0.5, -1.0])), frequency_penalty=float(rng.choice([0.0, 0.3, 1.5])),
        repetition_penalty=float(rng.choice([1.0, 1.3, 0.8])), min_p=float(rng.choice([0.0, 0.05, 0.5])),
        logit_bias={int(t): float(rng.uniform(-100, 100)) for t in rng.integers(0, 40, int(rng.integers(0, 4)))})


def test_the_batched_processing_equals_the_one_row_reference():
    rng = np.random.default_rng(0)
    for trial in range(60):
        R, V = int(rng.integers(1, 6)), int(rng.integers(5, 50))
        logits = rng.standard_normal((R, V)).astype(np.float32) * 3
        rows, masks, want = [], {}, logits.copy()
        for r in range(R):
            if rng.random() < 0.2:
                continue                               # a row without processing stays as it is
            params = random_params(rng)
            prompt = rng.integers(0, V + 3, int(rng.integers(0, 8))).tolist()    # ids past V are ignored
            output = rng.integers(0, V, int(rng.integers(0, 10))).tolist()
            allowed = rng.random(V) < 0.7 if rng.random() < 0.3 else None
            if allowed is not None:
                allowed[int(rng.integers(V))] = True
                masks[r] = allowed
            rows.append((r, params, prompt, output))
            want[r] = process_row_ref(logits[r], params, prompt, output, allowed)
        idx = sorted(masks)                    # the masks as rows of a table, in another order
        table = np.stack([masks[r] for r in idx[::-1]] + [np.zeros(V + 3, bool)[:V]]) if idx else None
        slots = np.full(R, -1, dtype=np.int32)
        slots[idx] = np.arange(len(idx))[::-1]
        got = process_logits(np, masked_logits(np, logits, table, slots), rows)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6, err_msg=f"trial {trial}")


def test_the_reference_follows_the_published_definitions():
    z = np.array([2.0, -1.0, 0.5, 3.0], dtype=np.float32)
    p = SamplingParams(repetition_penalty=2.0)
    assert process_row_ref(z, p, [0], [1]).tolist() == [1.0, -2.0, 0.5, 3.0]    # z / r above 0, z * r below
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    assert process_row_ref(z, p, [3, 3], [2, 2, 0]).tolist() == [1.25, -1.0, -0.5, 3.0]   # the output only
    p = SamplingParams(logit_bias={1: 10.0})
    assert process_row_ref(z, p, [], []).tolist() == [2.0, 9.0, 0.5, 3.0]
    p = SamplingParams(temperature=1.0, min_p=0.3)     # p / p_max = e^(z - 3): 0.37, 0.02, 0.08, 1
    assert np.isneginf(process_row_ref(z, p, [], [])).tolist() == [False, True, True, False]
    assert process_row_ref(z, SamplingParams(min_p=0.3), [], []).tolist() == z.tolist()   # greedy: no cut


@pytest.fixture(scope="module")
def untied_dir(tmp_path_factory):
    """A random model whose greedy output wanders (a tied one mostly repeats its last token)."""
    return write_random_model(tmp_path_factory.mktemp("lp") / "m", {**PRESETS["tiny"], "tie_word_embeddings": False},
                              seed=3)


PENALIZED = [SamplingParams(max_new_tokens=24, repetition_penalty=1.8, ignore_eos=True),
             SamplingParams(max_new_tokens=24, presence_penalty=1.5, frequency_penalty=0.7, ignore_eos=True),
             SamplingParams(max_new_tokens=24, logit_bias={7: 3.0, 11: -100.0}, ignore_eos=True),
             SamplingParams(max_new_tokens=24, ignore_eos=True)]


def test_greedy_outputs_follow_the_processed_logits(untied_dir, both_schedulings):
    llm = engine.LLM(untied_dir, backend="numpy", max_seqs=4)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 390, 9 + 3 * i).tolist() for i in range(len(PENALIZED))]
    outs = llm.generate(prompts, PENALIZED)
    for prompt, params, out in zip(prompts, PENALIZED, outs, strict=True):
        full = llm.model.logits(prompt + out.token_ids[:-1])
        for i, token in enumerate(out.token_ids):
            row = process_row_ref(full[len(prompt) - 1 + i], params, prompt, out.token_ids[:i])
            assert token == int(np.argmax(row)), (params, i)
    assert 11 not in outs[2].token_ids
    plain = outs[3].token_ids
    assert len(set(outs[0].token_ids)) > len(set(plain)) or outs[0].token_ids != plain   # the penalty acts


def test_min_p_keeps_only_tokens_near_the_most_likely(untied_dir):
    llm = engine.LLM(untied_dir, backend="numpy", max_seqs=8)
    params = [SamplingParams(max_new_tokens=6, temperature=3.0, min_p=0.2, seed=s, ignore_eos=True) for s in range(8)]
    prompt = [5, 9, 30, 2, 41]
    for out in llm.generate([prompt] * 8, params):
        full = llm.model.logits(prompt + out.token_ids[:-1])
        for i, token in enumerate(out.token_ids):
            z = full[len(prompt) - 1 + i].astype(np.float64) / 3.0
            assert np.exp(z[token] - z.max()) >= 0.2 - 1e-6


def test_penalized_requests_decode_plainly_next_to_speculating_ones(untied_dir):
    llm = engine.LLM(untied_dir, backend="numpy", max_seqs=4, speculative={"method": "ngram", "num_tokens": 3})
    plain = engine.LLM(untied_dir, backend="numpy", max_seqs=4)
    motif = [17, 23, 5, 88]
    prompts = [motif * 4, motif * 4]
    params = [SamplingParams(max_new_tokens=20, ignore_eos=True), PENALIZED[0]]
    assert [o.token_ids for o in llm.generate(prompts, params)] == [o.token_ids for o in plain.generate(prompts, params)]
    penalized = llm.generate([prompts[1]], [params[1]])
    assert all(not e.get("draft_tokens") for e in llm.last_step_log) and penalized


@pytest.mark.parametrize("bad, message", [
    ({"presence_penalty": 3.0}, "presence_penalty"), ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"min_p": 1.5}, "min_p"), ({"logit_bias": {"x": 1}}, "logit_bias keys"), ({"logit_bias": {3: 101}}, "logit_bias values"),
    ({"structured": ("sql", "x")}, "structured"),
])
def test_bad_processing_settings_are_refused_by_name(bad, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**bad)


def test_a_bias_on_a_token_the_model_lacks_is_refused(untied_dir):
    llm = engine.LLM(untied_dir, backend="numpy")
    with pytest.raises(ValueError, match="logit_bias names token id 5000"):
        llm.generate([[1, 2, 3]], SamplingParams(logit_bias={5000: 1.0}))


# ---- log-probabilities ---------------------------------------------------------------------------------


def log_softmax(z):
    z = np.asarray(z, dtype=np.float64)
    return z - z.max() - np.log(np.exp(z - z.max()).sum())


def check_logprobs(llm, prompt, out, k):
    assert len(out.logprobs) == len(out.token_ids)
    full = llm.model.logits(prompt + out.token_ids[:-1])
    for i, (token, (lp, top)) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        want = log_softmax(full[len(prompt) - 1 + i])
        assert abs(lp - want[token]) < 1e-4
        assert [t for t, _ in top] == np.argsort(-want, kind="stable")[:k].tolist()
        np.testing.assert_allclose([v for _, v in top], want[[t for t, _ in top]], atol=1e-4)


def test_logprobs_are_the_log_softmax_of_the_models_logits(untied_dir, both_schedulings):
    """The model's own distribution (before temperature and penalties), for sampled and greedy rows,
    streamed and in the result; a request without logprobs next to them gets none."""
    llm = engine.LLM(untied_dir, backend="numpy", max_seqs=4)
    prompts = [[5, 6, 7, 8], [9, 10, 11], [40, 41]]
    params = [SamplingParams(max_new_tokens=6, logprobs=3, temperature=0.9, seed=1, presence_penalty=1.0),
              SamplingParams(max_new_tokens=5, logprobs=0), SamplingParams(max_new_tokens=5)]
    outs = llm.generate(prompts, params)
    check_logprobs(llm, prompts[0], outs[0], 3)
    check_logprobs(llm, prompts[1], outs[1], 0)
    assert outs[2].logprobs is None
    events = list(llm.submit(prompts[0], params[0]).stream())      # alone: a batch of one row
    assert [t for ev in events for t in ev.token_ids] == outs[0].token_ids
    np.testing.assert_allclose([lp for ev in events for lp, _ in ev.logprobs], [lp for lp, _ in outs[0].logprobs],
                               atol=1e-5)
    assert all(len(ev.logprobs) == len(ev.token_ids) for ev in events)


def test_logprobs_end_with_the_text_a_stop_string_cuts(default_model_dir):
    llm = engine.LLM(default_model_dir, backend="numpy", max_seqs=2, max_context=256)
    p = SamplingParams(max_new_tokens=30, logprobs=1, stop=[" king"])
    out = llm.generate(["Once upon a time, in a land far away, there"], p)[0]
    assert out.finish_reason == "stop" and len(out.logprobs) == len(out.token_ids) > 0
    events = list(llm.submit("Once upon a time, in a land far away, there", p).stream())
    assert [e for ev in events for e in ev.logprobs] == out.logprobs


def test_logprobs_cross_the_engine_process(untied_dir):
    from engine.runtime.engine_process import RemoteLLM
    local = engine.LLM(untied_dir, backend="numpy")
    p = SamplingParams(max_new_tokens=5, logprobs=2, temperature=0.7, seed=3)
    want = local.generate([[5, 6, 7]], p)[0]
    with RemoteLLM(untied_dir, "numpy") as remote:
        got = remote.submit([5, 6, 7], p).result(timeout=60)
    assert got.token_ids == want.token_ids
    np.testing.assert_allclose([lp for lp, _ in got.logprobs], [lp for lp, _ in want.logprobs], atol=1e-6)
