"""Qwen3.5 configs (qwen3_5_text, and the text_config of a qwen3_5 directory): every key transformers'
Qwen3_5TextConfig reads is honoured or refused with the key named, never approximated."""
import copy

import pytest
from helpers.oracle import needs_transformers

from engine.formats.config import ConfigError, HybridConfig, config_from_dict
from engine.model.hybrid_weights import hybrid_shapes
from engine.model.random_model import PRESETS, random_weights

TINY = PRESETS["tiny-qwen3.5"]
LIN, FULL = "linear_attention", "full_attention"


def with_rope(**rope):
    return {**TINY, "rope_parameters": {**TINY["rope_parameters"], **rope}}


def multimodal(text=None, **outer):
    text = copy.deepcopy(TINY if text is None else text)
    text.pop("architectures", None)
    return {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": text,
            **outer}


def test_values_are_read():
    c = config_from_dict(TINY)
    assert isinstance(c, HybridConfig) and c.model_type == "qwen3_5_text"
    assert c.layer_types == (LIN, LIN, FULL, LIN) and c.full_attention_layers == (2,)
    assert (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim) == \
        (2, 6, 8, 10)
    assert c.conv_dim == 2 * 2 * 8 + 6 * 10 and c.linear_conv_kernel_dim == 4
    assert c.rotary_dim == 4 and c.partial_rotary_factor == 0.25 and c.rope_theta == 1e7
    assert c.qk_norm and not c.qkv_bias and c.weights_prefix == "model."
    assert c.kv_bytes_per_token(2) == 2 * 1 * c.kv_dim * 2         # one full-attention layer holds K/V


def test_transformers_defaults_fill_missing_keys():
    """What transformers' Qwen3_5TextConfig assumes when a key is absent: one full layer in four, a
    quarter of each head rotated, head_dim 256, the linear sizes of the 9B model."""
    minimal = {k: TINY[k] for k in ("model_type", "vocab_size", "hidden_size", "intermediate_size",
                                    "num_hidden_layers", "num_attention_heads")}
    c = config_from_dict({**minimal, "num_hidden_layers": 8})
    assert c.layer_types == (LIN, LIN, LIN, FULL) * 2
    assert (c.head_dim, c.num_key_value_heads, c.partial_rotary_factor, c.rotary_dim) == (256, 4, 0.25, 64)
    assert (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim) == (16, 32, 128)
    assert c.tie_word_embeddings is False and c.max_position_embeddings == 32768
    assert config_from_dict({**minimal, "full_attention_interval": 2}).layer_types == (LIN, FULL, LIN, FULL)
    assert config_from_dict({**TINY, "partial_rotary_factor": 0.5, "rope_parameters": {"rope_theta": 1e4}}).rotary_dim == 8


def test_text_only_mrope_keys_are_accepted():
    """Real Qwen3.5 configs carry multimodal RoPE sections; for text all three position rows are the
    token's position, so it is ordinary RoPE."""
    c = config_from_dict(with_rope(mrope_section=[11, 11, 10], mrope_interleaved=True))
    assert c.rotary_dim == 4


def test_vision_language_directory_reads_its_text_config():
    c = config_from_dict(multimodal(tie_word_embeddings=True))
    assert c.weights_prefix == "model.language_model." and c.tie_word_embeddings
    assert c.layer_types == config_from_dict(TINY).layer_types
    assert all(n.startswith("model.language_model.") for n in hybrid_shapes(c))
    untied = config_from_dict(multimodal({**TINY, "tie_word_embeddings": False}))
    assert "lm_head.weight" in hybrid_shapes(untied)


def test_to_hf_dict_round_trips():
    for name in ("tiny-qwen3.5", "tiny-qwen3.5-mqa-untied", "qwen3.5-0.8b"):
        c = config_from_dict(PRESETS[name])
        assert config_from_dict(c.to_hf_dict()) == c


def test_parameter_count_is_the_tensors():
    for name in ("tiny-qwen3.5", "tiny-qwen3.5-mqa-untied"):
        c = config_from_dict(PRESETS[name])
        assert c.num_parameters() == sum(a.size for a in random_weights(c).values())
    # Qwen3.5-0.8B: about 0.75 B parameters in its language model (the rest of "0.8B" is the vision tower)
    assert 700e6 < config_from_dict(PRESETS["qwen3.5-0.8b"]).num_parameters() < 800e6


