#!/usr/bin/env bash
# The whole GPU check, stage by stage (run on the GPU machine from the repository root):
# environment, every GPU test (kernels against their references, the model against NumPy, serving
# paths, plug-ins, exercises), compute-sanitizer, the recorded GPU-track run (the checkers and every
# GPU cell of the chapters), and the benchmarks.
# Results land in $OUT (default ./gpu-out). Pick stages with STAGES="pytest sanitize ...". A machine
# without network needs ENGINE_MODEL_DIR set to a converted default model (python -m engine.gguf_convert).
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
M=${MODEL_1B:-/tmp/l1b}
S="compute-sanitizer --error-exitcode 7 --print-limit 20"
B="python3 -m engine.bench --model $M --backend cupy"
STAGES=${STAGES:-"env pytest sanitize record model1b prefill decode serve oversub http long itl profile"}
for s in $STAGES; do
  echo "=== $s"
  case $s in
    env) python3 -m engine.env 2>&1 | tee "$OUT/env.txt" ;;
    pytest) python3 -m pytest -q -m gpu tests/ 2>&1 | tail -20 | tee "$OUT/pytest_gpu.txt" ;;
    sanitize) $S --tool memcheck python3 -m engine.kernel_bench --check-only --quick 2>&1 | tail -3 | tee "$OUT/memcheck.txt"
              $S --tool racecheck python3 -m engine.kernel_bench --check-only --quick --only rmsnorm argmax sampling paged ladder 2>&1 | tail -3 | tee "$OUT/racecheck.txt"
              $S --tool racecheck python3 -m pytest -q -m gpu tests/test_ch13_flash_attention.py -k "kernel and not model" 2>&1 | tail -3 | tee -a "$OUT/racecheck.txt" ;;
    record) python3 -m engine.exercises.record_gpu --out "$OUT/gpu_run.json" 2>&1 | tail -3    # -> engine/exercises/recorded/
            python3 -m engine.exercises.record_cells --out "$OUT/gpu_cells.json" 2>&1 | tee "$OUT/record_cells.txt" | tail -40 ;;
    model1b) [ -f "$M/model.safetensors" ] || python3 -m engine.random_model llama-3.2-1b "$M" ;;
    prefill) $B --scenario parity prefill decode --prompt-len 2048 --new-tokens 256 --hf 2>&1 | grep '^{' | tee -a "$OUT/bench.jsonl" ;;
    decode) $B --scenario decode --prompt-len 128 --new-tokens 256 2>&1 | grep '^{' | tee -a "$OUT/bench.jsonl" ;;
    serve) $B --scenario serve --requests 256 --kv-cache-mib 8192 2>&1 | grep '^{' | tee -a "$OUT/serve.jsonl" ;;
    oversub) $B --scenario serve-oversubscribed --kv-cache-mib 8192 2>&1 | grep '^{' | tee -a "$OUT/serve.jsonl" ;;
    http) $B --scenario serve-http --requests 256 --kv-cache-mib 8192 2>&1 | grep '^{' | tee -a "$OUT/serve.jsonl" ;;
    long) $B --scenario long-prefill --hf 2>&1 | grep '^{' | tee -a "$OUT/long.jsonl" ;;
    itl) $B --scenario chunked-itl --max-batch-tokens 2048 2>&1 | grep '^{' | tee -a "$OUT/long.jsonl" ;;
    profile) $B --profile --profile-batches 1 64 256 --profile-json "$OUT/14_decode_profile_h200.json" 2>&1 | tail -20 ;;
  esac
done
