"""Chapter 06: linear layers, y = x @ W^T with W stored [out_features, in_features] (nn.Linear).

On the GPU every projection is one cuBLAS gemmEx call: bf16 operands, fp32 accumulation, fp32
output (the kernels after it read fp32 and write the bf16 input of the next GEMM). q/k/v and
gate/up are fused into one weight each at load time, so each is a single GEMM.
"""
from __future__ import annotations

import numpy as np

from engine.backend import is_device_array, matmul


def linear_ref(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x [T, K], w [N, K] -> [T, N] float32."""
    return x @ w.T


def linear(x, w, out=None):
    """GPU: x bf16 [T, K] (uint16 bits), w bf16 [N, K] -> fp32 [T, N]. CPU: the reference."""
    if not is_device_array(w):
        return linear_ref(x, w)
    import cupy as cp
    if out is None:
        out = cp.empty((x.shape[0], w.shape[0]), dtype=cp.float32)
    if x.shape[0]:
        matmul(x, w, out, trans_b=True)
    return out
