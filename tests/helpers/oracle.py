"""Shared pieces of the correctness suite: tiny model configs, the no-cache greedy oracle, and the
optional transformers oracle (used live only when torch + transformers are importable).

Tied random models fall into repeating one token (each token's own embedding dominates its logits),
which would hide cache and batching bugs; generation tests therefore use GEN_CONFIG, an untied GQA
model with llama3 scaling whose greedy output keeps changing.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import tempfile
from pathlib import Path

import numpy as np
import pytest

from engine.model.random_model import PRESETS, write_random_model

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"

# Untied, GQA 3, head_dim (12) != hidden / heads (14), llama3 scaling with a short original context.
GEN_CONFIG = {**PRESETS["tiny"], "vocab_size": 331, "hidden_size": 84, "intermediate_size": 144,
              "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 12,
              "tie_word_embeddings": False,
              "rope_scaling": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}}

# The same for each Qwen family: untied, GQA, random biases (Qwen2) or q/k norms (Qwen3), experts on
# two of three layers (Qwen3-MoE).
GEN_CONFIGS = {"llama": GEN_CONFIG,
               "qwen2": {**PRESETS["tiny-qwen2"], "tie_word_embeddings": False},
               "qwen3": {**PRESETS["tiny-qwen3"], "tie_word_embeddings": False},
               "qwen3_moe": {**PRESETS["tiny-qwen3-moe"], "tie_word_embeddings": False}}

HAVE_TRANSFORMERS = all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers"))
needs_transformers = pytest.mark.skipif(
    not HAVE_TRANSFORMERS, reason="torch + transformers not importable: the live oracle is skipped "
                                  "(the committed fixtures still check the engine)")

_workdir = tempfile.TemporaryDirectory(prefix="engine-oracle-")


@functools.cache
def cached_model_dir(name: str, config_json: str | None = None, seed: int = 0, dtype: str = "BF16") -> Path:
    """A random model directory written once per test process (config_json: a config as JSON text,
    or None for the preset `name`)."""
    import json
    config = PRESETS[name] if config_json is None else json.loads(config_json)
    return write_random_model(Path(_workdir.name) / f"{name}-{seed}-{dtype}", config, seed=seed, dtype=dtype)


def gen_model_dir(eos=None, family: str = "llama") -> Path:
    """GEN_CONFIGS[family]'s directory; `eos` (an int or list) replaces its eos ids, weights unchanged."""
    import json
    base = GEN_CONFIGS[family]
    config = dict(base) if eos is None else {**base, "eos_token_id": eos}
    return cached_model_dir(f"gen-{family}-eos{eos}", json.dumps(config, sort_keys=True))


def fixture_rebuilder(tmp_path_factory, index: dict, prefix: str):
    """name -> (model directory, token ids, reference logits) of a committed oracle fixture: the random
    model its index entry describes, rebuilt lazily once, and FIXTURES/<prefix>_<name>.npz."""
    cache: dict = {}

    def get(name):
        if name not in cache:
            entry = index["models"][name]
            model_dir = write_random_model(tmp_path_factory.mktemp(name), entry["config"],
                                           seed=index["seed"], dtype=entry["dtype"])
            with np.load(FIXTURES / f"{prefix}_{name}.npz") as f:
                cache[name] = (model_dir, f["token_ids"], f["logits"])
        return cache[name]
    return get


ORACLE_REL_TOL = 1e-4     # the engine's float32 NumPy logits against transformers' float32 ones


def check_logits(logits: np.ndarray, ref: np.ndarray, what: str) -> None:
    """float32 logits within ORACLE_REL_TOL of the reference (relative to its norm), the same argmax everywhere."""
    assert logits.dtype == np.float32 and logits.shape == ref.shape, (logits.dtype, logits.shape, ref.shape)
    err = relative_error(logits, ref)
    assert err <= ORACLE_REL_TOL, f"{what}: relative error {err:.2e} > {ORACLE_REL_TOL:g}"
    mismatched = np.flatnonzero(np.argmax(logits, -1) != np.argmax(ref, -1))
    assert mismatched.size == 0, f"{what}: argmax differs at positions {mismatched.tolist()}"


def sha256_file(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def relative_error(x: np.ndarray, ref: np.ndarray) -> float:
    """max |x - ref| / max |ref|: one number that is meaningful for logits of any scale."""
    return float(np.max(np.abs(x.astype(np.float64) - ref)) / np.max(np.abs(ref)))


def greedy_no_cache(model, prompt, max_new_tokens: int, eos=(), ignore_eos: bool = False):
    """The oracle: every token is the first argmax of a full causal pass over everything so far.
    Same stopping rules as the engine: eos (kept), max_new_tokens, or the end of model.max_context."""
    sequence, generated = list(prompt), []
    while len(generated) < max_new_tokens:
        token = int(np.argmax(model.logits(sequence)[-1]))
        generated.append(token)
        sequence.append(token)
        if token in eos and not ignore_eos:
            return generated, "stop"
        if len(sequence) >= model.max_context:
            break
    return generated, "length"


class ForwardCounter:
    """Wraps model.forward to record the number of tokens of every pass (monkeypatch target)."""

    def __init__(self, model):
        self.inner, self.tokens = model.forward, []

    def __call__(self, batch, cache=None):
        self.tokens.append(batch.num_tokens)
        return self.inner(batch, cache)


# ---- transformers (imported lazily: torch takes seconds to import) -----------------------------

def hf_model(model_dir):
    """transformers' fp32 model of the directory. Mixture-of-experts models run their experts with the
    eager loop of the modeling file (the reference): the default grouped_mm path refuses the odd
    sizes of the tiny test models (it wants 16-byte strides)."""
    import json

    import torch
    import transformers
    torch.manual_seed(0)
    moe = json.loads((Path(model_dir) / "config.json").read_text()).get("model_type") == "qwen3_moe"
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32,
                                                              **({"experts_implementation": "eager"} if moe else {}))
    return model.eval()


def hf_logits(model_dir, token_ids) -> np.ndarray:
    """transformers fp32 CPU logits [T, V] of one sequence."""
    import torch
    with torch.no_grad():
        out = hf_model(model_dir)(torch.tensor([list(token_ids)], dtype=torch.long)).logits
    return out[0].float().numpy()


def hf_greedy(model_dir, prompt, max_new_tokens: int = 16) -> np.ndarray:
    """transformers' greedy continuation (its own KV cache, and recurrent state for hybrid models; stops at
    an eos of generation_config.json). The attention mask is given: without one, generate() would take
    every prompt token equal to pad_token_id for padding and mask it out."""
    import torch
    ids = torch.tensor([list(map(int, prompt))])
    with torch.no_grad():
        out = hf_model(model_dir).generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                           do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].numpy().astype(np.int32)