REFUSED = {
    "unknown layer type": ({**TINY, "layer_types": [LIN, "sliding_attention", FULL, LIN]}, "layer_types"),
    "layer_types too short": ({**TINY, "layer_types": [LIN, FULL]}, "layer_types"),
    "layer_types not a list": ({**TINY, "layer_types": "linear_attention"}, "layer_types"),
    "interval zero": ({**{k: v for k, v in TINY.items() if k != "layer_types"}, "full_attention_interval": 0},
                      "full_attention_interval"),
    "value heads not a multiple": ({**TINY, "linear_num_value_heads": 5}, "linear_num_value_heads"),
    "key heads zero": ({**TINY, "linear_num_key_heads": 0}, "linear_num_key_heads"),
    "head dim a float": ({**TINY, "linear_key_head_dim": 8.0}, "linear_key_head_dim"),
    "conv kernel a string": ({**TINY, "linear_conv_kernel_dim": "4"}, "linear_conv_kernel_dim"),
    "conv kernel zero": ({**TINY, "linear_conv_kernel_dim": 0}, "linear_conv_kernel_dim"),
    "odd rotary dims": (with_rope(partial_rotary_factor=0.1875), "rotary dimensions"),
    "rotary factor zero": (with_rope(partial_rotary_factor=0.0), "partial_rotary_factor"),
    "rotary factor above one": (with_rope(partial_rotary_factor=1.5), "partial_rotary_factor"),
    "rotary factors disagree": ({**with_rope(partial_rotary_factor=0.25), "partial_rotary_factor": 0.5},
                                "disagree"),
    "llama3 rope": (with_rope(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0),
                    "rope_type"),
    "yarn rope": (with_rope(rope_type="yarn", factor=4.0), "rope_type"),
    "rope key it would ignore": (with_rope(factor=2.0), "factor"),
    "mrope section not three": (with_rope(mrope_section=[11, 21]), "mrope_section"),
    "mrope interleaved not a bool": (with_rope(mrope_interleaved="yes"), "mrope_interleaved"),
    "no output gate": ({**TINY, "attn_output_gate": False}, "attn_output_gate"),
    "attention bias": ({**TINY, "attention_bias": True}, "attention_bias"),
    "gelu": ({**TINY, "hidden_act": "gelu"}, "hidden_act"),
    "experts": ({**TINY, "num_experts": 8}, "num_experts"),
    "quantized": ({**TINY, "quantization_config": {"quant_method": "awq", "bits": 4}}, "quantization_config"),
    "wrong architecture": ({**TINY, "architectures": ["Qwen3ForCausalLM"]}, "unsupported model"),
    "moe text": ({**TINY, "model_type": "qwen3_5_moe_text"}, "unsupported model"),
    "eos out of range": ({**TINY, "eos_token_id": 331}, "eos_token_id"),
    "no text_config": ({"model_type": "qwen3_5", "vision_config": {}}, "text_config"),
    "text_config of another family": (multimodal({**TINY, "model_type": "qwen3_text"}), "text_config.model_type"),
    "tie disagrees": (multimodal({**TINY, "tie_word_embeddings": True}, tie_word_embeddings=False), "disagree"),
    "vision-language architecture": ({**multimodal(), "architectures": ["Qwen3_5ForCausalLM"]}, "unsupported"),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused(name):
    config, message = REFUSED[name]
    with pytest.raises(ConfigError, match=message):
        config_from_dict(config)


def test_dense_families_still_refuse_hybrid_keys():
    with pytest.raises(ConfigError, match="layer_types"):
        config_from_dict({**PRESETS["tiny-qwen3"], "layer_types": [LIN, FULL]})
    with pytest.raises(ConfigError, match="partial_rotary_factor"):
        config_from_dict({**PRESETS["tiny-qwen3"], "partial_rotary_factor": 0.25})


@needs_transformers
@pytest.mark.parametrize("name", ["tiny-qwen3.5", "tiny-qwen3.5-mqa-untied", "qwen3.5-0.8b"])
def test_transformers_reads_the_same_settings(name):
    import transformers
    d = copy.deepcopy(PRESETS[name])
    hf = transformers.AutoConfig.for_model(d.pop("model_type"), **d)
    c = config_from_dict(PRESETS[name])
    assert tuple(hf.layer_types) == c.layer_types
    assert int(hf.head_dim * hf.rope_parameters["partial_rotary_factor"]) == c.rotary_dim
    for key in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                "linear_conv_kernel_dim", "num_key_value_heads", "head_dim", "tie_word_embeddings"):
        assert getattr(hf, key) == getattr(c, key), key
