"""Write the whole-model oracle fixtures: transformers' fp32 CPU logits of tiny random Llama, Qwen2 and
Qwen3 models, and transformers' greedy generation from a short prompt.

    pip install -e ".[oracle]"        # torch + transformers (CPU is enough)
    python tests/make_model_fixtures.py

Configs come in both layouts: the older one (top-level rope_theta / rope_scaling) and the current
one, which is the config.json that transformers itself writes (`rope_parameters`), produced here by
transformers' config class of the family (...).save_pretrained. For every config it writes the random model
directory (engine.random_model, fixed seed), runs transformers on fixed token ids and stores, in
tests/fixtures/:
    model_oracle_<name>.npz     token_ids int32 [T], logits float32 [T, V], greedy_prompt int32 [P] and
                                greedy_tokens int32 [G] (transformers' generate, do_sample=False)
    model_oracle_index.json     per config: the config dict, seed, dtype, sha256 of model.safetensors
    model_oracle_bf16_torch.npz float32 bit patterns and torch's bf16 bits (non-NaN inputs)
tests/test_model_oracle.py rebuilds each directory, checks its hash, and holds the engine to the logits.
"""
from __future__ import annotations

import copy
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from oracle_helpers import FIXTURES, GEN_CONFIG, hf_logits, sha256_file  # noqa: E402

from engine.random_model import PRESETS, write_random_model  # noqa: E402

# name -> (config dict, dtype on disk, number of tokens). Together: tied and untied embeddings,
# MHA / GQA 3 / GQA 4 / MQA, head_dim != hidden / heads, llama3 scaling (positions past the original
# context), no scaling, odd sizes, BF16 and F32 checkpoints, eos lists.
ORACLE_CONFIGS = {
    "tiny": (PRESETS["tiny"], "BF16", 96),
    "tiny-mha-untied": (PRESETS["tiny-mha-untied"], "BF16", 45),
    "tiny-mqa": (PRESETS["tiny-mqa"], "BF16", 53),
    "gen-gqa-untied": (GEN_CONFIG, "BF16", 61),
    "gqa4-odd-f32": ({**PRESETS["tiny"], "vocab_size": 211, "hidden_size": 56, "intermediate_size": 77,
                      "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
                      "head_dim": 10, "rms_norm_eps": 1e-6, "rope_theta": 500000.0,
                      "max_position_embeddings": 128, "tie_word_embeddings": False,
                      "eos_token_id": [2, 7],
                      "rope_scaling": {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 2.0,
                                       "high_freq_factor": 8.0, "original_max_position_embeddings": 40}},
                     "F32", 70),
    "mha-wide-head-noscale": ({**PRESETS["tiny"], "vocab_size": 157, "hidden_size": 42,
                               "intermediate_size": 64, "num_hidden_layers": 3,
                               "num_attention_heads": 3, "num_key_value_heads": 3, "head_dim": 24,
                               "rope_theta": 1000000.0, "rope_scaling": None,
                               "max_position_embeddings": 64},
                              "BF16", 33),
    # Qwen2 (q/k/v biases): GQA 3 tied, MQA untied; Qwen3 (q/k norm, head_dim != hidden / heads):
    # GQA 2 tied, MQA untied with an F32 checkpoint. Random biases and norm weights throughout.
    "tiny-qwen2": (PRESETS["tiny-qwen2"], "BF16", 57),
    "tiny-qwen2-mqa-untied": (PRESETS["tiny-qwen2-mqa-untied"], "BF16", 48),
    "tiny-qwen3": (PRESETS["tiny-qwen3"], "BF16", 51),
    "tiny-qwen3-mqa-untied": (PRESETS["tiny-qwen3-mqa-untied"], "F32", 66),
}
# name -> the older-layout config above it is rewritten from, by transformers, into the current layout
CURRENT_LAYOUT = {"tiny-rope-parameters": "tiny", "theta-rope-parameters": "mha-wide-head-noscale",
                  "qwen3-rope-parameters": "tiny-qwen3-mqa-untied"}
GREEDY_PROMPT, GREEDY_TOKENS = 7, 16
SEED = 1234
INDEX = FIXTURES / "model_oracle_index.json"
BF16_FIXTURE = FIXTURES / "model_oracle_bf16_torch.npz"


def fixture_path(name: str) -> Path:
    return FIXTURES / f"model_oracle_{name}.npz"


