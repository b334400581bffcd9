"""Qwen3-MoE against transformers (fp32, CPU) on tiny random configs, and its checkpoints in both layouts.

The reference logits and greedy tokens were produced by tests/fixtures/make_moe_fixtures.py and committed,
so this runs without torch; the test rebuilds the same random model directory (the sha256 of
model.safetensors must match) and holds engine.load_model(dir, backend="numpy").logits(ids) to them:
max |diff| / max |ref| <= 1e-4 and the same argmax at every position; the engine's greedy generation
must be transformers' token for token. With torch + transformers importable the checks also run live,
and on the layout transformers 5 keeps in memory (3-D expert tensors, save_original_format=False).
"""
import json
from dataclasses import replace

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

from engine.formats.config import ConfigError
from engine.formats.safetensors import load_file, save_file
from engine.model.forward_pass import Model, load_model
from engine.model.weights import NonFiniteWeightsError
from engine.runtime.llm import LLM
from engine.runtime.sampling_params import SamplingParams

INDEX = json.loads((FIXTURES / "moe_oracle_index.json").read_text())
NAMES = sorted(INDEX["models"])
REL_TOL = ORACLE_REL_TOL
REGENERATE = "regenerate the fixtures with `python tests/fixtures/make_moe_fixtures.py`"


@pytest.fixture(scope="module")
def rebuilt(tmp_path_factory):
    """name -> (model directory, token ids, reference logits), built lazily once per module."""
    return fixture_rebuilder(tmp_path_factory, INDEX, "moe_oracle")


def test_fixtures_cover_the_required_shapes():
    """Tied and untied, GQA and MQA, renormalised and raw weights, 1 to every expert per token, dense
    layers among the sparse ones both ways, BF16 and F32, and the config.json transformers writes."""
    configs = [INDEX["models"][n]["config"] for n in NAMES]
    assert {c["tie_word_embeddings"] for c in configs} == {True, False}
    assert {c["num_key_value_heads"] == 1 for c in configs} == {True, False}
    assert {c["norm_topk_prob"] for c in configs} == {True, False}
    per_token = {c["num_experts_per_tok"] for c in configs}
    assert {1, 2, 3} <= per_token
    assert any(c["num_experts_per_tok"] == c.get("num_experts", c.get("num_local_experts")) for c in configs)
    assert any(c["mlp_only_layers"] for c in configs) and {c["decoder_sparse_step"] for c in configs} >= {1, 2, 3}
    assert any(c.get("head_dim") * c["num_attention_heads"] != c["hidden_size"] for c in configs)
    assert {INDEX["models"][n]["dtype"] for n in NAMES} == {"BF16", "F32"}
    written = [c for c in configs if "transformers_version" in c]
    assert written and all("num_local_experts" in c and "rope_parameters" in c for c in written)


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
    [result] = LLM(model_dir, backend="numpy").generate([list(map(int, prompt))], SamplingParams(max_new_tokens=16))
    return result.token_ids


@pytest.mark.parametrize("name", NAMES)
def test_numpy_greedy_generation_matches_transformers_fixture(rebuilt, name):
    model_dir, _, _ = rebuilt(name)
    with np.load(FIXTURES / f"moe_oracle_{name}.npz") as f:
        prompt, expected = f["greedy_prompt"], f["greedy_tokens"].tolist()
    assert engine_greedy(model_dir, prompt) == expected


@pytest.mark.parametrize("name", ["tiny-qwen3-moe", "tiny-qwen3-moe-mqa-untied"])
def test_the_routing_details_matter(rebuilt, name):
    """Flipping norm_topk_prob, or one expert fewer per token, misses the fixture by far: the oracle
    would catch a router that skipped (or invented) the renormalisation or dropped an expert."""
    model_dir, ids, ref = rebuilt(name)
    model = load_model(model_dir, backend="numpy")
    moe = model.config.moe
    for wrong in (replace(moe, norm_topk_prob=not moe.norm_topk_prob), replace(moe, experts_per_token=1)):
        other = Model(replace(model.config, moe=wrong), model.weights, model.backend)
        assert relative_error(other.logits(ids.tolist()), ref) > 100 * REL_TOL, wrong


def fused_copy(model_dir, out_dir):
    """The directory with its experts rewritten in transformers 5's in-memory layout (3-D tensors)."""
    import shutil
    shutil.copytree(model_dir, out_dir)
    tensors = load_file(model_dir / "model.safetensors")
    config = json.loads((model_dir / "config.json").read_text())
    E = config.get("num_experts", config.get("num_local_experts"))
    for layer in sorted({n.split(".")[2] for n in tensors if ".mlp.experts." in n}):
        p = f"model.layers.{layer}.mlp.experts."
        gate, up, down = ([tensors.pop(f"{p}{e}.{proj}.weight") for e in range(E)]
                          for proj in ("gate_proj", "up_proj", "down_proj"))
        tensors[p + "gate_up_proj"] = np.stack([np.concatenate([g, u]) for g, u in zip(gate, up, strict=True)])
        tensors[p + "down_proj"] = np.stack(down)
    save_file(tensors, out_dir / "model.safetensors")
    return out_dir


def test_fused_expert_layout_loads_the_same_model(rebuilt, tmp_path):
    model_dir, ids, ref = rebuilt("tiny-qwen3-moe")
    fused = fused_copy(model_dir, tmp_path / "fused")
    a, b = load_model(model_dir, backend="numpy"), load_model(fused, backend="numpy")
    for la, lb in zip(a.weights.layers, b.weights.layers, strict=True):
        assert (la.moe is None) == (lb.moe is None)
        if la.moe is not None:
            for part in ("router", "gate_up", "down"):
                np.testing.assert_array_equal(getattr(la.moe, part), getattr(lb.moe, part))
    np.testing.assert_array_equal(b.logits(ids.tolist()), a.logits(ids.tolist()))


