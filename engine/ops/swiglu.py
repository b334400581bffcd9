"""Chapter 07: the SwiGLU MLP, down( silu(gate(x)) * up(x) ), silu(g) = g * sigmoid(g)."""
from __future__ import annotations

import numpy as np

from engine.backend import is_device_array, load_kernel
from engine.plugins import OVERRIDES, run_function


def silu(x: np.ndarray) -> np.ndarray:
    return x / (np.float32(1.0) + np.exp(-x))


def swiglu_ref(gate_up: np.ndarray) -> np.ndarray:
    """gate_up [T, 2I] (gate columns first, then up) -> silu(gate) * up, [T, I]."""
    gate, up = np.split(gate_up, 2, axis=-1)
    return silu(gate) * up


def swiglu(gate_up):
    """GPU: fp32 [T, 2I] -> bf16 [T, I] (the down projection's input) in one elementwise kernel."""
    plug = OVERRIDES.get("swiglu")               # your stage (engine/plugins.py), if one is active
    if plug is not None and plug.fn is not None:
        return run_function(plug, (gate_up.shape[0], gate_up.shape[1] // 2), True, gate_up, gate_up)
    if not is_device_array(gate_up):
        if plug is not None:
            plug.require_function()
        return swiglu_ref(gate_up)
    import cupy as cp
    T, two_i = gate_up.shape
    I = two_i // 2
    out = cp.empty((T, I), dtype=cp.uint16)
    n = T * I
    if n:
        blocks = min((n + 255) // 256, 65535)
        kernel = plug.kernel() if plug is not None else load_kernel("swiglu", "swiglu")
        kernel((blocks,), (256,), (gate_up, out, np.int64(n), np.int32(I)))
    return out