def token_ids_for(name: str, vocab_size: int, n: int) -> np.ndarray:
    """Fixed, config-specific token ids (any id of the vocabulary may appear)."""
    seed = sum(name.encode())
    return np.random.default_rng(seed).integers(0, vocab_size, size=n).astype(np.int32)


def torch_bf16_bits(x: np.ndarray) -> np.ndarray:
    import torch
    return torch.from_numpy(x.copy()).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def bf16_inputs(rng) -> np.ndarray:
    """float32 bit patterns: random, exact ties (low half 0x8000), one ulp around ties, specials."""
    random_bits = rng.integers(0, 2**32, size=6000, dtype=np.uint64).astype(np.uint32)
    tops = rng.integers(0, 2**16, size=2000, dtype=np.uint64).astype(np.uint32) << np.uint32(16)
    near_ties = np.concatenate([tops | 0x8000, tops | 0x7FFF, tops | 0x8001])
    specials = np.array([0, 0x80000000, 1, 0x8000, 0x18000, 0x7F800000, 0xFF800000, 0x7F7FFFFF, 0xFF7FFFFF,
                         0x7F7F8000, 0x7F7F7FFF, 0x7F7E8000, 0x3F808000, 0x3F818000, 0x3F800001],
                        dtype=np.uint32)
    bits = np.concatenate([specials, random_bits, near_ties])
    return bits[~np.isnan(bits.view(np.float32))]


def transformers_written(config: dict) -> dict:
    """The config.json transformers writes for this model (current layout: rope_parameters)."""
    import transformers
    config = copy.deepcopy(config)                     # transformers edits nested dicts in place
    with tempfile.TemporaryDirectory() as tmp:
        transformers.AutoConfig.for_model(config.pop("model_type"), **config).save_pretrained(tmp)
        written = json.loads((Path(tmp) / "config.json").read_text())
    assert "rope_parameters" in written and "rope_theta" not in written and "rope_scaling" not in written, written
    return written


def all_configs() -> dict:
    configs = dict(ORACLE_CONFIGS)
    for name, source in CURRENT_LAYOUT.items():
        config, dtype, n = ORACLE_CONFIGS[source]
        configs[name] = (transformers_written(config), dtype, n)
    return configs


def hf_greedy(model_dir, prompt) -> np.ndarray:
    """transformers' greedy continuation (its own KV cache; stops at an eos of generation_config.json)."""
    import torch
    from oracle_helpers import hf_model
    with torch.no_grad():
        out = hf_model(model_dir).generate(torch.tensor([prompt.tolist()]), max_new_tokens=GREEDY_TOKENS,
                                           do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].numpy().astype(np.int32)


def main() -> None:
    import torch
    import transformers
    FIXTURES.mkdir(exist_ok=True)
    index = {"generated_with": {"torch": torch.__version__, "transformers": transformers.__version__},
             "seed": SEED, "models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (config, dtype, n) in all_configs().items():
            model_dir = write_random_model(Path(tmp) / name, config, seed=SEED, dtype=dtype)
            ids = token_ids_for(name, config["vocab_size"], n)
            logits = hf_logits(model_dir, ids.tolist()).astype(np.float32)
            prompt = ids[:GREEDY_PROMPT]
            np.savez_compressed(fixture_path(name), token_ids=ids, logits=logits, greedy_prompt=prompt,
                                greedy_tokens=hf_greedy(model_dir, prompt))
            top2 = np.sort(logits, axis=-1)[:, -2:]
            index["models"][name] = {"config": config, "dtype": dtype, "num_tokens": n,
                                     "sha256": sha256_file(model_dir / "model.safetensors")}
            print(f"{name}: logits {logits.shape}, smallest top-1/top-2 gap {np.min(top2[:, 1] - top2[:, 0]):.2e}")
    INDEX.write_text(json.dumps(index, indent=1) + "\n")
    bits = bf16_inputs(np.random.default_rng(SEED))
    np.savez_compressed(BF16_FIXTURE, f32_bits=bits, bf16_bits=torch_bf16_bits(bits.view(np.float32)))
    total = sum(p.stat().st_size for p in FIXTURES.glob("model_oracle_*"))
    print(f"wrote {INDEX.parent}/model_oracle_* ({total / 1024:.0f} KiB)")


if __name__ == "__main__":
    main()