def test_experts_are_stacked_gate_rows_then_up_rows(rebuilt):
    model_dir, _, _ = rebuilt("tiny-qwen3-moe")
    tensors = load_file(model_dir / "model.safetensors")
    experts = load_model(model_dir, backend="numpy").weights.layers[2].moe
    I = experts.down.shape[2]
    p = "model.layers.2.mlp."
    np.testing.assert_array_equal(experts.router, tensors[p + "gate.weight"])
    np.testing.assert_array_equal(experts.gate_up[4, :I], tensors[p + "experts.4.gate_proj.weight"])
    np.testing.assert_array_equal(experts.gate_up[4, I:], tensors[p + "experts.4.up_proj.weight"])
    np.testing.assert_array_equal(experts.down[6], tensors[p + "experts.6.down_proj.weight"])


def _rewrite(model_dir, out_dir, edit):
    import shutil
    shutil.copytree(model_dir, out_dir)
    tensors = load_file(model_dir / "model.safetensors")
    edit(tensors)
    save_file(tensors, out_dir / "model.safetensors")
    return out_dir


BROKEN = {
    "an expert missing": (lambda t: t.pop("model.layers.2.mlp.experts.3.up_proj.weight"), ConfigError, "missing"),
    "one expert too many": (lambda t: t.update({"model.layers.0.mlp.experts.7.up_proj.weight":
                                                t["model.layers.0.mlp.experts.0.up_proj.weight"]}),
                            ConfigError, "unexpected"),
    "the router missing": (lambda t: t.pop("model.layers.0.mlp.gate.weight"), ConfigError, "missing"),
    "a router of the wrong shape": (lambda t: t.update({"model.layers.0.mlp.gate.weight":
                                                        t["model.layers.0.mlp.gate.weight"][:6]}),
                                    ConfigError, "shape"),
    "a dense MLP on a sparse layer": (lambda t: t.update({"model.layers.0.mlp.gate_proj.weight":
                                                          t["model.layers.1.mlp.gate_proj.weight"]}),
                                      ConfigError, "unexpected"),
    "a NaN in an expert": (lambda t: t["model.layers.2.mlp.experts.5.down_proj.weight"].__setitem__((0, 0), np.nan),
                           NonFiniteWeightsError, "experts.5.down_proj"),
}


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_broken_checkpoints_are_refused(rebuilt, tmp_path, name):
    edit, error, match = BROKEN[name]
    model_dir, _, _ = rebuilt("tiny-qwen3-moe")
    with pytest.raises(error, match=match):
        load_model(_rewrite(model_dir, tmp_path / "broken", edit), backend="numpy")


def test_mixed_expert_layouts_are_refused(rebuilt, tmp_path):
    """Layer 0 fused, layer 2 one tensor per expert: the first sparse layer's layout is expected of all."""
    model_dir, _, _ = rebuilt("tiny-qwen3-moe")
    per_expert = load_file(model_dir / "model.safetensors")
    mixed = fused_copy(model_dir, tmp_path / "mixed")
    tensors = {n: v for n, v in load_file(mixed / "model.safetensors").items()
               if not n.startswith("model.layers.2.mlp.experts")}
    tensors.update({n: v for n, v in per_expert.items() if n.startswith("model.layers.2.mlp.experts")})
    save_file(tensors, mixed / "model.safetensors")
    with pytest.raises(ConfigError, match="missing"):
        load_model(mixed, backend="numpy")


@needs_transformers
@pytest.mark.parametrize("name", NAMES)
def test_numpy_logits_match_transformers_live(rebuilt, name):
    model_dir, ids, ref = rebuilt(name)
    check_logits(hf_logits(model_dir, ids.tolist()), ref, f"{name}: transformers today vs the fixture")
    vocab = INDEX["models"][name]["config"]["vocab_size"]
    other = np.random.default_rng(11).integers(0, vocab, size=len(ids) // 2 + 5).tolist()
    check_logits(load_model(model_dir, backend="numpy").logits(other), hf_logits(model_dir, other),
                 f"{name} vs transformers live")


@needs_transformers
@pytest.mark.parametrize("name", NAMES)
def test_greedy_generation_matches_transformers_live(rebuilt, name):
    from helpers.oracle import hf_greedy
    model_dir, ids, _ = rebuilt(name)
    prompt = ids[-6:]                                      # another prompt than the fixture's
    assert engine_greedy(model_dir, prompt) == hf_greedy(model_dir, prompt).tolist()


@needs_transformers
def test_transformers_in_memory_layout_loads(rebuilt, tmp_path):
    """What transformers 5 writes with save_original_format=False (3-D gate_up_proj / down_proj) is
    read, and gives transformers' logits."""
    from helpers.oracle import hf_model
    model_dir, ids, ref = rebuilt("tiny-qwen3-moe-mqa-untied")
    hf_model(model_dir).save_pretrained(tmp_path / "saved", save_original_format=False)
    names = load_file(tmp_path / "saved" / "model.safetensors")
    assert "model.layers.1.mlp.experts.gate_up_proj" in names
    check_logits(load_model(tmp_path / "saved", backend="numpy").logits(ids.tolist()), ref, "fused save")
