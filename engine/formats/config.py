"""Model configuration: config.json (+ generation_config.json) -> a validated dataclass (chapter 01).

Four families share one forward pass, selected by config.json's `model_type` / `architectures`:
  * llama  (`LlamaForCausalLM`: Llama 3.x, SmolLM2): the baseline;
  * qwen2  (`Qwen2ForCausalLM`: Qwen2, Qwen2.5): + a bias on the q, k and v projections (`qkv_bias`);
  * qwen3  (`Qwen3ForCausalLM`): + an RMSNorm over each q and k head before RoPE (`qk_norm`), and a
    head_dim of its own (128 when config.json does not say);
  * qwen3_moe (`Qwen3MoeForCausalLM`: Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention, and on the
    sparse layers a mixture of experts in place of the MLP (`moe`: MoeSettings, appendix on MoE);
  * qwen3_5_text (`Qwen3_5ForCausalLM`, and the text model of a `qwen3_5` directory): a hybrid, see
    HybridConfig: `layer_types` mixes Gated DeltaNet (`linear_attention`) layers with full-attention
    layers that have a query gate, q/k norms and partial rotary embeddings.
Settings that would change the math and that this engine does not implement are refused, never
approximated (for Qwen: sliding-window attention when a layer would actually use it).

Both layouts transformers has written are read:
  * older:   top-level `rope_theta` and `rope_scaling` ({"rope_type": "llama3", "factor": ...});
  * current: `rope_parameters` ({"rope_type": ..., "rope_theta": ..., plus the scaling values}).
A config that gives both, and disagrees, is refused rather than guessed at.

Types are strict, as JSON writes them: a size is an integer (not 64.0, not "64"), a flag is
true/false (not "false", not 0), a number is finite and inside a range a real model can have.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from engine.checks import is_int, is_real


class ConfigError(ValueError):
    """config.json describes something this engine cannot run (or is malformed)."""


MAX_INT32 = 2**31 - 1          # token ids and positions are int32 on both backends
MAX_SIZE = 2**24               # any one dimension (hidden, heads, layers, ...): far past any real model


@dataclass(frozen=True)
class AwqSettings:
    """A pre-quantized AWQ checkpoint (AutoAWQ's GEMM format, config.json's `quantization_config`):
    4-bit weights with a zero point, `group_size` inputs per scale (the whole row for -1)."""

    group_size: int
    bits: int = 4


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3 frequency scaling (rope_type 'llama3'): stretches the long wavelengths."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class MoeSettings:
    """Qwen3-MoE's sparse MLP: a router picks `experts_per_token` of `num_experts` SwiGLU experts
    (each of width `expert_intermediate_size`) per token, on the layers in `sparse_layers`; the other
    layers keep the dense MLP of `intermediate_size`."""

    num_experts: int
    experts_per_token: int
    expert_intermediate_size: int
    norm_topk_prob: bool               # renormalise the k chosen probabilities to sum to 1
    sparse_layers: tuple[int, ...]     # layer indices whose MLP is the expert block


@dataclass(frozen=True)
class ModelShape:
    """The sizes that fix every tensor's shape (engine/model/weights.py: expected_shapes)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    tie_word_embeddings: bool
    qkv_bias: bool      # Qwen2: q/k/v projections carry a bias ([qkv_dim] per layer)
    qk_norm: bool       # Qwen3: RMSNorm (weights [head_dim]) over each q and k head before RoPE
    moe: MoeSettings | None = field(default=None, kw_only=True)   # Qwen3-MoE; None: every MLP is dense

    def is_sparse(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is the mixture of experts."""
        return self.moe is not None and layer in self.moe.sparse_layers

    @property
    def num_sparse_layers(self) -> int:
        return 0 if self.moe is None else len(self.moe.sparse_layers)

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


@dataclass(frozen=True)
class LlamaConfig(ModelShape):
    """The one config of the forward pass, for every supported family (see the module docstring)."""

    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    rope_scaling: RopeScaling | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    model_type: str = "llama"
    awq: AwqSettings | None = None      # the checkpoint's projections are AWQ-quantized
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def rotary_dim(self) -> int:
        """How many leading dimensions of each q and k head RoPE rotates (all of them here)."""
        return self.head_dim

    @property
    def kv_layers(self) -> int:
        """Layers that keep K and V per token in the cache (all of them here)."""
        return self.num_hidden_layers

    def kv_bytes_per_token(self, bytes_per_value: int = 2) -> int:
        """K and V of one token across all layers (Llama-3.2-1B in bf16: 32 KiB)."""
        return 2 * self.kv_layers * self.kv_dim * bytes_per_value

    @property
    def state_bytes_per_sequence(self) -> int:
        """A sequence's memory that does not grow with its length (fp32; none for attention alone)."""
        return 0

    def num_parameters(self, active: bool = False) -> int:
        """Every weight of the model; active=True: those one token reads (a sparse layer's router and
        its experts_per_token experts, not all num_experts: what a decode step streams per token)."""
        h, i, L = self.hidden_size, self.intermediate_size, self.num_hidden_layers
        per_layer = h * self.qkv_dim + self.q_dim * h + 2 * h
        per_layer += self.qkv_dim * self.qkv_bias + 2 * self.head_dim * self.qk_norm
        mlps = (L - self.num_sparse_layers) * 3 * h * i
        if self.moe is not None:
            m = self.moe
            experts = m.experts_per_token if active else m.num_experts
            mlps += self.num_sparse_layers * (m.num_experts * h + experts * 3 * h * m.expert_intermediate_size)
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + L * per_layer + mlps + h + head

    def to_hf_dict(self) -> dict:
        """A config.json dict (older layout) that transformers reads back to the same model."""
        d: dict[str, object] = {"architectures": [FAMILIES[self.model_type]], "model_type": self.model_type,
                                "hidden_act": "silu", "torch_dtype": "bfloat16"}
        if self.model_type != "qwen2":          # Qwen2 always has its q/k/v biases: no key for them
            d.update(attention_bias=False, mlp_bias=False)
        for k, v in asdict(self).items():
            if k in ("extra", "eos_token_ids", "rope_scaling", "qkv_bias", "qk_norm", "model_type", "awq", "moe"):
                continue
            d[k] = v
        if self.moe is not None:
            d.update(moe_hf_keys(self.moe, self.num_hidden_layers))
        d["rope_scaling"] = None if self.rope_scaling is None else {"rope_type": "llama3", **asdict(self.rope_scaling)}
        d["eos_token_id"] = list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0]
        if self.awq is not None:
            d["quantization_config"] = {"quant_method": "awq", "bits": self.awq.bits, "version": "gemm",
                                        "zero_point": True, "group_size": self.awq.group_size}
        return d


