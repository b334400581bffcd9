"""Model weights: checkpoint tensors -> the arrays the forward pass uses (chapter 01).

Every expected tensor must be present with its exact shape, and an unexpected tensor is an error:
a checkpoint that does not match its config.json is refused, never half-loaded. q/k/v and
gate/up are fused into one matrix each here, once, so each is a single GEMM at run time. A
Qwen3-MoE sparse layer's experts are stacked into [E, 2*Ie, H] and [E, H, Ie], from either layout a
checkpoint holds them in (EXPERT_LAYOUTS).

CPU backend: float32 arrays (bf16 -> fp32 is exact). GPU backend: matrices stay bf16 on the device
(uint16 bits, copied straight from the file mapping into their slice of the fused matrix); the
small norm vectors are fp32.

Checked before anything large is allocated: the layer count and every tensor shape against
config.json (a config claiming 10**8 layers fails on the first comparison, not after allocating),
and the embedding tying. Checked while loading, for the price of two max() passes per tensor: no
weight is NaN or infinite (the error names the tensor).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.backend import Backend
from engine.formats.config import ConfigError, LlamaConfig, ModelShape, model_shape
from engine.formats.safetensors import Checkpoint, open_checkpoint
from engine.ops.quantization import DEFAULT_GROUP_SIZE, QuantizationError, QuantizedWeight, check_settings, from_awq, quantize_ref

FLOAT_DTYPES = ("F32", "F16", "BF16")
QUANTIZATIONS = {"int8": 8, "int4": 4}      # load_model(..., quantization=...): weight-only, group-wise
# an AWQ checkpoint's tensors for one projection of N outputs and K inputs, group G: (suffix, shape, dtype)
AWQ_TENSORS = (("qweight", lambda N, K, G: (K, N // 8), "I32"), ("qzeros", lambda N, K, G: (K // G, N // 8), "I32"),
               ("scales", lambda N, K, G: (K // G, N), "F16"))


@dataclass
class LayerWeights:
    # each projection (qkv, o, gate_up, down) is a matrix, or a QuantizedWeight of the same [N, K]
    input_norm: object    # [H]              fp32
    qkv: object           # [Hq*D + 2*Hkv*D, H]  q rows, then k rows, then v rows
    o: object             # [H, Hq*D]
    post_norm: object     # [H]              fp32
    gate_up: object       # [2*I, H]         gate rows, then up rows (None on a sparse layer)
    down: object          # [H, I]           (None on a sparse layer)
    qkv_bias: object = None   # [Hq*D + 2*Hkv*D] fp32, q then k then v (Qwen2; None otherwise)
    q_norm: object = None     # [D] fp32: RMSNorm weights over each q head (Qwen3; None otherwise)
    k_norm: object = None     # [D] fp32: the same over each k head
    moe: ExpertWeights | None = None   # a sparse layer's router and experts (gate_up and down are None)


@dataclass
class ExpertWeights:
    """A Qwen3-MoE layer's mixture of experts, stacked along a leading expert axis."""

    router: object        # [E, H]           the router ("mlp.gate"): one logit per expert
    gate_up: object       # [E, 2*Ie, H]     each expert's gate rows, then its up rows
    down: object          # [E, H, Ie]


@dataclass
class Weights:
    embed: object         # [V, H]
    layers: list
    norm: object          # [H]              fp32
    lm_head: object       # [V, H]  (the same array as embed when tied)


def layer_prefix(i: int) -> str:
    return f"model.layers.{i}."


# The two layouts of a Qwen3-MoE layer's experts in a checkpoint: the published one (one tensor per
# expert and projection) and the one transformers 5 keeps in memory (3-D tensors of all experts).
EXPERT_LAYOUTS = ("per_expert", "fused")


def expert_shapes(config: ModelShape, layer: int, layout: str = "per_expert") -> dict[str, tuple[int, ...]]:
    """The tensors of sparse layer `layer`'s router and experts, in `layout` (EXPERT_LAYOUTS)."""
    assert config.moe is not None
    E, Ie, H = config.moe.num_experts, config.moe.expert_intermediate_size, config.hidden_size
    p = layer_prefix(layer) + "mlp."
    shapes: dict[str, tuple[int, ...]] = {p + "gate.weight": (E, H)}
    if layout == "fused":
        shapes.update({p + "experts.gate_up_proj": (E, 2 * Ie, H), p + "experts.down_proj": (E, H, Ie)})
        return shapes
    for e in range(E):
        shapes.update({f"{p}experts.{e}.gate_proj.weight": (Ie, H), f"{p}experts.{e}.up_proj.weight": (Ie, H),
                       f"{p}experts.{e}.down_proj.weight": (H, Ie)})
    return shapes


