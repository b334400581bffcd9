"""Qwen3-MoE configs (appendix on mixture of experts): which layers are sparse, the expert settings,
the two names transformers gives the expert count, and every variant the engine does not run refused
with the key named."""
import json
from dataclasses import replace

import numpy as np
import pytest
from helpers.oracle import needs_transformers

from engine.formats.config import ConfigError, config_from_dict, load_config, sparse_layers
from engine.model.random_model import PRESETS
from engine.model.weights import expected_shapes

MOE, MOE_UNTIED = PRESETS["tiny-qwen3-moe"], PRESETS["tiny-qwen3-moe-mqa-untied"]


def test_expert_settings_are_read():
    c = config_from_dict(MOE)
    assert (c.model_type, c.qk_norm, c.qkv_bias) == ("qwen3_moe", True, False)
    m = c.moe
    assert (m.num_experts, m.experts_per_token, m.expert_intermediate_size, m.norm_topk_prob) == (7, 3, 20, True)
    assert m.sparse_layers == (0, 2) and [c.is_sparse(i) for i in range(3)] == [True, False, True]
    assert config_from_dict(MOE_UNTIED).moe.sparse_layers == (1, 3)          # decoder_sparse_step 2
    assert config_from_dict(PRESETS["tiny-qwen3"]).moe is None


@pytest.mark.parametrize("layers,experts,step,mlp_only,want", [
    (4, 8, 1, [], (0, 1, 2, 3)), (6, 8, 2, [], (1, 3, 5)), (6, 8, 3, [2], (5,)), (5, 8, 1, [0, 4], (1, 2, 3)),
    (3, 0, 1, [], ()), (4, 8, 5, [], ())])
def test_sparse_layer_rule(layers, experts, step, mlp_only, want):
    assert sparse_layers(layers, experts, step, mlp_only) == want


def test_transformers_defaults_fill_missing_keys():
    """A qwen3_moe config.json without the expert keys is the model transformers builds from it."""
    bare = {k: v for k, v in MOE.items() if k not in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                                                      "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers")}
    m = config_from_dict(bare).moe
    assert (m.num_experts, m.experts_per_token, m.expert_intermediate_size, m.norm_topk_prob) == (128, 8, 768, False)
    assert m.sparse_layers == (0, 1, 2)


def test_num_local_experts_is_the_same_key():
    """transformers 5 writes num_local_experts (its attribute map sends num_experts there)."""
    renamed = {k: v for k, v in MOE.items() if k != "num_experts"}
    assert config_from_dict({**renamed, "num_local_experts": 7}) == config_from_dict(MOE)
    assert config_from_dict({**MOE, "num_local_experts": 7}) == config_from_dict(MOE)
    with pytest.raises(ConfigError, match="disagree"):
        config_from_dict({**MOE, "num_local_experts": 6})


def test_no_experts_means_every_layer_dense():
    c = config_from_dict({**MOE, "num_experts": 0})
    assert c.moe.sparse_layers == () and not any(n.endswith("gate.weight") for n in expected_shapes(c))


def test_the_real_shape_has_the_published_sizes():
    """Qwen3-30B-A3B: 30.5B parameters, 3.3B of them active per token."""
    c = config_from_dict({**PRESETS["qwen3-30b-a3b-4l"], "num_hidden_layers": 48})
    assert 30.5e9 <= c.num_parameters() < 30.6e9 and 3.3e9 <= c.num_parameters(active=True) < 3.4e9
    four = config_from_dict(PRESETS["qwen3-30b-a3b-4l"])
    assert four.moe == replace(c.moe, sparse_layers=(0, 1, 2, 3))      # the same layers, four of them


def test_tensor_names_of_both_layouts():
    c = config_from_dict(MOE)
    per_expert, fused = expected_shapes(c), expected_shapes(c, "fused")
    assert per_expert["model.layers.0.mlp.gate.weight"] == fused["model.layers.0.mlp.gate.weight"] == (7, 48)
    assert per_expert["model.layers.2.mlp.experts.6.gate_proj.weight"] == (20, 48)
    assert per_expert["model.layers.2.mlp.experts.6.down_proj.weight"] == (48, 20)
    assert fused["model.layers.2.mlp.experts.gate_up_proj"] == (7, 40, 48)
    assert fused["model.layers.2.mlp.experts.down_proj"] == (7, 48, 20)
    assert per_expert["model.layers.1.mlp.gate_proj.weight"] == (88, 48)         # the dense layer
    assert not any("experts" in n for n in per_expert if n.startswith("model.layers.1."))


def test_to_hf_dict_round_trips():
    for preset in ("tiny-qwen3-moe", "tiny-qwen3-moe-mqa-untied", "qwen3-30b-a3b-4l"):
        c = config_from_dict(PRESETS[preset])
        assert config_from_dict(c.to_hf_dict()) == c