LINEAR_ATTENTION, FULL_ATTENTION = "linear_attention", "full_attention"


@dataclass(frozen=True)
class HybridConfig(LlamaConfig):
    """Qwen3.5 (model_type qwen3_5_text): layer i is a Gated DeltaNet layer (engine/ops/gated_delta.py)
    when layer_types[i] is 'linear_attention', else full attention with a query gate (q_proj gives the
    query and a gate per head; o_proj reads attn * sigmoid(gate)), RMSNorm over each q and k head and
    RoPE over the first rotary_dim dimensions of each head. Every RMSNorm but the mixer's gated one
    scales by (1 + weight) (the loader adds the 1, so the forward pass uses the ordinary norm)."""

    layer_types: tuple[str, ...] = ()
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    partial_rotary_factor: float = 0.25
    weights_prefix: str = "model."     # "model.language_model." in a qwen3_5 (vision-language) directory

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)      # transformers' rounding

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the causal convolution: q, k and v of the mixer, side by side."""
        return 2 * self.linear_key_dim + self.linear_value_dim

    @property
    def full_attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION)

    @property
    def kv_layers(self) -> int:
        """Only the full-attention layers keep K and V per token; a linear layer's state has a fixed size."""
        return len(self.full_attention_layers)

    @property
    def state_bytes_per_sequence(self) -> int:
        """Every linear layer's recurrent state of one sequence, fp32: its conv inputs [K-1, C] and its
        delta-rule state [Hv, Dk, Dv] (Qwen3.5-0.8B: 18 layers of 1 MiB + 72 KiB)."""
        per_layer = ((self.linear_conv_kernel_dim - 1) * self.conv_dim
                     + self.linear_num_value_heads * self.linear_key_head_dim * self.linear_value_head_dim)
        return 4 * per_layer * (len(self.layer_types) - self.kv_layers)

    def num_parameters(self, active: bool = False) -> int:
        """Every weight of the model (a dense model: every weight runs for every token, active or not)."""
        h, i = self.hidden_size, self.intermediate_size
        mlp_and_norms = 3 * h * i + 2 * h
        attention = h * (2 * self.q_dim + 2 * self.kv_dim) + self.q_dim * h + 2 * self.head_dim
        Hv = self.linear_num_value_heads
        linear = (h * (self.conv_dim + self.linear_value_dim + 2 * Hv) + self.conv_dim * self.linear_conv_kernel_dim
                  + 2 * Hv + self.linear_value_head_dim + self.linear_value_dim * h)
        layers = sum(mlp_and_norms + (linear if t == LINEAR_ATTENTION else attention) for t in self.layer_types)
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + layers + h + head

    def to_hf_dict(self) -> dict:
        """A qwen3_5_text config.json dict (the layout transformers writes) that reads back to this config."""
        d: dict[str, object] = {"architectures": [FAMILIES[self.model_type]], "model_type": self.model_type,
                                "hidden_act": "silu", "attention_bias": False, "layer_types": list(self.layer_types),
                                "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta,
                                                    "partial_rotary_factor": self.partial_rotary_factor}}
        for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "tie_word_embeddings", "rms_norm_eps",
                  "max_position_embeddings", "bos_token_id", "linear_num_key_heads", "linear_num_value_heads",
                  "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim"):
            d[k] = getattr(self, k)
        d["eos_token_id"] = list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0]
        return d