def expected_shapes(config: ModelShape | dict, expert_layout: str = "per_expert") -> dict[str, tuple[int, ...]]:
    """Hugging Face tensor name -> shape, for every tensor a checkpoint of this config must hold
    (Llama's, plus q/k/v biases for Qwen2, q_norm/k_norm for Qwen3, and on Qwen3-MoE's sparse layers
    the router and experts in place of the MLP, in `expert_layout`).

    The one rule for both the loader and the GGUF converter (which passes the config.json dict it
    is about to write).
    """
    if isinstance(config, dict):
        config = model_shape(config)
    H, I, V = config.hidden_size, config.intermediate_size, config.vocab_size
    shapes = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, H)
    for i in range(config.num_hidden_layers):
        p = layer_prefix(i)
        shapes.update({
            p + "input_layernorm.weight": (H,),
            p + "self_attn.q_proj.weight": (config.q_dim, H),
            p + "self_attn.k_proj.weight": (config.kv_dim, H),
            p + "self_attn.v_proj.weight": (config.kv_dim, H),
            p + "self_attn.o_proj.weight": (H, config.q_dim),
            p + "post_attention_layernorm.weight": (H,),
        })
        if config.is_sparse(i):
            shapes.update(expert_shapes(config, i, expert_layout))
        else:
            shapes.update({p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H),
                           p + "mlp.down_proj.weight": (H, I)})
        if config.qkv_bias:
            shapes.update({p + "self_attn.q_proj.bias": (config.q_dim,), p + "self_attn.k_proj.bias": (config.kv_dim,),
                           p + "self_attn.v_proj.bias": (config.kv_dim,)})
        if config.qk_norm:
            shapes.update({p + "self_attn.q_norm.weight": (config.head_dim,),
                           p + "self_attn.k_norm.weight": (config.head_dim,)})
    return shapes


_LAYER_NAME = re.compile(r"model\.layers\.(\d{1,12})\.")


def checkpoint_layer_count(names) -> int:
    """1 + the highest layer index among the tensor names (0 without layers)."""
    indices = [int(m.group(1)) for m in map(_LAYER_NAME.match, names) if m]
    return max(indices) + 1 if indices else 0


def _ignorable(name: str) -> bool:
    """Rotary buffers some exporters add: recomputed from the config."""
    return name.endswith("rotary_emb.inv_freq")


def _check_tying(ckpt: Checkpoint, config: LlamaConfig) -> None:
    """tie_word_embeddings must describe the checkpoint: tied means no lm_head or an exact copy of
    the embedding (some exporters write one); untied means an lm_head of its own."""
    has_head = "lm_head.weight" in ckpt
    if not config.tie_word_embeddings and not has_head:
        raise ConfigError(f"{ckpt.path}: config.json says tie_word_embeddings=false but the checkpoint has no "
                          "lm_head.weight")
    if config.tie_word_embeddings and has_head:
        embed, head = "model.embed_tokens.weight", "lm_head.weight"
        same = (tuple(ckpt.shape(head)) == tuple(ckpt.shape(embed)) and ckpt.dtype(head) == ckpt.dtype(embed)
                and np.array_equal(ckpt.raw(head).view(np.uint8), ckpt.raw(embed).view(np.uint8)))
        if not same:
            raise ConfigError(f"{ckpt.path}: config.json says tie_word_embeddings=true but lm_head.weight is not "
                              "a copy of model.embed_tokens.weight")