REFUSED = {
    "experts negative": ({**MOE, "num_experts": -1}, "num_experts"),
    "experts a string": ({**MOE, "num_experts": "7"}, "num_experts"),
    "experts a float": ({**MOE, "num_experts": 7.0}, "num_experts"),
    "experts a bool": ({**MOE, "num_experts": True}, "num_experts"),
    "experts absurd": ({**MOE, "num_experts": 10**9}, "num_experts"),
    "local experts a string": ({**{k: v for k, v in MOE.items() if k != "num_experts"}, "num_local_experts": "7"},
                               "num_local_experts"),
    "no expert per token": ({**MOE, "num_experts_per_tok": 0}, "num_experts_per_tok"),
    "more per token than experts": ({**MOE, "num_experts_per_tok": 8}, "num_experts_per_tok"),
    "per token a float": ({**MOE, "num_experts_per_tok": 2.0}, "num_experts_per_tok"),
    "expert width zero": ({**MOE, "moe_intermediate_size": 0}, "moe_intermediate_size"),
    "norm as a string": ({**MOE, "norm_topk_prob": "true"}, "norm_topk_prob"),
    "norm as an int": ({**MOE, "norm_topk_prob": 1}, "norm_topk_prob"),
    "sparse step zero": ({**MOE, "decoder_sparse_step": 0}, "decoder_sparse_step"),
    "sparse step a string": ({**MOE, "decoder_sparse_step": "1"}, "decoder_sparse_step"),
    "mlp_only not a list": ({**MOE, "mlp_only_layers": 1}, "mlp_only_layers"),
    "mlp_only past the layers": ({**MOE, "mlp_only_layers": [3]}, "mlp_only_layers"),
    "mlp_only negative": ({**MOE, "mlp_only_layers": [-1]}, "mlp_only_layers"),
    "mlp_only repeated": ({**MOE, "mlp_only_layers": [1, 1]}, "mlp_only_layers"),
    "mlp_only bools": ({**MOE, "mlp_only_layers": [True]}, "mlp_only_layers"),
    "shared experts": ({**MOE, "shared_expert_intermediate_size": 64}, "shared_expert_intermediate_size"),
    "shared expert count": ({**MOE, "n_shared_experts": 1}, "n_shared_experts"),
    "scaled routing": ({**MOE, "routed_scaling_factor": 2.5}, "routed_scaling_factor"),
    "sigmoid routing": ({**MOE, "scoring_func": "sigmoid"}, "scoring_func"),
    "group-limited routing": ({**MOE, "n_group": 8, "topk_group": 4}, "n_group"),
    "dense first layers": ({**MOE, "first_k_dense_replace": 1}, "first_k_dense_replace"),
    "sliding window in use": ({**MOE, "use_sliding_window": True, "sliding_window": 64}, "sliding"),
    "awq experts": ({**MOE, "quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 16}},
                    "mixture-of-experts"),
    "experts on a dense family": ({**PRESETS["tiny-qwen3"], "num_experts": 8}, "num_experts"),
    "wrong architecture": ({**MOE, "architectures": ["Qwen3ForCausalLM"]}, "unsupported model"),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused(name):
    config, key = REFUSED[name]
    with pytest.raises(ConfigError, match=key):
        config_from_dict(config)


def test_training_only_and_neutral_keys_are_accepted():
    config_from_dict({**MOE, "router_aux_loss_coef": 0.5, "output_router_logits": True, "scoring_func": "softmax",
                      "routed_scaling_factor": 1.0, "shared_expert_intermediate_size": 0,
                      "max_window_layers": 48, "use_sliding_window": False, "sliding_window": 4096})


def test_quantizing_a_moe_model_is_refused(tmp_path):
    from engine.model.forward_pass import load_model
    from engine.model.random_model import write_random_model
    with pytest.raises(ValueError, match="mixture-of-experts"):
        load_model(write_random_model(tmp_path, "tiny-qwen3-moe"), backend="numpy", quantization="int8")


@needs_transformers
@pytest.mark.parametrize("preset", ["tiny-qwen3-moe", "tiny-qwen3-moe-mqa-untied", "qwen3-30b-a3b-4l"])
@pytest.mark.parametrize("override", [{}, {"decoder_sparse_step": 3, "mlp_only_layers": [0]},
                                      {"decoder_sparse_step": 1, "mlp_only_layers": [1, 2]}, {"num_experts": 0}])
def test_transformers_builds_the_same_layers(tmp_path, preset, override):
    """transformers' own model (on the meta device: no memory) has an expert block exactly on the layers
    the engine calls sparse, with the same expert count, top-k, width and renormalisation."""
    import torch
    import transformers
    config = {**PRESETS[preset], **override}
    (tmp_path / "config.json").write_text(json.dumps(config))
    hf, ours = transformers.AutoConfig.from_pretrained(tmp_path), load_config(tmp_path)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf)
    theirs = tuple(i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts"))
    assert theirs == ours.moe.sparse_layers
    if theirs:
        block = model.model.layers[theirs[0]].mlp
        assert block.experts.gate_up_proj.shape == (ours.moe.num_experts, 2 * ours.moe.expert_intermediate_size,
                                                    ours.hidden_size)
        assert (block.gate.top_k, block.gate.norm_topk_prob) == (ours.moe.experts_per_token, ours.moe.norm_topk_prob)
    assert ours.num_parameters() == sum(int(np.prod(p.shape)) for p in model.parameters())


@needs_transformers
def test_head_dim_defaults_to_hidden_over_heads_as_in_transformers(tmp_path):
    """Unlike Qwen3 (128), Qwen3-MoE without a head_dim takes hidden_size / num_attention_heads."""
    import torch
    import transformers
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in MOE.items() if k != "head_dim"}))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(tmp_path))
    assert model.model.layers[0].self_attn.head_dim == load_config(tmp_path).head_dim == 48 // 6
