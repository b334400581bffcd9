"""Launch-constant sweep of the tensor-core quantized GEMV (kernels_cu/quant_gemv.cu) on the Llama-3.2-1B
projections at 1 and 16 rows: k-blocks in flight per lane (QMMA_UNROLL), the register budget
(QMMA_MIN_BLOCKS resident blocks of QMMA_WARPS warps) and the steps a warp keeps (QMMA_STEPS), timed as
`python -m engine.kernel_bench --only quant_gemv` times (a CUDA graph over copies of the weight)."""
import itertools
import json
import sys

from engine.bench.kernels import Bench
from engine.ops import quant_gemv as qg
from engine.ops.quantization import QuantizedWeight, quantize_ref

bench = Bench(quick=False)
cp = bench.cp
shapes = [("qkv", 3072, 2048), ("o", 2048, 2048), ("gate_up", 16384, 2048), ("down", 2048, 8192)]
weights = {}
for name, N, K in shapes:
    _, w_h = bench.bf16(N, K, scale=K ** -0.5)
    for bits in (4, 8):
        q = quantize_ref(w_h, bits, 128)
        weights[name, bits] = QuantizedWeight(cp.asarray(q.qweight), cp.asarray(q.scales), cp.asarray(q.zeros),
                                              bits, 128, q.shape)
xs = {T: bench.bf16(T, 8192)[0] for T in (1, 16)}
rows = []
for unroll, min_blocks, steps in itertools.product((1, 2, 4), (1, 2), (1, 2)):
    qg.QMMA_UNROLL, qg.QMMA_MIN_BLOCKS, qg.QMMA_STEPS = unroll, min_blocks, steps
    total = {}
    for (name, _, K), bits, T in itertools.product(shapes, (4, 8), (1, 16)):
        qw = weights[name, bits]
        x = xs[T][:, :K]
        copies = [qw] + [QuantizedWeight(qw.qweight.copy(), qw.scales.copy(), qw.zeros.copy(), bits, 128, qw.shape)
                         for _ in range(min(511, -(-bench.GEMV_FLUSH_BYTES // qw.nbytes) - 1))]
        out = qg.quant_gemv(x, qw)
        ms = bench.graph_time_ms([lambda c=c, x=x, out=out: qg.quant_gemv(x, c, out) for c in copies], -(-8 // len(copies)))
        total[bits, T] = total.get((bits, T), 0) + ms * 1e3
        rows.append({"unroll": unroll, "min_blocks": min_blocks, "steps": steps, "proj": name, "bits": bits, "T": T,
                     "us": round(ms * 1e3, 2), "pct_copy": round(100 * qw.nbytes / (ms * 1e-3) / 1e9 / bench.copy_gbps, 1)})
        del copies
    print(f"unroll {unroll} min_blocks {min_blocks} steps {steps}: " +
          "  ".join(f"int{b} T={t}: {us:5.1f} us" for (b, t), us in sorted(total.items())), flush=True)
json.dump(rows, open(sys.argv[1] if len(sys.argv) > 1 else "quant_sweep.json", "w"), indent=0)
