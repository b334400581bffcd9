#!/usr/bin/env bash
# Quantized weights on the H200 (chapter 18), random weights of the Llama-3.2-1B shape (no model files):
# the quantization GPU tests, then `engine.bench --scenario quantized` (batch-1 decode through LLM and a
# 2,048-token prefill, bf16 against int8 and int4 quantized on load, in the same run). Results land in $OUT.
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pytest -q -n 0 -p no:cacheprovider -m gpu tests/test_quant_gemv.py tests/test_gpu_quantization.py \
  tests/test_kernels_compile.py 2>&1 | tee "$OUT/pytest_gpu_quant.txt" | tail -8
python3 -m engine.bench --preset llama-3.2-1b --backend cupy --scenario quantized --prompt-len 128 --new-tokens 256 \
  --prefill-len 2048 2>&1 | grep '^{' | tee "$OUT/quantized.jsonl" | cut -c150-700
