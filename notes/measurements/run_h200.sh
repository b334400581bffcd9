#!/usr/bin/env bash
# The whole GPU check in one command (run on the GPU machine from the repository root):
# environment, every kernel against its reference with timings, the model on the GPU vs NumPy
# and transformers, the pytest GPU tests, and the benchmarks. Results land in $OUT (default ./gpu-out).
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
STAGES=${STAGES:-"env kernels pytest model1b parity prefill decode"}
for s in $STAGES; do
  echo "=== $s"
  case $s in
    env) python3 -m engine.env 2>&1 | tee "$OUT/env.txt" ;;
    kernels) python3 -m engine.kernel_bench --json "$OUT/kernels.jsonl" 2>&1 | tee "$OUT/kernels.txt" ;;
    pytest) python3 -m pytest -q -x tests/test_gpu_model.py 2>&1 | tail -15 | tee "$OUT/pytest_gpu.txt" ;;
    model1b) [ -f /tmp/l1b/model.safetensors ] || python3 -m engine.random_model llama-3.2-1b /tmp/l1b ;;
    parity) python3 -m engine.bench --model /tmp/l1b --backend cupy --scenario parity --parity-len 64 --hf 2>&1 | grep '^{' | tee -a "$OUT/bench.jsonl" ;;
    prefill) python3 -m engine.bench --model /tmp/l1b --backend cupy --scenario prefill --prompt-len 2048 --hf 2>&1 | grep '^{' | tee -a "$OUT/bench.jsonl" ;;
    decode) python3 -m engine.bench --model /tmp/l1b --backend cupy --scenario decode --prompt-len 128 --new-tokens 256 --hf 2>&1 | grep '^{' | tee -a "$OUT/bench.jsonl" ;;
    serve) python3 -m engine.bench --model /tmp/l1b --backend cupy --scenario serve --requests 256 --hf 2>&1 | grep '^{' | tee -a "$OUT/serve.jsonl" ;;
  esac
done
