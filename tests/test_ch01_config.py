"""config.json validation and checkpoint/config agreement (engine/formats/config.py, engine/model/weights.py)."""

import numpy as np
import pytest

from engine.backend import resolve_backend
from engine.formats.config import ConfigError, config_from_dict, load_config
from engine.formats.safetensors import save_file
from engine.model.random_model import PRESETS, random_weights, write_random_model
from engine.model.weights import load_weights

LLAMA1B = PRESETS["llama-3.2-1b"]


def test_llama_3_2_1b_shape():
    c = config_from_dict(LLAMA1B)
    assert (c.head_dim, c.group_size, c.q_dim, c.kv_dim) == (64, 4, 2048, 512)
    assert c.kv_bytes_per_token() == 32 * 1024                     # 32 KiB per cached token in bf16
    assert c.rope_scaling.factor == 32.0 and c.eos_token_ids == (128001, 128008, 128009)
    assert abs(c.num_parameters() - 1_235_814_400) < 1e6


def test_head_dim_derived_or_explicit():
    base = {k: v for k, v in PRESETS["smollm2-135m"].items() if k != "head_dim"}
    assert config_from_dict(base).head_dim == 64                 # 576 / 9
    assert config_from_dict({**base, "head_dim": 32}).head_dim == 32
    with pytest.raises(ConfigError, match="not divisible"):
        config_from_dict({**base, "hidden_size": 577})


def test_gqa_defaults_to_mha_and_must_divide():
    base = {k: v for k, v in PRESETS["tiny"].items() if k != "num_key_value_heads"}
    assert config_from_dict(base).group_size == 1
    with pytest.raises(ConfigError, match="multiple"):
        config_from_dict({**base, "num_key_value_heads": 4})     # 6 heads


def test_eos_ids_merge_generation_config():
    c = config_from_dict({**PRESETS["tiny"], "eos_token_id": 2}, {"eos_token_id": [2, 5, 7]})
    assert c.eos_token_ids == (2, 5, 7)
    with pytest.raises(ConfigError, match="eos_token_id"):
        config_from_dict({**PRESETS["tiny"], "eos_token_id": 10_000})


@pytest.mark.parametrize("key,value,match", [
    ("model_type", "mistral", "unsupported model"),
    ("architectures", ["LlamaForSequenceClassification"], "unsupported model"),
    ("hidden_act", "gelu", "hidden_act"),
    ("attention_bias", True, "attention_bias"),
    ("mlp_bias", True, "mlp_bias"),
    ("sliding_window", 4096, "sliding_window"),
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "not supported"),
    ("rope_scaling", {"rope_type": "llama3", "factor": 8.0}, "low_freq_factor"),
    ("rope_scaling", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0,
                      "original_max_position_embeddings": 8192}, "inconsistent"),
    ("num_hidden_layers", 0, "num_hidden_layers' must be an integer"),
    ("vocab_size", "many", "vocab_size' must be an integer"),
    ("rms_norm_eps", -1.0, "rms_norm_eps' must be a finite number"),
    ("rope_theta", float("nan"), "rope_theta' must be a finite number"),
    ("head_dim", 15, "even"),
])
def test_refuses_what_changes_the_math(key, value, match):
    with pytest.raises(ConfigError, match=match):
        config_from_dict({**PRESETS["tiny"], key: value})


def test_config_error_is_a_value_error_and_names_the_file(tmp_path):
    assert issubclass(ConfigError, ValueError)
    with pytest.raises(ConfigError, match="config.json is missing"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path)


def test_roundtrip_through_hf_dict():
    c = config_from_dict(LLAMA1B)
    assert config_from_dict(c.to_hf_dict()) == c


@pytest.fixture()
def tiny_dir(tmp_path):
    return write_random_model(tmp_path / "m", "tiny", seed=5)


def _rewrite(model_dir, mutate, dtype="BF16"):
    config = load_config(model_dir)
    tensors = random_weights(config, seed=5)
    mutate(tensors)
    save_file(tensors, model_dir / "model.safetensors", dtype=dtype)


def test_missing_tensor_is_refused(tiny_dir):
    _rewrite(tiny_dir, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ConfigError, match="missing"):
        load_weights(tiny_dir, load_config(tiny_dir), resolve_backend("numpy"))


def test_unexpected_tensor_is_refused(tiny_dir):
    _rewrite(tiny_dir, lambda t: t.update({"model.layers.2.mlp.up_proj.weight": np.zeros((3, 3), np.float32)}))
    with pytest.raises(ConfigError, match="unexpected"):
        load_weights(tiny_dir, load_config(tiny_dir), resolve_backend("numpy"))


def test_wrong_shape_is_refused(tiny_dir):
    def shrink(t):
        t["model.layers.0.self_attn.k_proj.weight"] = t["model.layers.0.self_attn.k_proj.weight"][:-1]
    _rewrite(tiny_dir, shrink)
    with pytest.raises(ConfigError, match="shape"):
        load_weights(tiny_dir, load_config(tiny_dir), resolve_backend("numpy"))


def test_integer_weights_are_refused(tiny_dir):
    _rewrite(tiny_dir, lambda t: t.update({"model.norm.weight": np.ones(72, np.int32)}))
    with pytest.raises(ConfigError, match="I32"):
        load_weights(tiny_dir, load_config(tiny_dir), resolve_backend("numpy"))


@pytest.mark.parametrize("dtype", ["F32", "F16", "BF16"])
def test_weights_in_any_float_dtype_give_the_same_model(tmp_path, dtype):
    import engine
    ref = engine.load_model(write_random_model(tmp_path / "bf16", "tiny", seed=6), backend="numpy")
    other = engine.load_model(write_random_model(tmp_path / dtype, "tiny", seed=6, dtype=dtype), backend="numpy")
    ids = [5, 9, 100, 7]
    tol = 2e-2 if dtype != "BF16" else 0.0   # F32/F16 hold the unrounded random values
    np.testing.assert_allclose(other.logits(ids), ref.logits(ids), rtol=tol, atol=tol * 10)


def test_fused_weights_are_the_stacked_projections(tiny_dir):
    from engine.formats.safetensors import load_file
    config = load_config(tiny_dir)
    w = load_weights(tiny_dir, config, resolve_backend("numpy"))
    t = load_file(tiny_dir / "model.safetensors")
    p = "model.layers.1."
    np.testing.assert_array_equal(w.layers[1].qkv, np.concatenate(
        [t[p + "self_attn.q_proj.weight"], t[p + "self_attn.k_proj.weight"], t[p + "self_attn.v_proj.weight"]]))
    np.testing.assert_array_equal(w.layers[1].gate_up, np.concatenate(
        [t[p + "mlp.gate_proj.weight"], t[p + "mlp.up_proj.weight"]]))
    assert w.lm_head is w.embed                                     # tied


def test_tied_checkpoint_may_carry_lm_head_copy(tiny_dir):
    _rewrite(tiny_dir, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"]}))
    load_weights(tiny_dir, load_config(tiny_dir), resolve_backend("numpy"))
