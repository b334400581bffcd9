"""Model configuration: config.json (+ generation_config.json) -> a validated dataclass (chapter 01).

Only the Llama family (`LlamaForCausalLM`: Llama 3.x, SmolLM2) is supported. Settings that would
change the math and that this engine does not implement are refused, never approximated.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, asdict
from pathlib import Path


class ConfigError(ValueError):
    """config.json describes something this engine cannot run (or is malformed)."""


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3 frequency scaling (rope_type 'llama3'): stretches the long wavelengths."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_scaling: RopeScaling | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def group_size(self) -> int:
        """Query heads per KV head (1 = MHA, n_heads = MQA)."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def q_dim(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def qkv_dim(self) -> int:
        return self.q_dim + 2 * self.kv_dim

    def kv_bytes_per_token(self, bytes_per_value: int = 2) -> int:
        """K and V of one token across all layers (Llama-3.2-1B in bf16: 32 KiB)."""
        return 2 * self.num_hidden_layers * self.kv_dim * bytes_per_value

    def num_parameters(self) -> int:
        h, i, L = self.hidden_size, self.intermediate_size, self.num_hidden_layers
        per_layer = h * self.qkv_dim + self.q_dim * h + 3 * h * i + 2 * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + L * per_layer + h + head

    def to_hf_dict(self) -> dict:
        """A config.json dict that transformers' LlamaConfig reads back to the same model."""
        d = {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
            "attention_bias": False, "mlp_bias": False, "torch_dtype": "bfloat16",
        }
        for k, v in asdict(self).items():
            if k in ("extra", "eos_token_ids", "rope_scaling"):
                continue
            d[k] = v
        d["rope_scaling"] = None if self.rope_scaling is None else {"rope_type": "llama3", **asdict(self.rope_scaling)}
        d["eos_token_id"] = list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0]
        return d


# Keys that change the math: each must be absent or hold the value we implement.
_MUST_EQUAL = {
    "hidden_act": ("silu",),
    "attention_bias": (False,),
    "mlp_bias": (False,),
    "partial_rotary_factor": (1, 1.0),
    "sliding_window": (None,),
    "use_sliding_window": (False,),
    "attn_logit_softcapping": (None,),
    "final_logit_softcapping": (None,),
    "qk_norm": (False,),
}
_REQUIRED_INT = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads")


def _positive_int(d: dict, key: str) -> int:
    v = d.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise ConfigError(f"config.json: '{key}' must be a positive integer, got {v!r}")
    return v


def _positive_float(d: dict, key: str, default: float) -> float:
    v = d.get(key, default)
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v <= 0:
        raise ConfigError(f"config.json: '{key}' must be a positive number, got {v!r}")
    return float(v)


def _token_ids(v, key: str) -> tuple[int, ...]:
    if v is None:
        return ()
    items = v if isinstance(v, list) else [v]
    if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in items):
        raise ConfigError(f"'{key}' must be a token id or a list of token ids, got {v!r}")
    return tuple(items)


def _rope_scaling(rs) -> RopeScaling | None:
    if rs is None:
        return None
    if not isinstance(rs, dict):
        raise ConfigError(f"config.json: 'rope_scaling' must be an object or null, got {rs!r}")
    kind = rs.get("rope_type", rs.get("type"))
    if kind in (None, "default") and set(rs) <= {"rope_type", "type"}:
        return None
    if kind != "llama3":
        raise ConfigError(f"config.json: rope_scaling type {kind!r} is not supported (only 'llama3' or none)")
    try:
        scaling = RopeScaling(float(rs["factor"]), float(rs["low_freq_factor"]),
                              float(rs["high_freq_factor"]), int(rs["original_max_position_embeddings"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"config.json: llama3 rope_scaling is incomplete or malformed: {exc}") from None
    if scaling.factor <= 0 or scaling.high_freq_factor <= scaling.low_freq_factor or scaling.original_max_position_embeddings <= 0:
        raise ConfigError(f"config.json: llama3 rope_scaling values are inconsistent: {rs}")
    return scaling


def config_from_dict(d: dict, generation_config: dict | None = None) -> LlamaConfig:
    """Validate a config.json dict; generation_config (if given) adds eos ids."""
    if not isinstance(d, dict):
        raise ConfigError("config.json must hold a JSON object")
    archs = d.get("architectures") or []
    if d.get("model_type") != "llama" or (archs and archs != ["LlamaForCausalLM"]):
        raise ConfigError(f"unsupported model: model_type={d.get('model_type')!r} architectures={archs!r}; "
                          "this engine runs the Llama family (LlamaForCausalLM) only")
    for key, allowed in _MUST_EQUAL.items():
        if key in d and d[key] not in allowed:
            raise ConfigError(f"config.json: {key}={d[key]!r} changes the math and is not supported "
                              f"(supported: {allowed[0]!r})")
    ints = {k: _positive_int(d, k) for k in _REQUIRED_INT}
    n_heads = ints["num_attention_heads"]
    n_kv = _positive_int(d, "num_key_value_heads") if d.get("num_key_value_heads") is not None else n_heads
    if n_heads % n_kv:
        raise ConfigError(f"config.json: num_attention_heads={n_heads} is not a multiple of num_key_value_heads={n_kv}")
    if d.get("head_dim") is not None:
        head_dim = _positive_int(d, "head_dim")
    elif ints["hidden_size"] % n_heads == 0:
        head_dim = ints["hidden_size"] // n_heads
    else:
        raise ConfigError(f"config.json: hidden_size={ints['hidden_size']} is not divisible by "
                          f"num_attention_heads={n_heads} and no head_dim is given")
    if head_dim % 2:
        raise ConfigError(f"config.json: head_dim={head_dim} must be even for rotary embeddings")
    eos = _token_ids(d.get("eos_token_id"), "eos_token_id")
    bos = d.get("bos_token_id")
    if generation_config:
        eos = eos + tuple(i for i in _token_ids(generation_config.get("eos_token_id"), "generation_config eos_token_id")
                          if i not in eos)
        bos = generation_config.get("bos_token_id", bos)
    if bos is not None and (not isinstance(bos, int) or isinstance(bos, bool) or bos < 0):
        raise ConfigError(f"bos_token_id must be a token id, got {bos!r}")
    if any(i >= ints["vocab_size"] for i in eos):
        raise ConfigError(f"eos ids {eos} are outside the vocabulary of {ints['vocab_size']}")
    return LlamaConfig(
        num_key_value_heads=n_kv, head_dim=head_dim,
        rms_norm_eps=_positive_float(d, "rms_norm_eps", 1e-6),
        rope_theta=_positive_float(d, "rope_theta", 10000.0),
        max_position_embeddings=_positive_int(d, "max_position_embeddings") if "max_position_embeddings" in d else 2048,
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        rope_scaling=_rope_scaling(d.get("rope_scaling")),
        bos_token_id=bos, eos_token_ids=eos, extra=d, **ints,
    )


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from None


def load_config(model_dir) -> LlamaConfig:
    """Read <model_dir>/config.json and, when present, generation_config.json."""
    model_dir = Path(model_dir)
    path = model_dir / "config.json"
    if not path.is_file():
        raise ConfigError(f"{model_dir} is not a model directory: config.json is missing")
    gen_path = model_dir / "generation_config.json"
    gen = _read_json(gen_path) if gen_path.is_file() else None
    return config_from_dict(_read_json(path), gen)
