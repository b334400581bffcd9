#!/usr/bin/env bash
# The sampling kernel on the H200: its check and timing (kernel_bench --only sampling), then the 256-request
# serving workload greedy and sampled (temperature 0.8, top-k 50, top-p 0.95) on the Llama-3.2-1B shape in
# the same run; with OLD_SAMPLING=path, the sampled workload again with that version of sampling.cu.
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m engine.kernel_bench --only sampling 2>&1 | tee "$OUT/kernel_bench_sampling.txt" | tail -8
python3 -m engine.bench --preset llama-3.2-1b --backend cupy --scenario serve --requests 256 \
  --serve-modes continuous+paged continuous+paged+sampled 2>&1 | grep '^{' | tee "$OUT/serve_sampled.jsonl" | cut -c150-420
if [ -n "${OLD_SAMPLING:-}" ]; then
  cp kernels_cu/sampling.cu /tmp/sampling_new.cu && cp "$OLD_SAMPLING" kernels_cu/sampling.cu
  python3 -m engine.bench --preset llama-3.2-1b --backend cupy --scenario serve --requests 256 \
    --serve-modes continuous+paged+sampled 2>&1 | grep '^{' | tee "$OUT/serve_sampled_old_kernel.jsonl" | cut -c150-420
  cp /tmp/sampling_new.cu kernels_cu/sampling.cu
fi