# ---------------------------------------------------------------------------------------------
# Strict readers: each names the key it refuses

def read_int(d: dict, key: str, default=None, lo: int = 1, hi: int = MAX_SIZE, where: str = "config.json") -> int:
    v = d.get(key, default)
    if not is_int(v) or not lo <= v <= hi:
        raise ConfigError(f"{where}: '{key}' must be an integer in [{lo}, {hi}], got {v!r}")
    return v


def read_float(d: dict, key: str, default: float | None, lo: float, hi: float, where: str = "config.json",
               lo_open: bool = False) -> float:
    v = d.get(key, default)
    if v is None or not (is_real(v) and math.isfinite(v) and (v > lo if lo_open else v >= lo) and v <= hi):
        raise ConfigError(f"{where}: '{key}' must be a finite number in {'(' if lo_open else '['}{lo:g}, {hi:g}], "
                          f"got {v!r}")
    return float(v)


def read_bool(d: dict, key: str, default: bool, where: str = "config.json") -> bool:
    v = d.get(key, default)
    if not isinstance(v, bool):
        raise ConfigError(f"{where}: '{key}' must be true or false, got {v!r}")
    return v


def _same(value, allowed: tuple) -> bool:
    """Equal and of the same JSON type: 0 is not false, "false" is not false, 1.0 only if listed."""
    return any(type(value) is type(a) and value == a for a in allowed)


# model_type -> its architecture name. The family fixes the q/k/v bias and the q/k norm; qwen3_moe's
# experts are described by keys of their own (_moe).
FAMILIES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
            "qwen3_moe": "Qwen3MoeForCausalLM", "qwen3_5_text": "Qwen3_5ForCausalLM"}
HYBRID_FAMILIES = {"qwen3_5_text"}
_QKV_BIAS = {"llama": False, "qwen2": True, "qwen3": False, "qwen3_moe": False, "qwen3_5_text": False}
_QK_NORM = {"llama": False, "qwen2": False, "qwen3": True, "qwen3_moe": True, "qwen3_5_text": True}
_DEFAULT_HEAD_DIM = {"qwen3": 128, "qwen3_5_text": 256}   # transformers' defaults; others: hidden / heads
# Keys the Qwen families define themselves (checked by _check_sliding_window and _moe, not by _NEUTRAL)
_QWEN_OWN = {"qwen2": {"sliding_window", "use_sliding_window", "max_window_layers", "attention_bias"},
             "qwen3": {"sliding_window", "use_sliding_window", "max_window_layers"},
             "qwen3_moe": {"sliding_window", "use_sliding_window", "max_window_layers", "num_experts",
                           "num_local_experts"},
             "qwen3_5_text": {"partial_rotary_factor"}}

# Keys that change the math in a way this engine does not implement: each must be absent or hold
# one of these values (the first is the one the engine runs).
_NEUTRAL = {
    "hidden_act": ("silu", "swish"),                 # the same function under two names
    "attention_bias": (False,),
    "mlp_bias": (False,),
    "partial_rotary_factor": (1.0, 1),
    "sliding_window": (None,),
    "use_sliding_window": (False,),
    "max_window_layers": (None,),
    "attn_logit_softcapping": (None,),
    "final_logit_softcapping": (None,),
    "qk_norm": (False,),
    "use_qk_norm": (False,),
    "no_rope_layers": (None,),
    "embedding_multiplier": (None, 1.0, 1),
    "logits_scaling": (None, 1.0, 1),
    "residual_multiplier": (None, 1.0, 1),
    "attention_multiplier": (None,),
    "num_experts": (None, 0),
    "num_local_experts": (None, 0),
    # mixture-of-experts variants other than Qwen3-MoE's (shared experts, scaled or grouped routing)
    "shared_expert_intermediate_size": (None, 0),
    "n_shared_experts": (None, 0),
    "num_shared_experts": (None, 0),
    "routed_scaling_factor": (None, 1.0, 1),
    "scoring_func": (None, "softmax"),
    "topk_method": (None, "greedy"),
    "n_group": (None, 1),
    "topk_group": (None, 1),
    "first_k_dense_replace": (None, 0),
}


