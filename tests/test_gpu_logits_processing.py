"""Logits processing and log-probabilities on the GPU: the CuPy path equals the NumPy one on the same
logits, and the engine's greedy tokens with penalties follow the processed logits of a full
recomputation (bf16 near-ties aside); -inf entries (masked tokens) sample correctly. Skipped without a GPU."""
import numpy as np
import pytest

from engine.ops.logits_processing import masked_logits, process_logits, token_logprobs
from engine.runtime.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu


def test_processing_and_logprobs_on_the_device_equal_numpy():
    import cupy as cp
    rng = np.random.default_rng(0)
    R, V = 6, 50_000
    logits = (rng.standard_normal((R, V)) * 4).astype(np.float32)
    rows = [(0, SamplingParams(repetition_penalty=1.4), [5, 9, 9, 70_000], [3, 3]),
            (2, SamplingParams(presence_penalty=0.7, frequency_penalty=0.4, logit_bias={7: 5.0, 8: -100.0}), [1], [4, 4, 4, 6]),
            (3, SamplingParams(temperature=0.8, min_p=0.2), [], []),
            (5, SamplingParams(temperature=1.0, min_p=0.05, repetition_penalty=0.9), [2, 3], [2])]
    table = rng.random((3, V + 7)) < 0.5                 # three masks, wider than the logits
    slots = np.array([1, -1, 0, 2, -1, 1], dtype=np.int32)
    want = process_logits(np, masked_logits(np, logits, table, slots), rows)
    got = process_logits(cp, masked_logits(cp, cp.asarray(logits), cp.asarray(table), slots), rows).get()
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    ids = np.array([1, 2, 3, 4, 5, 6], dtype=np.int32)
    host = token_logprobs(np, logits, [0, 3, 5], ids, 4)
    dev = [a.get() for a in token_logprobs(cp, cp.asarray(logits), [0, 3, 5], cp.asarray(ids), 4)]
    for a, b in zip(dev, host, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from engine.model.random_model import PRESETS, write_random_model
    return write_random_model(tmp_path_factory.mktemp("lp"), {**PRESETS["smollm2-135m"], "tie_word_embeddings": False}, seed=6)


def test_the_engine_follows_the_processed_logits_on_the_gpu(model_dir):
    import engine
    from engine.ops.logits_processing import process_row_ref
    llm = engine.LLM(model_dir, backend="cupy", max_seqs=8, max_context=1024)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, 49000, 12 + 5 * i).tolist() for i in range(4)]
    params = [SamplingParams(max_new_tokens=20, repetition_penalty=1.5, ignore_eos=True, logprobs=2),
              SamplingParams(max_new_tokens=20, presence_penalty=1.0, frequency_penalty=1.0, ignore_eos=True),
              SamplingParams(max_new_tokens=20, logit_bias={100: 30.0}, ignore_eos=True),
              SamplingParams(max_new_tokens=20, temperature=1.0, min_p=0.3, seed=4, ignore_eos=True)]
    outs = llm.generate(prompts, params)
    for prompt, p, out in zip(prompts[:3], params[:3], outs[:3], strict=True):
        full = llm.model.logits(prompt + out.token_ids[:-1])
        for i, token in enumerate(out.token_ids):
            row = process_row_ref(full[len(prompt) - 1 + i], p, prompt, out.token_ids[:i])
            assert row[token] >= row.max() - 0.05 * (row.max() - row.mean()), (p, i)
    assert outs[2].token_ids.count(100) >= 15
    full = llm.model.logits(prompts[0] + outs[0].token_ids[:-1]).astype(np.float64)
    for i, (lp, top) in enumerate(outs[0].logprobs):
        z = full[len(prompts[0]) - 1 + i]
        want = z - z.max() - np.log(np.exp(z - z.max()).sum())
        assert abs(lp - want[outs[0].token_ids[i]]) < 0.1 and len(top) == 2
    full = llm.model.logits(prompts[3] + outs[3].token_ids[:-1]).astype(np.float64)
    for i, token in enumerate(outs[3].token_ids):     # min-p: never a token far below the most likely
        z = full[len(prompts[3]) - 1 + i]
        assert np.exp(z[token] - z.max()) >= 0.3 * 0.8
    assert llm.stats()["pages_used"] == 0


@pytest.fixture(scope="module")
def chat_random_dir(tmp_path_factory, default_model_dir):
    """The default model's shape with random weights, and its tokenizer and chat template."""
    import shutil

    from engine.model.random_model import PRESETS, write_random_model
    out = write_random_model(tmp_path_factory.mktemp("lp-chat"), PRESETS["smollm2-135m"], seed=4)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(default_model_dir / name, out / name)
    return out


def test_constrained_outputs_on_the_gpu_with_async_scheduling(chat_random_dir):
    """Structured outputs on the device (masks from the runner's table, kernels_cu/logits_mask.cu),
    batched with plain and penalized rows, the steps overlapped (a constrained or penalized row's
    draw waits for the step in flight): every constrained answer matches, and the seeded tokens equal
    synchronous scheduling's on the same GPU."""
    import json
    import re

    from test_structured_outputs import SCHEMA, valid

    import engine
    pattern = r"(yes|no)[!?]{1,2} [0-9]{2,4}"
    params = ([SamplingParams(max_new_tokens=120, temperature=1.2, seed=s, structured=("json_schema", SCHEMA))
               for s in range(6)]
              + [SamplingParams(max_new_tokens=40, temperature=1.2, seed=s, structured=("regex", pattern)) for s in range(6)]
              + [SamplingParams(max_new_tokens=30, temperature=1.0, seed=1, ignore_eos=True),
                 SamplingParams(max_new_tokens=30, temperature=1.0, seed=2, repetition_penalty=1.3, ignore_eos=True)])
    prompts = [f"Answer {i}:" for i in range(len(params))]
    got = {}
    for async_scheduling in (True, False):
        llm = engine.LLM(chat_random_dir, backend="cupy", max_seqs=16, max_context=512,
                         async_scheduling=async_scheduling)
        outs = llm.generate(prompts, params)
        for out in outs[:6]:
            assert out.finish_reason == "stop" and valid(json.loads(out.text)), out.text
        for out in outs[6:12]:
            assert out.finish_reason == "stop" and re.fullmatch(pattern, out.text), out.text
        got[async_scheduling] = [o.token_ids for o in outs]
        llm.close()
    assert got[True] == got[False]
