"""The whole model against transformers (fp32, CPU) on tiny random Llama, Qwen2 and Qwen3 configs.

The reference logits were produced once by tests/fixtures/make_model_fixtures.py and committed, so this runs
without torch. The test rebuilds the very same random model directory (write_random_model is
deterministic: the sha256 of model.safetensors must match the fixture) and holds
engine.load_model(dir, backend="numpy").logits(ids) to them: max |diff| / max |ref| <= 1e-4 and
the same argmax at every position, and the engine's greedy generation from a short prompt must be
transformers' token for token. When torch + transformers are importable, the same checks also run
live against transformers on the same directory.
"""
import json

import numpy as np
import pytest
from helpers.oracle import (
    FIXTURES,
    ORACLE_REL_TOL,
    check_logits,
    fixture_rebuilder,
    hf_logits,
    needs_transformers,
    relative_error,
    sha256_file,
)

from engine.model.forward_pass import Model, load_model
from engine.runtime.llm import LLM
from engine.runtime.sampling_params import SamplingParams

INDEX = json.loads((FIXTURES / "model_oracle_index.json").read_text())
NAMES = sorted(INDEX["models"])
REL_TOL = ORACLE_REL_TOL
REGENERATE = "regenerate the fixtures with `python tests/fixtures/make_model_fixtures.py`"


@pytest.fixture(scope="module")
def rebuilt(tmp_path_factory):
    """name -> (model directory, token ids, reference logits), built lazily once per module."""
    return fixture_rebuilder(tmp_path_factory, INDEX, "model_oracle")


def rope_of(config: dict) -> dict:
    """The rope settings of either layout (older: top-level keys; current: rope_parameters)."""
    return config.get("rope_parameters") or config.get("rope_scaling") or {}


