"""Appendix (model families) exercises: Qwen3's per-head q/k RMSNorm, and what Qwen2's biases cost."""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from engine.exercises.ch03 import run_array_checks
from engine.formats.config import config_from_dict
from engine.ops.rmsnorm import rmsnorm_ref


def _heads(seed: int):
    """(x [T, n_heads, D], w [D], eps): Qwen3-0.6B's head_dim, odd sizes, one all-zero head, big values."""
    rng = np.random.default_rng(seed)
    for T, n, D, scale in ((3, 4, 8, 1.0), (5, 16, 128, 30.0), (2, 6, 10, 1e-3), (1, 3, 24, 5.0)):
        x = (scale * rng.standard_normal((T, n, D))).astype(np.float32)
        x[0, -1] = 0.0
        w = (1 + 0.3 * rng.standard_normal(D)).astype(np.float32)
        yield x, w, 1e-6


_HINTS = [
    ("the mean was taken over the heads (axis 1): Qwen3 normalizes each head over its own D values",
     lambda x, w, eps: x / np.sqrt(np.mean(x * x, 1, keepdims=True) + np.float32(eps)) * w),
    ("the mean was taken over all heads of a token together (D * n_heads values): that is Olmo's q/k norm, "
     "Qwen3's works on one head at a time",
     lambda x, w, eps: x / np.sqrt(np.mean(x * x, (1, 2), keepdims=True) + np.float32(eps)) * w),
    ("the weight w is missing", lambda x, w, eps: rmsnorm_ref(x, np.ones_like(w), eps)),
    ("eps is added outside the square root",
     lambda x, w, eps: x / (np.sqrt(np.mean(x * x, -1, keepdims=True)) + np.float32(eps)) * w),
]


def check_qk_norm(fn: Callable) -> bool:
    """fn(x [T, n_heads, D], w [D], eps) -> every head divided by its RMS and scaled by w."""
    cases = [((x, w, eps), rmsnorm_ref(x, w, eps)) for x, w, eps in _heads(0)]
    return run_array_checks("q/k norm", fn, cases, rtol=1e-4, atol=1e-5, hints=_HINTS)


def check_bias_parameters(preset_config: dict, answer) -> bool:
    """answer: how many parameters the q/k/v biases add to the whole model of this config."""
    c = config_from_dict(preset_config)
    want = c.num_hidden_layers * c.qkv_dim
    if answer == want:
        print(f"[OK] bias parameters: {want:,} ({want / c.num_parameters():.4%} of the model)")
        return True
    if answer == c.num_hidden_layers * (c.q_dim + c.hidden_size):
        print("[x] bias parameters: k and v have num_key_value_heads heads, not hidden_size / head_dim")
    elif answer == c.qkv_dim:
        print("[x] bias parameters: that is one layer; every layer has its own biases")
    elif answer == c.num_hidden_layers * (c.qkv_dim + c.hidden_size):
        print("[x] bias parameters: o_proj has no bias in Qwen2, only q, k and v")
    else:
        print(f"[x] bias parameters: {answer!r} is not it; per layer q has Hq * D, k and v Hkv * D each")
    return False
