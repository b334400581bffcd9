"""Qwen2 / Qwen3 configs: the family is read from model_type and architectures, every setting that
changes the math is honoured or refused, and transformers reads the same directories the same way."""
import json

import numpy as np
import pytest
from helpers.oracle import needs_transformers

from engine.formats.config import ConfigError, config_from_dict, load_config
from engine.model.random_model import PRESETS, random_weights, write_random_model
from engine.model.weights import expected_shapes

QWEN2, QWEN3 = PRESETS["tiny-qwen2"], PRESETS["tiny-qwen3"]


def test_family_features():
    q2, q3, llama = config_from_dict(QWEN2), config_from_dict(QWEN3), config_from_dict(PRESETS["tiny"])
    assert (q2.model_type, q2.qkv_bias, q2.qk_norm) == ("qwen2", True, False)
    assert (q3.model_type, q3.qkv_bias, q3.qk_norm) == ("qwen3", False, True)
    assert (llama.model_type, llama.qkv_bias, llama.qk_norm) == ("llama", False, False)
    assert q2.head_dim == QWEN2["hidden_size"] // QWEN2["num_attention_heads"]
    assert q3.head_dim == 24 != QWEN3["hidden_size"] // QWEN3["num_attention_heads"]
    no_head_dim = {k: v for k, v in QWEN3.items() if k != "head_dim"}
    assert config_from_dict(no_head_dim).head_dim == 128            # transformers' Qwen3Config default


def test_tensor_names_per_family():
    q2, q3 = expected_shapes(config_from_dict(QWEN2)), expected_shapes(config_from_dict(QWEN3))
    assert q2["model.layers.1.self_attn.k_proj.bias"] == (2 * 14,)
    assert not any(n.endswith("_norm.weight") and "self_attn" in n for n in q2)
    assert q3["model.layers.0.self_attn.q_norm.weight"] == (24,)
    assert not any(n.endswith(".bias") for n in q3)


def test_real_shapes_have_the_published_sizes():
    assert round(config_from_dict(PRESETS["qwen2.5-0.5b"]).num_parameters() / 1e6) == 494
    assert round(config_from_dict(PRESETS["qwen3-0.6b"]).num_parameters() / 1e6) == 596


REFUSED = {
    "sliding window in use (qwen2)": ({**QWEN2, "use_sliding_window": True, "sliding_window": 64,
                                       "max_window_layers": 1}, "sliding"),
    "sliding window in use (qwen3)": ({**QWEN3, "use_sliding_window": True, "sliding_window": 64,
                                       "max_window_layers": 0}, "sliding"),
    "sliding layer types": ({**QWEN3, "layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
    "qwen3 attention bias": ({**QWEN3, "attention_bias": True}, "attention_bias"),
    "yarn rope": ({**QWEN2, "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                             "original_max_position_embeddings": 32768}}, "yarn"),
    "dynamic rope": ({**QWEN3, "rope_scaling": {"type": "dynamic", "factor": 2.0}}, "dynamic"),
    "mlp bias": ({**QWEN2, "mlp_bias": True}, "mlp_bias"),
    "wrong architecture": ({**QWEN2, "architectures": ["Qwen3ForCausalLM"]}, "unsupported model"),
    "qwen2 moe": ({**QWEN2, "model_type": "qwen2_moe", "architectures": ["Qwen2MoeForCausalLM"]}, "unsupported model"),
    "partial rotary": ({**QWEN3, "partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    "sliding window not an int": ({**QWEN2, "sliding_window": "4096"}, "sliding_window"),
    "use_sliding_window not a bool": ({**QWEN2, "use_sliding_window": "false"}, "use_sliding_window"),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused(name):
    config, key = REFUSED[name]
    with pytest.raises(ConfigError, match=key):
        config_from_dict(config)


def test_sliding_window_keys_that_change_nothing_are_accepted():
    """As Qwen configs write them: a window size with use_sliding_window false, or enabled but starting
    at a layer past the last one (transformers then builds no sliding layer either)."""
    config_from_dict({**QWEN2, "use_sliding_window": False, "sliding_window": 32768, "max_window_layers": 0})
    config_from_dict({**QWEN2, "use_sliding_window": True, "sliding_window": 64, "max_window_layers": 2})
    config_from_dict({**QWEN3, "use_sliding_window": True, "sliding_window": None})


def test_qwen3_checkpoint_without_q_norm_is_refused(tmp_path):
    from engine.formats.safetensors import save_file
    from engine.model.forward_pass import load_model
    model_dir = write_random_model(tmp_path, "tiny-qwen3")
    tensors = random_weights(config_from_dict(QWEN3))
    del tensors["model.layers.1.self_attn.k_norm.weight"]
    save_file(tensors, model_dir / "model.safetensors")
    with pytest.raises(ConfigError, match="missing"):
        load_model(model_dir, backend="numpy")


def test_to_hf_dict_round_trips():
    for preset in ("tiny-qwen2", "tiny-qwen3-mqa-untied", "qwen2.5-0.5b"):
        c = config_from_dict(PRESETS[preset])
        assert config_from_dict(c.to_hf_dict()) == c


@needs_transformers
@pytest.mark.parametrize("preset", ["tiny-qwen2", "tiny-qwen3", "qwen2.5-0.5b", "qwen3-0.6b"])
def test_transformers_reads_the_same_model(tmp_path, preset):
    import transformers
    (tmp_path / "config.json").write_text(json.dumps(PRESETS[preset]))
    hf, ours = transformers.AutoConfig.from_pretrained(tmp_path), load_config(tmp_path)
    assert type(hf).__name__ == PRESETS[preset]["architectures"][0].replace("ForCausalLM", "Config")
    assert all("sliding" not in t for t in hf.layer_types)
    assert ours.rope_theta == hf.rope_parameters["rope_theta"]
    assert ours.head_dim == getattr(hf, "head_dim", hf.hidden_size // hf.num_attention_heads)
    assert np.isclose(ours.rms_norm_eps, hf.rms_norm_eps)


@pytest.mark.parametrize("preset", ["tiny-qwen2", "tiny-qwen3"])
def test_a_learners_rope_runs_after_the_bias_and_norm(tmp_path, preset):
    """With a NumPy rope override the bias and q/k norm still apply (unfused, before it): a correct
    rotation gives the engine's logits."""
    from engine.model.forward_pass import load_model
    from engine.ops.rope import rope_ref
    from engine.plugins import use_stage
    model = load_model(write_random_model(tmp_path, preset), backend="numpy")
    ids = list(range(3, 40))
    want = model.logits(ids)
    with use_stage("rope", rope_ref):
        got = model.logits(ids)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
