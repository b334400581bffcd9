"""sample_rows alone on the H200: R = 256 rows of V = 128,256 logits, every row with the same knobs, for
the kernel in kernels_cu/sampling.cu and (argv[1], optional) another version of it; CUDA events over 20
launches after a warm-up."""
import sys
from pathlib import Path

import cupy as cp
import numpy as np

from engine.backend import compile_source

R, V = 256, 128256
rng = np.random.default_rng(0)
logits = cp.asarray((rng.standard_normal((R, V)) * 3).astype(np.float32))
u = cp.asarray(rng.random(R).astype(np.float32))
out = cp.empty(R, cp.int32)
sources = {"engine": Path("kernels_cu/sampling.cu").read_text()}
if len(sys.argv) > 1:
    sources["other"] = Path(sys.argv[1]).read_text()
for knobs in ((0.8, 50, 0.95), (1.0, 50, 1.0), (1.0, 0, 0.95), (1.0, 0, 1.0)):
    t, k, p = knobs
    args = (cp.full(R, t, cp.float32), cp.full(R, k, cp.int32), cp.full(R, p, cp.float32), u)
    for name, text in sources.items():
        kernel = compile_source(text, f"<{name}>", (("THREADS", 1024),)).get_function("sample_rows")
        kernel((R,), (1024,), (logits, *args, out, np.int32(V)))
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        for _ in range(20):
            kernel((R,), (1024,), (logits, *args, out, np.int32(V)))
        stop.record()
        stop.synchronize()
        ms = cp.cuda.get_elapsed_time(start, stop) / 20
        print(f"T={t} top_k={k} top_p={p}: {name:6} {ms:.3f} ms per 256 rows  tokens {out[:4].get().tolist()}")
