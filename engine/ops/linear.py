"""Chapter 06: linear layers, y = x @ W^T with W stored [out_features, in_features] (nn.Linear).

On the GPU every projection is one cuBLAS gemmEx call: bf16 operands, fp32 accumulation, fp32
output (the kernels after it read fp32 and write the bf16 input of the next GEMM). q/k/v and
gate/up are fused into one weight each at load time, so each is a single GEMM.

Chapter 14: a decode step's projections have 1..8 rows, where the time is reading W and cuBLAS
leaves bandwidth unused. Those go to the GEMV kernel (engine/ops/gemv.py, kernels_cu/gemv.cu) when
`USE_GEMV` is on (sm_80+ only; cuBLAS otherwise). It is on by default; ENGINE_GEMV=0 in the
environment turns it off, to compare the two. Measured on the H200 (`python -m engine.kernel_bench
--only gemv`, Llama-3.2-1B shapes, 1..8 rows): the GEMV beats cuBLAS on the matrices of up to
~17 M elements (qkv 54 vs 45% of copy bandwidth, o 44 vs 33%, down 66 vs 58%), where cuBLAS's
decode kernels are launch- and tail-bound, and loses on the large ones (gate_up 83 vs 87%, lm_head
92 vs 102%), where cuBLAS streams at copy speed. So only W up to GEMV_MAX_WEIGHT_ELEMENTS goes there.
"""
from __future__ import annotations

import numpy as np

from engine.backend import is_device_array, matmul
from engine.checks import env_switch
from engine.ops import gemv as _gemv
from engine.ops import quant_gemv as _quant_gemv
from engine.ops.quantization import QuantizedWeight, dequantize_ref
from engine.plugins import OVERRIDES, PluginError, run_function

ENV_SWITCH = "ENGINE_GEMV"      # "0" sends every projection to cuBLAS
GEMV_MAX_WEIGHT_ELEMENTS = 24 * 2**20   # larger weights stream faster through cuBLAS (measured above)
USE_GEMV = env_switch(ENV_SWITCH)


def linear_ref(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x [T, K], w [N, K] -> [T, N] float32."""
    return x @ w.T


def linear(x, w, out=None):
    """GPU: x bf16 [T, K] (uint16 bits), w bf16 [N, K] -> fp32 [T, N]. CPU: the reference.
    1 <= T <= GEMV_MAX_ROWS (decode) and W of at most GEMV_MAX_WEIGHT_ELEMENTS: the GEMV kernel while
    USE_GEMV is on; else cuBLAS. A quantized W (chapter 18): quantized_linear."""
    if isinstance(w, QuantizedWeight):
        return quantized_linear(x, w, out)
    if not is_device_array(w):
        return linear_ref(x, w)
    if USE_GEMV and w.size <= GEMV_MAX_WEIGHT_ELEMENTS and _gemv.supported(x, w, out):
        return _gemv.gemv(x, w, out)
    import cupy as cp
    if out is None:
        out = cp.empty((x.shape[0], w.shape[0]), dtype=cp.float32)
    if x.shape[0]:
        matmul(x, w, out, trans_b=True)
    return out


def quantized_linear(x, w: QuantizedWeight, out=None):
    """x [T, K] @ dequantize(W)^T -> fp32 [T, N] (engine/ops/quantization.py).

    CPU: the dequantized float32 matrix, made once and kept (the CPU backend computes in float32; the
    packed form is what the GPU reads), or your `quant_gemv` function for int4 weights while one is
    plugged in. GPU: decode rows (1..16) go to the dequantizing GEMV, which reads each packed weight once
    and unpacks it in registers; more rows (prefill, large batches) dequantize W into a bf16 scratch
    matrix and run cuBLAS on it."""
    plug = OVERRIDES.get("quant_gemv") if w.bits == 4 else None   # your stage (engine/plugins.py), if active
    if not is_device_array(w.qweight):
        if plug is not None:
            return run_function(plug, (x.shape[0], w.shape[0]), False, x, x, w)
        if w.dense is None:
            w.dense = dequantize_ref(w)
        return linear_ref(x, w.dense)
    if plug is not None and plug.fn is not None:
        raise PluginError("a NumPy function override of 'quant_gemv' runs on the NumPy backend only; on the GPU "
                          "pass cuda_source= and kernel=")
    if _quant_gemv.supported(x, w, out):
        return _quant_gemv.quant_gemv(x, w, out)
    import cupy as cp
    if out is None:
        out = cp.empty((x.shape[0], w.shape[0]), dtype=cp.float32)
    if x.shape[0]:
        matmul(x, _quant_gemv.dequantize_bf16(w), out, trans_b=True)
    return out
