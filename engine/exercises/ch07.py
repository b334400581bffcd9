"""Chapter 07 exercises: SiLU and SwiGLU, one whole decoder layer, and the top-k next tokens."""
from __future__ import annotations

import functools
import tempfile
from collections.abc import Callable

import numpy as np

from engine.exercises.ch03 import run_array_checks
from engine.model.forward_pass import load_model
from engine.model.random_model import write_random_model
from engine.ops.attention import prefill_attention, softmax
from engine.ops.embedding import embedding
from engine.ops.linear import linear
from engine.ops.rmsnorm import rmsnorm
from engine.ops.rope import rope_qkv
from engine.ops.swiglu import silu, swiglu_ref


def check_silu(fn: Callable) -> bool:
    """fn(x) -> x * sigmoid(x), elementwise."""
    rng = np.random.default_rng(0)
    xs = [np.array([-3.0, -1.0, 0.0, 1.0, 3.0], dtype=np.float32), rng.standard_normal((4, 9), dtype=np.float32) * 4,
          np.array([-80.0, -20.0, 20.0, 80.0], dtype=np.float32)]
    hints = [("that is sigmoid(x); SiLU multiplies it by x", lambda x: 1 / (1 + np.exp(-x))),
             ("that is ReLU", lambda x: np.maximum(x, 0))]
    return run_array_checks("silu", fn, [((x,), silu(x)) for x in xs], rtol=1e-5, atol=1e-6, hints=hints)


def check_swiglu(fn: Callable) -> bool:
    """fn(gate_up [T, 2I]) -> silu(gate) * up, [T, I]; gate = the first I columns, up = the last I."""
    rng = np.random.default_rng(1)
    cases = []
    for T, I in ((1, 3), (4, 8), (5, 136), (3, 1536)):
        gate_up = rng.standard_normal((T, 2 * I), dtype=np.float32) * 2
        cases.append(((gate_up,), swiglu_ref(gate_up)))
    hints = [("silu was applied to up instead of gate (gate = first half of the columns)",
              lambda gu: swiglu_ref(np.concatenate(np.split(gu, 2, axis=-1)[::-1], axis=-1))),
             ("gate and up were taken as interleaved columns; they are the two halves",
              lambda gu: silu(gu[:, 0::2]) * gu[:, 1::2]),
             ("silu is missing: that is the bilinear gate * up", lambda gu: np.prod(np.split(gu, 2, axis=-1), axis=0))]
    return run_array_checks("swiglu", fn, cases, rtol=1e-5, atol=1e-6, hints=hints)


# ----------------------------------------------------------------------------- one decoder layer

def decoder_layer_ref(x, lw, config, positions, cos, sin, *, rope=True, second_norm=True):
    """One Llama decoder layer on the residual stream x [T, H] of one sequence -> the new residual.

    The keyword switches exist to compute the answers of common mistakes for the checker's hints.
    """
    T = x.shape[0]
    h = rmsnorm(x, lw.input_norm, config.rms_norm_eps)
    qkv = linear(h, lw.qkv)                                      # [T, (Hq + 2Hkv) * D]
    if rope:
        qkv = rope_qkv(qkv, positions, cos, sin, config)
    attn = prefill_attention(qkv, np.array([0, T]), config)      # [T, Hq * D]
    x = x + linear(attn, lw.o)
    h2 = rmsnorm(x, lw.post_norm, config.rms_norm_eps) if second_norm else h
    return x + linear(swiglu_ref(linear(h2, lw.gate_up)), lw.down)


def _attention_out(h, lw, config, positions, cos, sin):
    qkv = rope_qkv(linear(h, lw.qkv), positions, cos, sin, config)
    return linear(prefill_attention(qkv, np.array([0, h.shape[0]]), config), lw.o)


def _mlp_out(h, lw):
    return linear(swiglu_ref(linear(h, lw.gate_up)), lw.down)


