"""Nsight Compute target: the int4 and int8 GEMVs (tensor-core path) and the bf16 GEMV at one row, on the
Llama-3.2-1B gate_up and o shapes, each launched a few times (profile the last launch of each kernel).

    ncu --section SpeedOfLight --section WarpStateStats --section LaunchStats --section Occupancy \
        -k regex:"quant_mma|gemv_bf16" -c 6 python3 notes/measurements/quant_ncu.py
"""
import cupy as cp
import numpy as np

from engine.backend import f32_to_bf16
from engine.ops.gemv import gemv
from engine.ops.quant_gemv import quant_gemv
from engine.ops.quantization import QuantizedWeight, quantize_ref

rng = np.random.default_rng(0)
for N, K in ((16384, 2048), (2048, 2048)):
    w = (rng.standard_normal((N, K)) * K ** -0.5).astype(np.float32)
    x = cp.asarray(f32_to_bf16(rng.standard_normal((1, K)).astype(np.float32)))
    gemv(x, cp.asarray(f32_to_bf16(w)))
    for bits in (4, 8):
        q = quantize_ref(w, bits, 128)
        quant_gemv(x, QuantizedWeight(cp.asarray(q.qweight), cp.asarray(q.scales), cp.asarray(q.zeros), bits, 128, q.shape))
cp.cuda.Device().synchronize()
