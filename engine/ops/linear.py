"""Chapter 06: linear layers, y = x @ W^T with W stored [out_features, in_features] (nn.Linear).

On the GPU every projection is one cuBLAS gemmEx call: bf16 operands, fp32 accumulation, fp32
output (the kernels after it read fp32 and write the bf16 input of the next GEMM). q/k/v and
gate/up are fused into one weight each at load time, so each is a single GEMM.

Chapter 14: a decode step's projections have 1..8 rows, where the time is reading W and cuBLAS
leaves bandwidth unused. Those go to the GEMV kernel (engine/ops/gemv.py, kernels_cu/gemv.cu) when
`USE_GEMV` is on (sm_80+ only; cuBLAS otherwise). It is on by default; ENGINE_GEMV=0 in the
environment turns it off, to compare the two. Which one is the default is decided by measurement on
the H200 (`python -m engine.kernel_bench --only gemv` times both on the decode shapes): the GEMV
stays on only where it beats cuBLAS.
"""
from __future__ import annotations

import os

import numpy as np

from engine.backend import is_device_array, matmul
from engine.ops import gemv as _gemv

ENV_SWITCH = "ENGINE_GEMV"      # "0" sends every projection to cuBLAS
USE_GEMV = os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "off", "no")


def linear_ref(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x [T, K], w [N, K] -> [T, N] float32."""
    return x @ w.T


def linear(x, w, out=None):
    """GPU: x bf16 [T, K] (uint16 bits), w bf16 [N, K] -> fp32 [T, N]. CPU: the reference.
    1 <= T <= GEMV_MAX_ROWS (decode): the GEMV kernel while USE_GEMV is on; else cuBLAS."""
    if not is_device_array(w):
        return linear_ref(x, w)
    if USE_GEMV and _gemv.supported(x, w, out):
        return _gemv.gemv(x, w, out)
    import cupy as cp
    if out is None:
        out = cp.empty((x.shape[0], w.shape[0]), dtype=cp.float32)
    if x.shape[0]:
        matmul(x, w, out, trans_b=True)
    return out