def check_checkpoint(ckpt: Checkpoint, config: LlamaConfig) -> None:
    """Raise ConfigError unless the checkpoint holds exactly the tensors the config implies.

    Cheap checks first: the layer count is compared before the expected names are listed, so an
    absurd num_hidden_layers costs nothing.
    """
    layers = checkpoint_layer_count(ckpt.keys())
    if layers != config.num_hidden_layers:
        raise ConfigError(f"{ckpt.path}: config.json says num_hidden_layers={config.num_hidden_layers}, "
                          f"the checkpoint holds {layers} layer(s)")
    _check_tying(ckpt, config)
    expected = expected_shapes(config, checkpoint_expert_layout(ckpt, config))
    dtypes: dict[str, tuple[str, ...]] = dict.fromkeys(expected, FLOAT_DTYPES)
    if config.awq is not None:           # each projection's weight is three AWQ tensors
        for name in [n for n in expected if n.endswith("_proj.weight")]:
            N, K = expected.pop(name)
            del dtypes[name]
            G = _awq_group(config, name, K)
            for suffix, shape_of, dtype in AWQ_TENSORS:
                expected[name[:-len("weight")] + suffix] = shape_of(N, K, G)
                dtypes[name[:-len("weight")] + suffix] = (dtype,)
    check_tensor_set(ckpt, expected, dtypes, [n for n in ckpt.keys() if not _ignorable(n)
                                              and not (n == "lm_head.weight" and config.tie_word_embeddings)])


def check_tensor_set(ckpt: Checkpoint, expected: dict[str, tuple], dtypes: dict[str, tuple[str, ...]],
                     present: list[str]) -> None:
    """ConfigError unless every expected tensor is in the checkpoint with its shape and one of its dtypes,
    and every name of `present` (the checkpoint's tensors that count) is expected."""
    missing = [n for n in expected if n not in ckpt]
    if missing:
        raise ConfigError(f"{ckpt.path}: {len(missing)} expected tensor(s) missing, e.g. {missing[:3]}")
    unexpected = [n for n in present if n not in expected]
    if unexpected:
        raise ConfigError(f"{ckpt.path}: unexpected tensor(s) {unexpected[:3]} for this config")
    for name, shape in expected.items():
        if tuple(ckpt.shape(name)) != shape:
            raise ConfigError(f"{ckpt.path}: tensor {name!r} has shape {tuple(ckpt.shape(name))}, "
                              f"config.json implies {shape}")
        if ckpt.dtype(name) not in dtypes[name]:
            raise ConfigError(f"{ckpt.path}: tensor {name!r} is {ckpt.dtype(name)}; it must be "
                              f"one of {dtypes[name]}")


def checkpoint_expert_layout(ckpt: Checkpoint, config: ModelShape) -> str:
    """Which of EXPERT_LAYOUTS the checkpoint's experts are in (seen on the first sparse layer; a
    checkpoint that mixes them then fails the name check)."""
    if not config.num_sparse_layers:
        return "per_expert"
    assert config.moe is not None
    fused = layer_prefix(config.moe.sparse_layers[0]) + "mlp.experts.gate_up_proj"
    return "fused" if fused in ckpt else "per_expert"


def _awq_group(config: LlamaConfig, name: str, K: int) -> int:
    """The AWQ group size for a projection of K inputs (ConfigError if it cannot describe the weight)."""
    assert config.awq is not None
    try:
        return check_settings(config.awq.bits, config.awq.group_size, K)
    except QuantizationError as exc:
        raise ConfigError(f"config.json: quantization_config.group_size={config.awq.group_size} cannot describe "
                          f"the {K} inputs of {name}: {exc}") from None


def projection_inputs(config: LlamaConfig) -> set[int]:
    """The K (inputs) of the model's projections: qkv and gate_up take the hidden size, o the q heads, down I."""
    return {config.hidden_size, config.q_dim, config.intermediate_size}


class NonFiniteWeightsError(ConfigError):
    """A weight tensor holds NaN or an infinity: the model would produce non-finite logits."""


def check_finite(name: str, host: np.ndarray) -> None:
    """Refuse a tensor with NaN/inf: two max() passes, no temporaries.

    float32: NaN propagates through min/max and an infinity is the min or the max.
    bf16 bits (uint16): non-finite means exponent all ones, i.e. bits in [0x7F80, 0x7FFF] (positive;
    the largest values as int16) or [0xFF80, 0xFFFF] (negative; the largest as uint16).
    """
    if host.size == 0:
        return
    if host.dtype == np.uint16:
        bad = int(host.max()) >= 0xFF80 or int(host.view(np.int16).max()) >= 0x7F80
    else:
        bad = not (np.isfinite(host.min()) and np.isfinite(host.max()))
    if bad:
        raise NonFiniteWeightsError(f"tensor {name!r} holds NaN or infinite values")


