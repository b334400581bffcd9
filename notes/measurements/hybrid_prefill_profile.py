"""Where one Qwen3.5 prefill pass goes on the GPU: each op of the hybrid forward pass, synchronised and
timed (host clock around a device sync; at thousands of tokens per op the sync costs nothing that
matters). Usage: python notes/measurements/hybrid_prefill_profile.py MODEL_DIR [TOKENS]"""
import json
import sys
import time
from collections import defaultdict

import cupy as cp
import numpy as np

import engine.model.hybrid_forward as hf
from engine.model.forward_pass import load_model

TIMED = ("linear", "linear_attention_gpu", "gated_attention", "gates_gpu", "causal_conv1d_gpu", "gated_delta_gpu",
         "gated_rmsnorm_gpu", "rope_qk_norm_partial", "attention_output_gate_gpu", "swiglu", "add_rmsnorm",
         "rmsnorm", "embedding")
times: dict[str, float] = defaultdict(float)
calls: dict[str, int] = defaultdict(int)


def timed(name, fn):
    def wrapper(*args, **kwargs):
        cp.cuda.Device().synchronize()
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        cp.cuda.Device().synchronize()
        times[name] += time.perf_counter() - t0
        calls[name] += 1
        return out
    return wrapper


model = load_model(sys.argv[1], backend="cupy")
T = int(sys.argv[2]) if len(sys.argv) > 2 else 8192
ids = np.random.default_rng(0).integers(3, model.config.vocab_size, T)
model.logits(ids[:256])                                       # compile the kernels, warm the allocator
cp.cuda.Device().synchronize()
t0 = time.perf_counter()
model.logits(ids)
cp.cuda.Device().synchronize()
total = time.perf_counter() - t0
for name in TIMED:
    setattr(hf, name, timed(name, getattr(hf, name)))
model.logits(ids)
attention = times["gated_attention"] - sum(times[n] for n in ("rope_qk_norm_partial", "attention_output_gate_gpu"))
print(f"Qwen3.5 prefill of {T} tokens on {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}: "
      f"{total * 1e3:.1f} ms untimed")
rows = {n: (times[n] * 1e3, calls[n]) for n in TIMED if calls[n]}
rows["(attention inside gated_attention, with the linear layers')"] = (attention * 1e3, 0)
for n, (ms, c) in rows.items():
    print(f"  {n:<58} {ms:9.2f} ms  {c:4d} calls")
print(json.dumps({"tokens": T, "total_ms": total * 1e3, "ops_ms": {n: ms for n, (ms, _) in rows.items()}}))