def test_fixtures_cover_the_required_shapes():
    """Tied and untied, MHA / GQA / MQA, head_dim != hidden/heads, llama3 scaling and none, both
    config layouts (and the current one exactly as transformers writes it)."""
    configs = [INDEX["models"][n]["config"] for n in NAMES]
    ratios = {c["num_attention_heads"] // c.get("num_key_value_heads", c["num_attention_heads"]) for c in configs}
    assert {1, 3, 4} <= ratios and any(c.get("num_key_value_heads") == 1 for c in configs)
    assert {c["tie_word_embeddings"] for c in configs} == {True, False}
    assert any(c.get("head_dim", 0) * c["num_attention_heads"] != c["hidden_size"] for c in configs)
    kinds = {rope_of(c).get("rope_type", "default") for c in configs}
    assert kinds == {"default", "llama3"}
    current = [c for c in configs if "rope_parameters" in c]
    older = [c for c in configs if "rope_parameters" not in c]
    assert {rope_of(c).get("rope_type", "default") for c in current} == {"default", "llama3"} and older
    assert all("transformers_version" in c and "rope_theta" not in c for c in current)
    assert any(rope_of(c).get("rope_theta", 10000.0) != 10000.0 for c in current)
    assert {INDEX["models"][n]["dtype"] for n in NAMES} == {"BF16", "F32"}


def test_fixtures_cover_the_qwen_families():
    """Qwen2 and Qwen3 each: GQA and MQA, tied and untied; Qwen3 with head_dim != hidden / heads and
    in the layout transformers writes."""
    for family in ("qwen2", "qwen3"):
        configs = [INDEX["models"][n]["config"] for n in NAMES if INDEX["models"][n]["config"]["model_type"] == family]
        assert {c["num_key_value_heads"] == 1 for c in configs} == {True, False}
        assert {c["tie_word_embeddings"] for c in configs} == {True, False}
    qwen3 = [INDEX["models"][n]["config"] for n in NAMES if INDEX["models"][n]["config"]["model_type"] == "qwen3"]
    assert any(c["head_dim"] * c["num_attention_heads"] != c["hidden_size"] for c in qwen3)
    assert any("rope_parameters" in c for c in qwen3)


def test_qwen_features_matter(rebuilt):
    """Without its biases (Qwen2) or q/k norms (Qwen3) the model misses the fixture by far: the
    oracle would catch an engine that loaded them and then ignored them."""
    for name in ("tiny-qwen2", "tiny-qwen3"):
        model_dir, ids, ref = rebuilt(name)
        model = load_model(model_dir, backend="numpy")
        for layer in model.weights.layers:
            layer.qkv_bias = layer.q_norm = layer.k_norm = None
        assert relative_error(model.logits(ids.tolist()), ref) > 100 * REL_TOL, name


@pytest.mark.parametrize("name", [n for n in NAMES if "rope_parameters" in INDEX["models"][n]["config"]])
def test_current_layout_theta_is_read(rebuilt, name):
    """The fixture would catch an engine that ignores rope_parameters and runs with theta 10000."""
    from dataclasses import replace
    model_dir, ids, ref = rebuilt(name)
    model = load_model(model_dir, backend="numpy")
    assert model.config.rope_theta == rope_of(INDEX["models"][name]["config"])["rope_theta"]
    if model.config.rope_theta != 10000.0:
        wrong = Model(replace(model.config, rope_theta=10000.0), model.weights, model.backend)
        assert relative_error(wrong.logits(ids.tolist()), ref) > 10 * REL_TOL


@pytest.mark.parametrize("name", NAMES)
def test_random_model_is_rebuilt_bit_for_bit(rebuilt, name):
    model_dir, _, _ = rebuilt(name)
    assert sha256_file(model_dir / "model.safetensors") == INDEX["models"][name]["sha256"], \
        f"write_random_model no longer writes the same weights for {name}: {REGENERATE}"


@pytest.mark.parametrize("name", NAMES)
def test_numpy_logits_match_transformers_fixture(rebuilt, name):
    model_dir, ids, ref = rebuilt(name)
    check_logits(load_model(model_dir, backend="numpy").logits(ids.tolist()), ref, f"{name} vs fixture")


def engine_greedy(model_dir, prompt) -> list[int]:
    """The engine's greedy continuation (KV cache, paged, continuous batching; stops at an eos)."""
    llm = LLM(model_dir, backend="numpy")
    [result] = llm.generate([list(map(int, prompt))], SamplingParams(max_new_tokens=16))
    return result.token_ids


@pytest.mark.parametrize("name", NAMES)
def test_numpy_greedy_generation_matches_transformers_fixture(rebuilt, name):
    model_dir, _, _ = rebuilt(name)
    with np.load(FIXTURES / f"model_oracle_{name}.npz") as f:
        prompt, expected = f["greedy_prompt"], f["greedy_tokens"].tolist()
    assert engine_greedy(model_dir, prompt) == expected


@pytest.mark.parametrize("name", NAMES[:3])
def test_logits_are_causal(rebuilt, name):
    """The logits of a prefix are the first rows of the logits of the whole sequence."""
    model_dir, ids, _ = rebuilt(name)
    model = load_model(model_dir, backend="numpy")
    full = model.logits(ids)
    for n in (1, 2, len(ids) // 3):
        np.testing.assert_allclose(model.logits(ids[:n]), full[:n], rtol=1e-5, atol=1e-5 * np.abs(full).max())


def test_logits_refuses_bad_token_ids(rebuilt):
    model = load_model(rebuilt(NAMES[0])[0], backend="numpy")
    for bad in ([], [-1], [model.config.vocab_size], [[1, 2]], [1.5]):
        with pytest.raises(ValueError):
            model.logits(bad)


@needs_transformers
@pytest.mark.parametrize("name", NAMES)
def test_numpy_logits_match_transformers_live(rebuilt, name):
    model_dir, ids, ref = rebuilt(name)
    live = hf_logits(model_dir, ids.tolist())
    check_logits(live, ref, f"{name}: transformers today vs the fixture")
    # fresh ids (another length, other tokens) so the live test is not only a replay of the fixture
    vocab = INDEX["models"][name]["config"]["vocab_size"]
    other = np.random.default_rng(7).integers(0, vocab, size=len(ids) // 2 + 3).tolist()
    check_logits(load_model(model_dir, backend="numpy").logits(other), hf_logits(model_dir, other),
                 f"{name} vs transformers live")


@needs_transformers
@pytest.mark.parametrize("name", [n for n in NAMES if "qwen" in n])
def test_greedy_generation_matches_transformers_live(rebuilt, name):
    from helpers.oracle import hf_greedy
    model_dir, ids, _ = rebuilt(name)
    prompt = ids[-5:]                                      # another prompt than the fixture's
    assert engine_greedy(model_dir, prompt) == hf_greedy(model_dir, prompt).tolist()