def _add_before_norm(x, lw, config, positions, cos, sin):
    """A classic mistake: add the residual first and normalize the sum (post-norm, the original
    Transformer's order), x = norm(x + sublayer(x)); Llama normalizes each sublayer's input instead."""
    eps = config.rms_norm_eps
    x = rmsnorm(x + _attention_out(x, lw, config, positions, cos, sin), lw.input_norm, eps)
    return rmsnorm(x + _mlp_out(x, lw), lw.post_norm, eps)


def _residual_from_norm(x, lw, config, positions, cos, sin):
    """Another: the sublayer's output is added to the normalized x, not to the residual stream."""
    eps = config.rms_norm_eps
    h = rmsnorm(x, lw.input_norm, eps)
    x = h + _attention_out(h, lw, config, positions, cos, sin)
    h2 = rmsnorm(x, lw.post_norm, eps)
    return h2 + _mlp_out(h2, lw)


def _no_residual(x, lw, config, positions, cos, sin):
    h = rmsnorm(x, lw.input_norm, config.rms_norm_eps)
    qkv = rope_qkv(linear(h, lw.qkv), positions, cos, sin, config)
    a = linear(prefill_attention(qkv, np.array([0, x.shape[0]]), config), lw.o)
    return linear(swiglu_ref(linear(rmsnorm(a, lw.post_norm, config.rms_norm_eps), lw.gate_up)), lw.down)


@functools.cache
def _tiny_model(preset: str):
    with tempfile.TemporaryDirectory(prefix="ch07_") as d:
        return load_model(write_random_model(d, preset, seed=7, dtype="F32"), backend="numpy")