def _check_neutral(d: dict, model_type: str = "llama") -> None:
    own = _QWEN_OWN.get(model_type, set())
    for key, allowed in _NEUTRAL.items():
        if key in d and key not in own and not _same(d[key], allowed):
            raise ConfigError(f"config.json: {key}={d[key]!r} changes the math and is not supported "
                              f"(supported: {allowed[0]!r})")
    if "pretraining_tp" in d:   # only splits the GEMMs while training: the same math
        read_int(d, "pretraining_tp", lo=1)
    layer_types = d.get("layer_types")
    if model_type not in HYBRID_FAMILIES and layer_types is not None and (not isinstance(layer_types, list)
                                    or any(t != "full_attention" for t in layer_types)):
        raise ConfigError(f"config.json: layer_types={layer_types!r} is not supported "
                          "(every layer must be 'full_attention')")


def _check_sliding_window(d: dict, num_layers: int, family: str) -> None:
    """Qwen2/Qwen3 (transformers' rule): layer i uses a sliding window when use_sliding_window is true,
    sliding_window is set and i >= max_window_layers (Qwen3-MoE: every layer; its max_window_layers is
    checked as an integer and otherwise ignored, as transformers ignores it). Any such layer is
    refused; the keys alone, as every Qwen config.json writes them (use_sliding_window: false), change
    nothing."""
    use = read_bool(d, "use_sliding_window", False)
    window = d.get("sliding_window")
    if window is not None:
        read_int(d, "sliding_window", hi=MAX_INT32)
    first = read_int(d, "max_window_layers", 28, lo=0, hi=MAX_INT32)
    if family == "qwen3_moe":
        first = 0
    if use and window is not None and first < num_layers and d.get("layer_types") is None:
        raise ConfigError(f"config.json: use_sliding_window=true with sliding_window={window} and "
                          f"max_window_layers={first} puts layers {first}..{num_layers - 1} on sliding-window "
                          "attention, which is not supported")


# ---------------------------------------------------------------------------------------------
# Mixture of experts (Qwen3-MoE)

