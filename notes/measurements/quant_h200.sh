#!/usr/bin/env bash
# Quantized weights on the H200 (chapter 18), random weights of the Llama-3.2-1B shape (no model files):
# the quantization GPU tests, the kernel table (quant_gemv beside the bf16 GEMV), `engine.bench --scenario
# quantized` (batch-1 decode through LLM and a 2,048-token prefill, bf16 against int8 and int4 quantized on
# load, in the same run) and the 256-request serving workload in bf16, int8 and int4. Results land in $OUT.
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pytest -q -n 0 -p no:cacheprovider -m gpu tests/test_quant_gemv.py tests/test_gpu_quantization.py \
  tests/test_kernels_compile.py tests/test_ch03_11_plugins.py 2>&1 | tee "$OUT/pytest_gpu_quant.txt" | tail -8
python3 -m engine.kernel_bench --only gemv quant_gemv 2>&1 | tee "$OUT/kernel_bench_quant_gemv.txt" | tail -30
python3 -m engine.bench --preset llama-3.2-1b --backend cupy --scenario quantized --prompt-len 128 --new-tokens 256 \
  --prefill-len 2048 2>&1 | grep '^{' | tee "$OUT/quantized.jsonl" | cut -c150-700
python3 -m engine.bench --preset llama-3.2-1b --backend cupy --scenario serve --requests 256 \
  --serve-modes continuous+paged continuous+paged+int4 continuous+paged+int8 2>&1 | grep '^{' \
  | tee "$OUT/serve_quantized.jsonl" | cut -c150-600
# memcheck and racecheck on the quantized kernels (both paths: the tensor-core one and the CUDA-core one)
if command -v compute-sanitizer >/dev/null; then
  for tool in memcheck racecheck; do
    compute-sanitizer --tool $tool --error-exitcode 9 python3 -m pytest -q -n 0 -p no:cacheprovider -m gpu \
      tests/test_quant_gemv.py -k "unaligned_and_strided or plugged" 2>&1 | tail -3 | tee "$OUT/sanitizer_$tool.txt"
  done
fi
