"""Where one Qwen3.5 prefill pass goes: every op of the hybrid forward pass (engine/model/hybrid_forward.py),
timed by chapter 14's OpTimer (CUDA events, the launches queued behind a sleep kernel so that the events
time kernels, not the host). Nested ops are listed on their own too: linear_attention_gpu (linear_attention on the CPU) holds the conv,
the gates, the delta rule, the gated norm and its two projections; gated_attention its attention.
Usage: python notes/measurements/hybrid_prefill_profile.py MODEL_DIR [TOKENS] [BACKEND]"""
import json
import sys
import time

import numpy as np

import engine.model.hybrid_forward as hybrid_module
from engine.bench.step_profile import OpTimer, _sleep
from engine.model.forward_pass import ForwardBatch, load_model

HYBRID_OPS = ("embedding", "rmsnorm", "add_rmsnorm", "linear", "swiglu", "linear_attention", "linear_attention_gpu", "gates_gpu",
              "causal_conv1d_gpu", "gated_delta_gpu", "gated_rmsnorm_gpu", "gated_attention",
              "rope_qk_norm_partial", "attention_output_gate_gpu")

T = int(sys.argv[2]) if len(sys.argv) > 2 else 8192
model = load_model(sys.argv[1], backend=sys.argv[3] if len(sys.argv) > 3 else "cupy", max_context=T)
ids = np.random.default_rng(0).integers(3, model.config.vocab_size, T).astype(np.int32)
batch = ForwardBatch.single(ids, logits_rows=[T - 1])
sync = model.backend.synchronize
model.forward(ForwardBatch.single(ids[:256]))                 # compile the kernels, warm the allocator
sync()
t0 = time.perf_counter()
model.forward(batch)
sync()
wall_ms = (time.perf_counter() - t0) * 1e3
timer = OpTimer(model)
if model.backend.is_gpu:
    _sleep(50)
with timer.timed_ops(hybrid_module, HYBRID_OPS):
    model.forward(batch)
sync()
rows, _ = timer.table()
print(f"Qwen3.5 prefill of {T} tokens ({model.backend.name}): {wall_ms:.1f} ms wall, untimed")
for r in sorted(rows, key=lambda r: -r["ms"]):
    print(f"  {r['kernel']:<28} {r['calls']:4d} calls {r['ms']:10.2f} ms")
print(json.dumps({"tokens": T, "wall_ms": wall_ms, "ops": rows}))