MAX_EXPERTS = 2**16        # far past any real model (Qwen3: 128; the largest published: 384)
# transformers' Qwen3MoeConfig defaults, used where config.json leaves a key out
_MOE_DEFAULTS = {"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                 "norm_topk_prob": False, "decoder_sparse_step": 1}


def _num_experts(d: dict) -> int:
    """`num_experts`, or `num_local_experts` (transformers' other name for it); both must agree."""
    given = {k: d[k] for k in ("num_experts", "num_local_experts") if d.get(k) is not None}
    if len(set(map(repr, given.values()))) > 1:
        raise ConfigError(f"config.json: num_experts={given['num_experts']!r} and num_local_experts="
                          f"{given['num_local_experts']!r} disagree")
    key = next(iter(given), "num_experts")
    return read_int(given or _MOE_DEFAULTS, key, lo=0, hi=MAX_EXPERTS)


def sparse_layers(num_layers: int, num_experts: int, step: int, mlp_only: list[int]) -> tuple[int, ...]:
    """transformers' rule (Qwen3MoeDecoderLayer): layer i is sparse when i is not in mlp_only_layers,
    num_experts > 0 and (i + 1) % decoder_sparse_step == 0."""
    return tuple(i for i in range(num_layers) if i not in mlp_only and num_experts > 0 and (i + 1) % step == 0)


def _moe(d: dict, num_layers: int) -> MoeSettings:
    """A qwen3_moe config's expert settings; the router's auxiliary-loss keys (router_aux_loss_coef,
    output_router_logits) only matter for training and are not read."""
    num_experts = _num_experts(d)
    defaults = {k: d.get(k, v) for k, v in _MOE_DEFAULTS.items()}
    per_token = read_int(defaults, "num_experts_per_tok", hi=num_experts or MAX_EXPERTS)   # top-k of E
    step = read_int(defaults, "decoder_sparse_step", hi=MAX_SIZE)
    mlp_only = d.get("mlp_only_layers")
    mlp_only = [] if mlp_only is None else mlp_only
    if (not isinstance(mlp_only, list) or not all(is_int(i) and 0 <= i < num_layers for i in mlp_only)
            or len(set(mlp_only)) != len(mlp_only)):
        raise ConfigError(f"config.json: mlp_only_layers must be a list of distinct layer indices in "
                          f"[0, {num_layers}), got {d.get('mlp_only_layers')!r}")
    return MoeSettings(num_experts=num_experts, experts_per_token=per_token,
                       expert_intermediate_size=read_int(defaults, "moe_intermediate_size"),
                       norm_topk_prob=read_bool(defaults, "norm_topk_prob", False),
                       sparse_layers=sparse_layers(num_layers, num_experts, step, mlp_only))


def moe_hf_keys(moe: MoeSettings, num_layers: int) -> dict:
    """The config.json keys that describe `moe` (the dense layers as mlp_only_layers, step 1)."""
    return {"num_experts": moe.num_experts, "num_experts_per_tok": moe.experts_per_token,
            "moe_intermediate_size": moe.expert_intermediate_size, "norm_topk_prob": moe.norm_topk_prob,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [i for i in range(num_layers) if i not in moe.sparse_layers]}


# ---------------------------------------------------------------------------------------------
# RoPE: both layouts

_ROPE_KEYS = {
    "default": {"rope_type", "type", "rope_theta", "partial_rotary_factor"},
    "llama3": {"rope_type", "type", "rope_theta", "partial_rotary_factor",
               "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
}
ROPE_THETA_RANGE = (1.0, 1e12)     # a base <= 1 makes frequencies grow along the head, not decay


def _rope_dict(d: dict) -> tuple[str, dict]:
    """(the key it came from, the rope dict) with transformers' priority: rope_scaling, else rope_parameters."""
    found = {}
    for key in ("rope_scaling", "rope_parameters"):
        v = d.get(key)
        if v is not None and not isinstance(v, dict):
            raise ConfigError(f"config.json: '{key}' must be an object or null, got {v!r}")
        if v:
            found[key] = v
    if len(found) == 2:
        raise ConfigError("config.json gives both 'rope_scaling' (older layout) and 'rope_parameters' "
                          "(current layout); keep one")
    return next(iter(found.items()), ("rope_parameters", {}))


# Qwen3.5's multimodal RoPE: three position rows (time, height, width) that share the frequencies by
# sections. For text every row is the token's position, so it is the ordinary RoPE.
_MROPE_KEYS = {"mrope_section", "mrope_interleaved"}


def _rope(d: dict, max_positions: int, hybrid: bool = False) -> tuple[float, RopeScaling | None]:
    """(rope_theta, llama3 scaling or None) from either layout (hybrid: partial rotary and text-only
    mrope keys allowed; only the default rope_type)."""
    where, rope = _rope_dict(d)
    kind = rope.get("rope_type", rope.get("type", "default"))
    if hybrid:
        if kind != "default":
            raise ConfigError(f"config.json: {where}.rope_type={kind!r} is not supported for this family "
                              "(only 'default')")
        _check_mrope(rope, where)
        rope = {k: v for k, v in rope.items() if k not in _MROPE_KEYS and k != "partial_rotary_factor"}
    if "rope_type" in rope and "type" in rope and rope["type"] != rope["rope_type"]:
        raise ConfigError(f"config.json: {where} has rope_type={rope['rope_type']!r} and type={rope['type']!r}")
    if kind not in _ROPE_KEYS:
        raise ConfigError(f"config.json: {where}.rope_type={kind!r} is not supported (only 'default' or 'llama3')")
    unknown = sorted(set(rope) - _ROPE_KEYS[kind])
    if unknown:
        raise ConfigError(f"config.json: {where}.{unknown[0]} is not used by rope_type {kind!r}; "
                          "refusing a setting this engine would ignore")
    if "partial_rotary_factor" in rope and not _same(rope["partial_rotary_factor"], _NEUTRAL["partial_rotary_factor"]):
        raise ConfigError(f"config.json: {where}.partial_rotary_factor={rope['partial_rotary_factor']!r} "
                          "changes the math and is not supported (supported: 1.0)")
    if "rope_theta" in rope and "rope_theta" in d and rope["rope_theta"] != d["rope_theta"]:
        raise ConfigError(f"config.json: rope_theta={d['rope_theta']!r} and {where}.rope_theta="
                          f"{rope['rope_theta']!r} disagree")
    theta_from = rope if "rope_theta" in rope else d
    theta = read_float(theta_from, "rope_theta", 10000.0, *ROPE_THETA_RANGE, lo_open=True,
                       where="config.json" if theta_from is d else f"config.json {where}")
    if kind == "default":
        return theta, None
    w = f"config.json {where}"
    # transformers fills a missing original context from max_position_embeddings; a top-level one wins
    source = d if "original_max_position_embeddings" in d else rope
    scaling = RopeScaling(
        factor=read_float(rope, "factor", None, 1.0, 1e6, where=w),
        low_freq_factor=read_float(rope, "low_freq_factor", None, 0.0, 1e6, where=w, lo_open=True),
        high_freq_factor=read_float(rope, "high_freq_factor", None, 0.0, 1e6, where=w, lo_open=True),
        original_max_position_embeddings=read_int(source, "original_max_position_embeddings", max_positions,
                                                  hi=MAX_INT32, where=w))
    if scaling.high_freq_factor <= scaling.low_freq_factor:
        raise ConfigError(f"{w}: llama3 values are inconsistent: high_freq_factor={scaling.high_freq_factor} "
                          f"must be greater than low_freq_factor={scaling.low_freq_factor}")
    return theta, scaling


def _check_mrope(rope: dict, where: str) -> None:
    section, interleaved = rope.get("mrope_section"), rope.get("mrope_interleaved", False)
    if section is not None and (not isinstance(section, list) or len(section) != 3
                                or not all(is_int(s) and 0 <= s <= MAX_SIZE for s in section)):
        raise ConfigError(f"config.json: {where}.mrope_section must be a list of three integers >= 0, got {section!r}")
    if not isinstance(interleaved, bool):
        raise ConfigError(f"config.json: {where}.mrope_interleaved must be true or false, got {interleaved!r}")


# ---------------------------------------------------------------------------------------------
# Sizes, token ids, the whole config

def model_family(d: dict) -> str:
    """config.json's model_type, checked against its architectures: a key of FAMILIES."""
    if not isinstance(d, dict):
        raise ConfigError("config.json must hold a JSON object")
    model_type, archs = d.get("model_type"), d.get("architectures") or []
    if model_type not in FAMILIES or (archs and archs != [FAMILIES[model_type]]):
        supported = ", ".join(f"{t} ({a})" for t, a in FAMILIES.items())
        raise ConfigError(f"unsupported model: model_type={model_type!r} architectures={archs!r}; "
                          f"this engine runs: {supported}")
    return model_type


def model_shape(d: dict) -> ModelShape:
    """The sizes of a config.json dict, validated (also what the GGUF converter checks its tensors by)."""
    family = model_family(d)
    n_heads = read_int(d, "num_attention_heads")
    n_kv = read_int(d, "num_key_value_heads") if d.get("num_key_value_heads") is not None else n_heads
    if n_heads % n_kv:
        raise ConfigError(f"config.json: num_attention_heads={n_heads} is not a multiple of num_key_value_heads={n_kv}")
    hidden = read_int(d, "hidden_size")
    if d.get("head_dim") is not None:
        head_dim = read_int(d, "head_dim")
    elif family in _DEFAULT_HEAD_DIM:
        head_dim = _DEFAULT_HEAD_DIM[family]
    elif hidden % n_heads == 0:
        head_dim = hidden // n_heads
    else:
        raise ConfigError(f"config.json: hidden_size={hidden} is not divisible by "
                          f"num_attention_heads={n_heads} and no head_dim is given")
    if head_dim % 2:
        raise ConfigError(f"config.json: head_dim={head_dim} must be even for rotary embeddings")
    if n_heads * head_dim > MAX_SIZE:
        raise ConfigError(f"config.json: num_attention_heads * head_dim = {n_heads * head_dim} is too large")
    num_layers = read_int(d, "num_hidden_layers")
    return ModelShape(vocab_size=read_int(d, "vocab_size", hi=MAX_INT32), hidden_size=hidden,
                      intermediate_size=read_int(d, "intermediate_size"),
                      num_hidden_layers=num_layers,
                      num_attention_heads=n_heads, num_key_value_heads=n_kv, head_dim=head_dim,
                      tie_word_embeddings=read_bool(d, "tie_word_embeddings", False),
                      qkv_bias=_QKV_BIAS[family], qk_norm=_QK_NORM[family],
                      moe=_moe(d, num_layers) if family == "qwen3_moe" else None)


def _token_ids(v, key: str, vocab_size: int) -> tuple[int, ...]:
    if v is None:
        return ()
    items = v if isinstance(v, list) else [v]
    if not all(is_int(x) and 0 <= x < vocab_size for x in items):
        raise ConfigError(f"'{key}' must be a token id or a list of token ids in [0, {vocab_size}), got {v!r}")
    return tuple(items)


def _awq(d: dict) -> AwqSettings | None:
    """config.json's quantization_config: None, or an AutoAWQ GEMM checkpoint (4 bits, zero points).
    Any other method or setting is refused with the key named, never approximated."""
    q = d.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise ConfigError(f"config.json: quantization_config must be an object, got {q!r}")
    method = q.get("quant_method")
    if method != "awq":
        raise ConfigError(f"config.json: quantization_config.quant_method={method!r} is not supported "
                          "(supported: 'awq', AutoAWQ's GEMM format; or load with quantization='int8'/'int4')")
    for key, allowed in (("bits", (4,)), ("zero_point", (True,)), ("version", ("gemm", "GEMM")),
                         ("modules_to_not_convert", (None, []))):
        if q.get(key, allowed[0]) not in allowed or (key == "zero_point" and q.get(key, True) is not True):
            raise ConfigError(f"config.json: quantization_config.{key}={q.get(key)!r} is not supported "
                              f"(supported: {allowed[0]!r})")
    group = q.get("group_size", 128)
    if not is_int(group) or isinstance(group, bool) or not (group == -1 or 0 < group <= MAX_SIZE):
        raise ConfigError(f"config.json: quantization_config.group_size must be a positive integer or -1, got {group!r}")
    return AwqSettings(group_size=int(group))


def config_from_dict(d: dict, generation_config: dict | None = None) -> LlamaConfig:
    """Validate a config.json dict; generation_config (if given) adds eos ids."""
    if isinstance(d, dict) and d.get("model_type") == MULTIMODAL_QWEN3_5:
        return _hybrid_config(*_text_config(d), generation_config)
    family = model_family(d)
    if family in HYBRID_FAMILIES:
        return _hybrid_config(d, "model.", generation_config)
    _check_neutral(d, family)
    shape = model_shape(d)
    if family != "llama":
        _check_sliding_window(d, shape.num_hidden_layers, family)
    max_positions = read_int(d, "max_position_embeddings", 2048, lo=2, hi=MAX_INT32)
    theta, scaling = _rope(d, max_positions)
    bos, eos = _special_ids(d, generation_config, shape.vocab_size)
    awq = _awq(d)
    if awq is not None and shape.moe is not None:
        raise ConfigError("config.json: quantization_config on a mixture-of-experts model is not supported "
                          "(the experts are read as float weights only)")
    return LlamaConfig(
        **{f.name: getattr(shape, f.name) for f in fields(shape)},     # (asdict would turn moe into a dict)
        rms_norm_eps=read_float(d, "rms_norm_eps", 1e-6, 1e-12, 1.0, lo_open=False),
        rope_theta=theta, max_position_embeddings=max_positions, rope_scaling=scaling,
        bos_token_id=bos, eos_token_ids=eos, model_type=family, awq=awq, extra=d,
    )


def _special_ids(d: dict, generation_config: dict | None, V: int) -> tuple[int | None, tuple[int, ...]]:
    """(bos, eos ids) of config.json, with generation_config.json's eos ids added and its bos preferred."""
    if generation_config is not None and not isinstance(generation_config, dict):
        raise ConfigError("generation_config.json must hold a JSON object")
    eos = _token_ids(d.get("eos_token_id"), "eos_token_id", V)
    bos = d.get("bos_token_id")
    if generation_config:
        eos = eos + tuple(i for i in _token_ids(generation_config.get("eos_token_id"),
                                                "generation_config eos_token_id", V) if i not in eos)
        bos = generation_config.get("bos_token_id", bos)
    if bos is not None:
        _token_ids(bos, "bos_token_id", V)
    return bos, eos


# ---------------------------------------------------------------------------------------------
# Qwen3.5: the hybrid family

MULTIMODAL_QWEN3_5 = "qwen3_5"      # Qwen3_5ForConditionalGeneration: text_config is the language model
# transformers' Qwen3_5TextConfig defaults for keys that fix tensor shapes (a config.json written by
# transformers gives them all; a hand-written one may leave them out)
_QWEN3_5_DEFAULTS = {"num_key_value_heads": 4, "head_dim": 256, "tie_word_embeddings": False,
                     "max_position_embeddings": 32768, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
                     "linear_value_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32}


def _text_config(d: dict) -> tuple[dict, str]:
    """A qwen3_5 (vision-language) config.json -> (its text_config, where the text weights live).
    Only the language model runs; its tensors are model.language_model.*."""
    archs = d.get("architectures") or []
    if archs and archs != ["Qwen3_5ForConditionalGeneration"]:
        raise ConfigError(f"unsupported model: model_type='qwen3_5' architectures={archs!r} "
                          "(expected Qwen3_5ForConditionalGeneration)")
    text = d.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError(f"config.json: a qwen3_5 config needs a 'text_config' object, got {text!r}")
    if text.get("model_type", "qwen3_5_text") != "qwen3_5_text":
        raise ConfigError(f"config.json: text_config.model_type={text.get('model_type')!r} is not supported "
                          "(expected 'qwen3_5_text')")
    text = {**text, "model_type": "qwen3_5_text", "architectures": ["Qwen3_5ForCausalLM"]}
    if "tie_word_embeddings" in d:     # the outer model decides whether lm_head is the embedding
        if "tie_word_embeddings" in text and text["tie_word_embeddings"] != d["tie_word_embeddings"]:
            raise ConfigError(f"config.json: tie_word_embeddings={d['tie_word_embeddings']!r} and "
                              f"text_config.tie_word_embeddings={text['tie_word_embeddings']!r} disagree")
        text["tie_word_embeddings"] = d["tie_word_embeddings"]
    return text, "model.language_model."


def _layer_types(d: dict, num_layers: int) -> tuple[str, ...]:
    """layer_types as given, else transformers' pattern: every full_attention_interval-th layer is full."""
    types = d.get("layer_types")
    if types is None:
        every = read_int(d, "full_attention_interval", 4, hi=MAX_INT32)
        return tuple(LINEAR_ATTENTION if (i + 1) % every else FULL_ATTENTION for i in range(num_layers))
    if (not isinstance(types, list) or len(types) != num_layers
            or any(t not in (LINEAR_ATTENTION, FULL_ATTENTION) for t in types)):
        raise ConfigError(f"config.json: layer_types must list 'linear_attention' or 'full_attention' for each "
                          f"of the {num_layers} layers, got {types!r}")
    return tuple(types)


def _partial_rotary_factor(d: dict) -> float:
    """transformers' default is 0.25; it may sit at the top level or in rope_parameters (not both, differing)."""
    where, rope = _rope_dict(d)
    if "partial_rotary_factor" in d and "partial_rotary_factor" in rope \
            and d["partial_rotary_factor"] != rope["partial_rotary_factor"]:
        raise ConfigError(f"config.json: partial_rotary_factor={d['partial_rotary_factor']!r} and "
                          f"{where}.partial_rotary_factor={rope['partial_rotary_factor']!r} disagree")
    source = rope if "partial_rotary_factor" in rope else d
    return read_float(source, "partial_rotary_factor", 0.25, 0.0, 1.0, lo_open=True,
                      where="config.json" if source is d else f"config.json {where}")


def _hybrid_config(d: dict, weights_prefix: str, generation_config: dict | None) -> HybridConfig:
    d = {**_QWEN3_5_DEFAULTS, **d}
    model_family(d)
    _check_neutral(d, "qwen3_5_text")
    if "attn_output_gate" in d and d["attn_output_gate"] is not True:    # Qwen3-Next's switch: always on here
        raise ConfigError(f"config.json: attn_output_gate={d['attn_output_gate']!r} is not supported "
                          "(Qwen3.5's full-attention layers always gate their output)")
    shape = model_shape(d)
    key_heads, value_heads = read_int(d, "linear_num_key_heads"), read_int(d, "linear_num_value_heads")
    if value_heads % key_heads:
        raise ConfigError(f"config.json: linear_num_value_heads={value_heads} is not a multiple "
                          f"of linear_num_key_heads={key_heads}")
    factor = _partial_rotary_factor(d)
    rotary_dim = int(shape.head_dim * factor)
    if rotary_dim < 2 or rotary_dim % 2:
        raise ConfigError(f"config.json: partial_rotary_factor={factor} gives {rotary_dim} rotary dimensions of "
                          f"head_dim={shape.head_dim}; it must be an even number >= 2")
    max_positions = read_int(d, "max_position_embeddings", lo=2, hi=MAX_INT32)
    theta, _ = _rope(d, max_positions, hybrid=True)
    bos, eos = _special_ids(d, generation_config, shape.vocab_size)
    if d.get("quantization_config") is not None:
        raise ConfigError("config.json: quantization_config is not supported for qwen3_5_text models")
    return HybridConfig(
        **asdict(shape),
        rms_norm_eps=read_float(d, "rms_norm_eps", 1e-6, 1e-12, 1.0),
        rope_theta=theta, max_position_embeddings=max_positions,
        bos_token_id=bos, eos_token_ids=eos, model_type="qwen3_5_text", extra=d,
        layer_types=_layer_types(d, shape.num_hidden_layers),
        linear_conv_kernel_dim=read_int(d, "linear_conv_kernel_dim", hi=64), partial_rotary_factor=factor,
        linear_num_key_heads=key_heads, linear_num_value_heads=value_heads,
        linear_key_head_dim=read_int(d, "linear_key_head_dim"), linear_value_head_dim=read_int(d, "linear_value_head_dim"),
        weights_prefix=weights_prefix)


# ---------------------------------------------------------------------------------------------
# Engine settings, checked against the model before any weight is read

def check_serving_args(config: LlamaConfig, *, max_context=None, max_seqs=None, max_batch_tokens=None,
                       page_size=16, kv_cache_mib=None) -> None:
    """Raise ValueError naming the first engine setting that cannot work with this model.

    max_context: 2 .. max_position_embeddings (room for one prompt token and one new one);
    max_seqs, max_batch_tokens, page_size: integers >= 1; kv_cache_mib: a finite number > 0.
    None means "the engine's default" for every setting that has one.
    """
    bounds = {"max_context": (max_context, 2, config.max_position_embeddings),
              "max_seqs": (max_seqs, 1, 2**20), "max_batch_tokens": (max_batch_tokens, 1, MAX_INT32),
              "page_size": (page_size, 1, 2**20)}
    for name, (value, lo, hi) in bounds.items():
        if value is None and name != "page_size":
            continue
        if not is_int(value) or not lo <= value <= hi:
            raise ValueError(f"{name} must be an integer in [{lo}, {hi}] for this model, got {value!r}")
    if kv_cache_mib is not None and (not is_real(kv_cache_mib) or not math.isfinite(kv_cache_mib)
                                     or kv_cache_mib <= 0):
        raise ValueError(f"kv_cache_mib must be a finite number > 0, got {kv_cache_mib!r}")


MAX_JSON_BYTES = 16 * 2**20     # a config is a few KB; anything this large is not one


def _read_json(path: Path) -> dict:
    try:
        if path.stat().st_size > MAX_JSON_BYTES:
            raise ConfigError(f"{path} is {path.stat().st_size} bytes; a config file is at most {MAX_JSON_BYTES}")
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
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