class _Loader:
    """Reads tensors as float32 (CPU) or as bf16 device arrays (GPU), fusing row blocks; projections
    quantized on load (bits, group_size) or read from an AWQ checkpoint (config.awq)."""

    def __init__(self, ckpt: Checkpoint, backend: Backend, config: LlamaConfig,
                 bits: int | None = None, group_size: int = DEFAULT_GROUP_SIZE):
        self.ckpt, self.gpu = ckpt, backend.is_gpu
        self.xp = backend.xp
        self.config, self.bits, self.group_size = config, bits, group_size

    def projection(self, *names: str):
        """The named projections (HF names without ".weight"), fused along rows: a matrix, or a
        QuantizedWeight when the model is quantized."""
        if self.config.awq is not None:
            parts = [self._awq(n) for n in names]
        elif self.bits is not None:
            parts = [self._quantized(n, self.bits) for n in names]
        else:
            return self.matrix(*(n + ".weight" for n in names))
        qweight, scales, zeros = (np.concatenate([getattr(p, a) for p in parts]) for a in ("qweight", "scales", "zeros"))
        fused = QuantizedWeight(qweight, scales, zeros, bits=parts[0].bits, group_size=parts[0].group_size,
                                shape=(sum(p.shape[0] for p in parts), parts[0].shape[1]))
        if self.gpu:
            fused.qweight, fused.scales, fused.zeros = (self.xp.asarray(a) for a in
                                                        (fused.qweight, fused.scales, fused.zeros))
        return fused

    def _awq(self, name: str) -> QuantizedWeight:
        qweight, qzeros, scales = (self.ckpt.get_tensor(f"{name}.{suffix}") for suffix, _, _ in AWQ_TENSORS)
        check_finite(f"{name}.scales", scales)
        return from_awq(qweight, qzeros, scales, _awq_group(self.config, name, qweight.shape[0]))

    def _quantized(self, name: str, bits: int) -> QuantizedWeight:
        w = self.ckpt.get_tensor(name + ".weight")          # float32 (exact from bf16) or the stored float
        check_finite(name + ".weight", w)
        return quantize_ref(np.asarray(w, dtype=np.float32), bits, self.group_size)

    def matrix(self, *names: str):
        """Stack the named [rows_i, cols] matrices along rows (one name: the matrix itself)."""
        parts = [self.ckpt.get_bf16_bits(n) if self.gpu else self.ckpt.get_tensor(n) for n in names]
        for n, p in zip(names, parts, strict=True):
            check_finite(n, p)
        rows = sum(p.shape[0] for p in parts)
        out = self.xp.empty((rows, parts[0].shape[1]), dtype=self.xp.uint16 if self.gpu else self.xp.float32)
        r = 0
        for p in parts:      # host mapping -> its slice of the fused matrix, one copy
            if self.gpu:
                out[r:r + p.shape[0]].set(np.ascontiguousarray(p))
            else:
                out[r:r + p.shape[0]] = p
            r += p.shape[0]
        return out

    def experts(self, layer: int) -> ExpertWeights:
        """Sparse layer `layer`'s router [E, H] and experts stacked into gate_up [E, 2Ie, H] and
        down [E, H, Ie], from either checkpoint layout (one copy per expert into its slice)."""
        assert self.config.moe is not None
        p = layer_prefix(layer) + "mlp."
        E, Ie, H = self.config.moe.num_experts, self.config.moe.expert_intermediate_size, self.config.hidden_size
        dtype = self.xp.uint16 if self.gpu else self.xp.float32
        gate_up, down = self.xp.empty((E, 2 * Ie, H), dtype=dtype), self.xp.empty((E, H, Ie), dtype=dtype)
        sources: list[tuple[Any, str, Any]]       # (stacked array, tensor name, where in it)
        if checkpoint_expert_layout(self.ckpt, self.config) == "fused":
            sources = [(gate_up, p + "experts.gate_up_proj", slice(None)), (down, p + "experts.down_proj", slice(None))]
        else:
            sources = [(target, f"{p}experts.{e}.{proj}.weight", (e, rows))
                       for e in range(E) for target, proj, rows in
                       ((gate_up, "gate_proj", slice(0, Ie)), (gate_up, "up_proj", slice(Ie, 2 * Ie)),
                        (down, "down_proj", slice(None)))]
        for target, name, where in sources:
            part = self.ckpt.get_bf16_bits(name) if self.gpu else self.ckpt.get_tensor(name)
            check_finite(name, part)
            if self.gpu:
                target[where].set(np.ascontiguousarray(part))
            else:
                target[where] = part
        return ExpertWeights(router=self.matrix(p + "gate.weight"), gate_up=gate_up, down=down)

    def vector(self, *names: str):
        """The named 1-D tensors, concatenated, as fp32 on the backend (norm weights, biases: small)."""
        parts = [np.array(self.ckpt.get_tensor(n), dtype=np.float32) for n in names]
        for n, part in zip(names, parts, strict=True):
            check_finite(n, part)
        host = np.concatenate(parts)
        return self.xp.asarray(host) if self.gpu else host


