"""python notes/measurements/prefill_step_profile.py MODEL_DIR

Per-op GPU time of a big prefill step (8 prompts x 1,024 tokens = 8,192 tokens), fresh and as a chunk
after a cached prefix, with the wall time of the eager forward pass."""
import sys
import time

import cupy as cp
import numpy as np

from engine.kv_cache import KVCache
from engine.model import ForwardBatch, load_model
from engine.step_profile import OpTimer, _sleep

model = load_model(sys.argv[1], "cupy", max_context=2056)
cfg = model.config
cache = KVCache(cfg, 8 * 128, 16, model.backend)
S, L = 8, 1024
tables = np.arange(S * 128, dtype=np.int32).reshape(S, 128)
def batch(start):
    pos = np.tile(np.arange(start, start + L, dtype=np.int32), S)
    row = np.repeat(np.arange(S), L)
    slots = (tables[row, pos // 16] * 16 + pos % 16).astype(np.int32)
    cu = np.arange(0, S * L + 1, L, dtype=np.int32)
    ids = np.random.default_rng(start).integers(3, cfg.vocab_size, S * L).astype(np.int32)
    return ForwardBatch(ids, pos, cu, tables, slots, logits_rows=(cu[1:] - 1).astype(np.int32))
flops = 2 * cfg.num_parameters() * S * L
for name, fb in (("fresh 8 x 1024", batch(0)), ("chunk 8 x 1024 after 1024 cached", batch(1024))):
    for _ in range(2):
        model.forward(fb, cache)
    cp.cuda.Device().synchronize()
    t = time.perf_counter()
    for _ in range(5):
        model.forward(fb, cache)
    cp.cuda.Device().synchronize()
    wall = (time.perf_counter() - t) / 5
    t = time.perf_counter()
    model.forward(fb, cache)
    host = time.perf_counter() - t
    cp.cuda.Device().synchronize()
    timer = OpTimer(model, 0)
    _sleep(50)
    with timer.timed_ops():
        model.forward(fb, cache)
    cp.cuda.Device().synchronize()
    rows, total = timer.table()
    print(f"== {name}: wall {wall*1e3:.2f} ms/step (launch alone {host*1e3:.2f} ms), ops back to back {total:.2f} ms, "
          f"{flops/wall/1e12:.0f} TFLOP/s of weights")
    for r in sorted(rows, key=lambda r: -r["ms"]):
        print(f"   {r['kernel']:<18} {r['calls']:4d} {r['ms']:8.3f} ms  {r['bytes']/r['ms']/1e6 if r['ms'] else 0:8.0f} GB/s")
