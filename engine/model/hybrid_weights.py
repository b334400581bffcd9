"""Weights of a Qwen3.5 hybrid model (appendix: linear attention): checkpoint tensors -> the arrays of
engine/model/hybrid_forward.py.

As for the dense families, every expected tensor must be there with its exact shape and nothing else
may be (except what transformers itself skips: the multi-token-prediction head `mtp.*` and the vision
tower `model.visual.*` of a qwen3_5 directory). Rearranged once, here:
  * linear_attention layers: in_proj_qkv, in_proj_z, in_proj_b and in_proj_a stacked into one matrix
    (one GEMM per layer); conv1d.weight [C, 1, K] stored as [C, K];
  * full_attention layers: q_proj's rows hold, per head, the query then its gate ([Hq, 2, D]); they are
    split here so q, k, v and the gate come out of one GEMM as [q | k | v | gate];
  * every Qwen3_5RMSNorm scales by (1 + weight): the 1 is added on load, so the forward pass runs the
    ordinary RMSNorm (the mixer's gated norm uses its weight as it is).
float32 on the NumPy backend. On the GPU the matrices (the projections, embedding, lm_head) are bf16
on the device, read straight from the file's bf16 bits; the norms, the conv taps, A_log and dt_bias
stay fp32 (the gated delta kernels read fp32).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from engine.backend import Backend
from engine.formats.config import FULL_ATTENTION, ConfigError, HybridConfig
from engine.formats.safetensors import Checkpoint, open_checkpoint
from engine.model.weights import FLOAT_DTYPES, Weights, check_finite, check_tensor_set

IGNORED_PREFIXES = ("mtp.", "model.visual.")     # transformers skips these too


@dataclass
class LinearAttentionLayer:
    """A Gated DeltaNet layer. C = conv_dim = 2 Hk Dk + Hv Dv (q, k, v side by side)."""

    input_norm: np.ndarray   # [H]                      1 + w
    in_proj: np.ndarray      # [C + Hv*Dv + 2*Hv, H]    rows: qkv (C), z (Hv*Dv), b (Hv), a (Hv)
    conv: np.ndarray         # [C, K]                   depthwise taps, oldest first
    A_log: np.ndarray        # [Hv]
    dt_bias: np.ndarray      # [Hv]
    norm: np.ndarray         # [Dv]                     the gated RMSNorm's weight, as stored
    out: np.ndarray          # [H, Hv*Dv]
    post_norm: np.ndarray    # [H]                      1 + w
    gate_up: np.ndarray      # [2I, H]
    down: np.ndarray         # [H, I]


@dataclass
class GatedAttentionLayer:
    """A full-attention layer with a query gate."""

    input_norm: np.ndarray   # [H]                      1 + w
    qkvg: np.ndarray         # [2*Hq*D + 2*Hkv*D, H]    rows: q, k, v, gate
    q_norm: np.ndarray       # [D]                      1 + w
    k_norm: np.ndarray       # [D]                      1 + w
    o: np.ndarray            # [H, Hq*D]
    post_norm: np.ndarray    # [H]                      1 + w
    gate_up: np.ndarray      # [2I, H]
    down: np.ndarray         # [H, I]


def hybrid_shapes(config: HybridConfig) -> dict[str, tuple[int, ...]]:
    """Hugging Face tensor name -> shape, for every tensor a checkpoint of this config must hold."""
    H, I, V, p = config.hidden_size, config.intermediate_size, config.vocab_size, config.weights_prefix
    C, Vd, Hv = config.conv_dim, config.linear_value_dim, config.linear_num_value_heads
    shapes = {p + "embed_tokens.weight": (V, H), p + "norm.weight": (H,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, H)
    for i, kind in enumerate(config.layer_types):
        layer = f"{p}layers.{i}."
        shapes.update({layer + "input_layernorm.weight": (H,), layer + "post_attention_layernorm.weight": (H,),
                       layer + "mlp.gate_proj.weight": (I, H), layer + "mlp.up_proj.weight": (I, H),
                       layer + "mlp.down_proj.weight": (H, I)})
        if kind == FULL_ATTENTION:
            a = layer + "self_attn."
            shapes.update({a + "q_proj.weight": (2 * config.q_dim, H), a + "k_proj.weight": (config.kv_dim, H),
                           a + "v_proj.weight": (config.kv_dim, H), a + "o_proj.weight": (H, config.q_dim),
                           a + "q_norm.weight": (config.head_dim,), a + "k_norm.weight": (config.head_dim,)})
        else:
            a = layer + "linear_attn."
            shapes.update({a + "in_proj_qkv.weight": (C, H), a + "in_proj_z.weight": (Vd, H),
                           a + "in_proj_b.weight": (Hv, H), a + "in_proj_a.weight": (Hv, H),
                           a + "conv1d.weight": (C, 1, config.linear_conv_kernel_dim),
                           a + "A_log": (Hv,), a + "dt_bias": (Hv,),
                           a + "norm.weight": (config.linear_value_head_dim,), a + "out_proj.weight": (H, Vd)})
    return shapes


def check_hybrid_checkpoint(ckpt: Checkpoint, config: HybridConfig) -> None:
    """Raise ConfigError unless the checkpoint holds exactly the tensors the config implies (the layer
    count first, so an absurd num_hidden_layers costs nothing)."""
    layer_name = re.compile(re.escape(config.weights_prefix) + r"layers\.(\d{1,12})\.")
    names = [n for n in ckpt.keys() if not n.startswith(IGNORED_PREFIXES) and not n.endswith("rotary_emb.inv_freq")]
    layers = 1 + max((int(m.group(1)) for m in map(layer_name.match, names) if m), default=-1)
    if layers != config.num_hidden_layers:
        raise ConfigError(f"{ckpt.path}: config.json says num_hidden_layers={config.num_hidden_layers}, "
                          f"the checkpoint holds {layers} layer(s) under {config.weights_prefix}layers.")
    expected = hybrid_shapes(config)
    embed = config.weights_prefix + "embed_tokens.weight"
    if "lm_head.weight" in ckpt and config.tie_word_embeddings:     # an exact copy is allowed (some exporters)
        if not np.array_equal(ckpt.get_tensor("lm_head.weight"), ckpt.get_tensor(embed)):
            raise ConfigError(f"{ckpt.path}: config.json says tie_word_embeddings=true but lm_head.weight is not "
                              f"a copy of {embed}")
        names.remove("lm_head.weight")
    check_tensor_set(ckpt, expected, dict.fromkeys(expected, FLOAT_DTYPES), names)


class _Reader:
    """Checked tensors as host arrays: vectors float32, matrices float32 (CPU) or bf16 bits (GPU), so
    rows are rearranged on the host before one copy to the device (on_backend)."""

    def __init__(self, ckpt: Checkpoint, backend: Backend):
        self.ckpt, self.backend = ckpt, backend

    def __call__(self, name: str) -> np.ndarray:
        x = np.asarray(self.ckpt.get_tensor(name), dtype=np.float32)
        check_finite(name, x)
        return x

    def matrix(self, name: str) -> np.ndarray:
        if not self.backend.is_gpu:
            return self(name)
        bits = self.ckpt.get_bf16_bits(name)
        check_finite(name, bits)
        return bits

    def on_backend(self, x: np.ndarray):
        return self.backend.xp.asarray(np.ascontiguousarray(x)) if self.backend.is_gpu else x


def load_hybrid_weights(model_dir, config: HybridConfig, backend: Backend) -> Weights:
    """The model's arrays on the backend, checked against the config before anything is read."""
    one = np.float32(1.0)
    Hq, D = config.num_attention_heads, config.head_dim
    with open_checkpoint(model_dir) as ckpt:
        check_hybrid_checkpoint(ckpt, config)
        read = _Reader(ckpt, backend)
        mat, dev = read.matrix, read.on_backend
        layers: list[LinearAttentionLayer | GatedAttentionLayer] = []
        for i, kind in enumerate(config.layer_types):
            p = f"{config.weights_prefix}layers.{i}."
            norms = {"input_norm": dev(read(p + "input_layernorm.weight") + one),
                     "post_norm": dev(read(p + "post_attention_layernorm.weight") + one),
                     "gate_up": dev(np.concatenate([mat(p + "mlp.gate_proj.weight"), mat(p + "mlp.up_proj.weight")])),
                     "down": dev(mat(p + "mlp.down_proj.weight"))}
            if kind == FULL_ATTENTION:
                a = p + "self_attn."
                q_and_gate = mat(a + "q_proj.weight").reshape(Hq, 2, D, -1)     # per head: query rows, gate rows
                query, gate = (q_and_gate[:, j].reshape(Hq * D, -1) for j in (0, 1))
                layers.append(GatedAttentionLayer(
                    qkvg=dev(np.concatenate([query, mat(a + "k_proj.weight"), mat(a + "v_proj.weight"), gate])),
                    q_norm=dev(read(a + "q_norm.weight") + one), k_norm=dev(read(a + "k_norm.weight") + one),
                    o=dev(mat(a + "o_proj.weight")), **norms))
            else:
                a = p + "linear_attn."
                layers.append(LinearAttentionLayer(
                    in_proj=dev(np.concatenate([mat(a + f"in_proj_{x}.weight") for x in ("qkv", "z", "b", "a")])),
                    conv=dev(read(a + "conv1d.weight")[:, 0, :]), A_log=dev(read(a + "A_log")),
                    dt_bias=dev(read(a + "dt_bias")), norm=dev(read(a + "norm.weight")),
                    out=dev(mat(a + "out_proj.weight")), **norms))
        embed = dev(mat(config.weights_prefix + "embed_tokens.weight"))
        lm_head = embed if config.tie_word_embeddings else dev(mat("lm_head.weight"))
        return Weights(embed=embed, layers=layers, norm=dev(read(config.weights_prefix + "norm.weight") + one),
                       lm_head=lm_head)