def quantization_bits(quantization: str | None, config: LlamaConfig) -> int | None:
    """load_model's quantization argument -> bits (None: the checkpoint's own weights); ValueError names it."""
    if quantization is None:
        return None
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {sorted(QUANTIZATIONS)} or None, got {quantization!r}")
    if config.awq is not None:
        raise ValueError(f"quantization={quantization!r}: the checkpoint is AWQ-quantized already "
                         "(its own 4-bit weights are used)")
    return QUANTIZATIONS[quantization]


def default_group_size(config: LlamaConfig, bits: int) -> int:
    """DEFAULT_GROUP_SIZE where it divides the inputs of every projection, else the largest group below
    it that does (a multiple of the values per 32-bit word: SmolLM2-135M's 576 and 1536 take 96), else
    whole rows (-1)."""
    per_word = 32 // bits
    for G in range(DEFAULT_GROUP_SIZE, 0, -per_word):
        if all(K % G == 0 for K in projection_inputs(config)):
            return G
    return -1


def load_weights(model_dir, config: LlamaConfig, backend: Backend, quantization: str | None = None,
                 group_size: int | None = None) -> Weights:
    """The model's arrays; quantization "int8" | "int4" quantizes every projection on load (weight-only,
    group-wise: `group_size` inputs per scale and zero point, -1 for whole rows; None: default_group_size)."""
    bits = quantization_bits(quantization, config)
    if bits is not None and config.moe is not None:
        raise ValueError(f"quantization={quantization!r} is not supported for a mixture-of-experts model "
                         "(its experts run in bf16 on the GPU, float32 on the CPU)")
    if bits is not None:     # every projection's K must take the group size: checked before reading
        group_size = default_group_size(config, bits) if group_size is None else group_size
        for K in projection_inputs(config):
            check_settings(bits, group_size, K)
    with open_checkpoint(model_dir) as ckpt:
        check_checkpoint(ckpt, config)
        ld = _Loader(ckpt, backend, config, bits, DEFAULT_GROUP_SIZE if group_size is None else group_size)
        layers = []
        for i in range(config.num_hidden_layers):
            p = layer_prefix(i)
            attn = p + "self_attn."
            sparse = config.is_sparse(i)
            layers.append(LayerWeights(
                input_norm=ld.vector(p + "input_layernorm.weight"),
                qkv=ld.projection(p + "self_attn.q_proj", p + "self_attn.k_proj", p + "self_attn.v_proj"),
                o=ld.projection(p + "self_attn.o_proj"),
                post_norm=ld.vector(p + "post_attention_layernorm.weight"),
                gate_up=None if sparse else ld.projection(p + "mlp.gate_proj", p + "mlp.up_proj"),
                down=None if sparse else ld.projection(p + "mlp.down_proj"),
                moe=ld.experts(i) if sparse else None,
                qkv_bias=ld.vector(attn + "q_proj.bias", attn + "k_proj.bias", attn + "v_proj.bias")
                if config.qkv_bias else None,
                q_norm=ld.vector(attn + "q_norm.weight") if config.qk_norm else None,
                k_norm=ld.vector(attn + "k_norm.weight") if config.qk_norm else None,
            ))
        embed = ld.matrix("model.embed_tokens.weight")
        lm_head = embed if config.tie_word_embeddings else ld.matrix("lm_head.weight")
        return Weights(embed=embed, layers=layers, norm=ld.vector("model.norm.weight"), lm_head=lm_head)