def check_decoder_layer(fn: Callable) -> bool:
    """fn(x [T, H], layer_weights, config, positions [T], cos, sin) -> the residual after the layer.

    Checked layer by layer on tiny random models (GQA, MQA, MHA), then as a whole: embedding, your
    layer 2-3 times, final norm and LM head must give the same logits as engine's model.logits.
    """
    rng = np.random.default_rng(2)
    cases = []
    for preset, T in (("tiny", 5), ("tiny-mqa", 7), ("tiny-mha-untied", 1)):
        m = _tiny_model(preset)
        x = rng.standard_normal((T, m.config.hidden_size), dtype=np.float32)
        positions = np.arange(T, dtype=np.int32)
        for lw in m.weights.layers:
            args = (x, lw, m.config, positions, m.cos, m.sin)
            cases.append((args, decoder_layer_ref(*args)))
    hints = [("RoPE is missing: rotate q and k before attention",
              lambda *a: decoder_layer_ref(*a, rope=False)),
             ("the MLP reused the first norm's output; it needs rmsnorm(x, post_norm) of the updated x",
              lambda *a: decoder_layer_ref(*a, second_norm=False)),
             ("the residual adds are missing: x + attention(...), then x + mlp(...)", _no_residual),
             ("the residual was added before the norm (x = rmsnorm(x + attention(x))); Llama is pre-norm: "
              "x = x + attention(rmsnorm(x)), then x = x + mlp(rmsnorm(x))", _add_before_norm),
             ("the sublayer's output was added to the normalized x; add it to the residual stream x itself "
              "(x = x + attention(rmsnorm(x)))", _residual_from_norm)]
    if not run_array_checks("decoder_layer", fn, cases, rtol=1e-4, atol=1e-5, hints=hints):
        return False
    m = _tiny_model("tiny")
    ids = rng.integers(0, m.config.vocab_size, 12).astype(np.int32)
    positions = np.arange(len(ids), dtype=np.int32)

    def logits_with_your_layer(ids):
        x = embedding(ids, m.weights.embed).copy()
        for lw in m.weights.layers:
            x = fn(x, lw, m.config, positions, m.cos, m.sin)
        return linear(rmsnorm(x, m.weights.norm, m.config.rms_norm_eps), m.weights.lm_head)

    return run_array_checks("decoder_layer in a whole model", logits_with_your_layer,
                            [((ids,), m.logits(ids))], rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------- the next token

def top_k_probs_ref(logits: np.ndarray, k: int):
    """The k most likely tokens (largest first) and their probabilities under softmax(logits)."""
    ids = np.argsort(-logits, kind="stable")[:k]
    return ids, softmax(logits.astype(np.float64))[ids]


def _as_rows(fn: Callable) -> Callable:
    """Wrap fn(logits, k) -> (ids, probs) into one [2, k] array, so the array checker can compare it."""
    @functools.wraps(fn)
    def rows(logits, k):
        ids, probs = fn(logits, k)
        return np.stack([np.asarray(ids, dtype=np.float64), np.asarray(probs, dtype=np.float64)])
    return rows


def check_top_k_probs(fn: Callable) -> bool:
    """fn(logits [V], k) -> (ids [k], probs [k]): the k largest logits, largest first, with softmax probabilities."""
    rng = np.random.default_rng(3)
    cases = []
    for V, k, scale in ((10, 3, 1.0), (49152, 5, 4.0), (1000, 1, 10.0), (300, 20, 0.5), (8, 8, 1.0)):
        logits = (rng.standard_normal(V) * scale).astype(np.float32)
        cases.append(((logits, k), np.stack(top_k_probs_ref(logits, k)).astype(np.float64)))
    hints = [("the probabilities were renormalized over the k tokens only; softmax runs over the whole vocabulary",
              lambda lg, k: np.stack([top_k_probs_ref(lg, k)[0], softmax(np.sort(lg)[::-1][:k].astype(np.float64))])),
             ("the order is smallest first; list the most likely token first",
              lambda lg, k: np.stack(top_k_probs_ref(lg, k))[:, ::-1]),
             ("these are the logits, not probabilities",
              lambda lg, k: np.stack([top_k_probs_ref(lg, k)[0], np.sort(lg)[::-1][:k]]))]
    return run_array_checks("top_k_probs", _as_rows(fn), cases, rtol=1e-4, atol=1e-7, hints=hints)


# ----------------------------------------------------------------------------------------------
# GPU track: SwiGLU as a CUDA kernel (kernels_cu/exercises/swiglu.cu)
# ----------------------------------------------------------------------------------------------

def _swiglu_kernel_case(rng, T: int, I: int, max_blocks: int = 65535):
    from engine.exercises.cuda_check import Case, f32_values
    gate_up = f32_values(rng, (T, 2 * I), 2.0)                     # [T, 2I]: gate columns, then up columns
    gate, up = gate_up[:, :I], gate_up[:, I:]
    flat = gate_up.reshape(-1)
    idx = np.arange(T)[:, None] * I + np.arange(I)[None, :]        # a row stride of I instead of 2I
    with np.errstate(all="ignore"):
        hints = [("gate and up are swapped: silu(up) * gate", silu(up) * gate),
                 ("sigmoid(g) * u: SiLU is g * sigmoid(g)", up / (1 + np.exp(-gate))),
                 ("the row stride of gate_up is I; each row holds 2I values (gate, then up)",
                  silu(flat[idx]) * flat[idx + I])]
    n = T * I
    blocks = min((n + 255) // 256, max_blocks)
    label = f"T={T} I={I}, {blocks} blocks of 256" + (" (grid capped)" if blocks < (n + 255) // 256 else "")
    return Case(label, (blocks,), 256, {"gate_up": gate_up},
                lambda d: (d["gate_up"], d["out"], np.int64(n), np.int32(I)), "bf16", swiglu_ref(gate_up), hints,
                nbytes=n * (8 + 2))


def _swiglu_kernel_cases():
    rng = np.random.default_rng(70)
    return [_swiglu_kernel_case(rng, *c) for c in ((5, 137), (1, 3), (37, 1000, 4), (64, 2049), (3, 8192, 7))]


def check_swiglu_kernel(source=None) -> bool | None:
    """GPU track: your swiglu kernel (default: kernels_cu/exercises/swiglu.cu; or a path, or the CUDA
    source text) against the reference, with the likely mistake named and its GB/s."""
    from engine.exercises.cuda_check import Exercise, check_kernel
    timing = lambda: _swiglu_kernel_case(np.random.default_rng(71), 2047, 8192)  # noqa: E731
    return check_kernel(Exercise("swiglu kernel", "swiglu.cu", "swiglu", "swiglu", _swiglu_kernel_cases, timing),
                        source)
