#!/usr/bin/env bash
# Chapter 18 on the H200 with the real default model (call 2 of notes/measurements/default_model.sh's two):
# the CUDA exercise's worked solution through its checker and inside the model, the chapter's GPU cell
# recorded (engine/exercises/recorded/gpu_cells.json), the GPU track's recorded run (gpu_run.json), the
# kernel table and the quantized bench. Results land in $OUT.
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
. notes/measurements/default_model.sh
join_and_convert
export PYTHONPATH=$PWD:/tmp/site
python3 -m pytest -q -n 0 -p no:cacheprovider -m gpu tests/test_ch18_exercise.py tests/test_gpu_quantization.py \
  tests/test_quant_gemv.py 2>&1 | tail -3 | tee "$OUT/pytest_ch18_gpu.txt"
python3 -c "from engine.exercises import ch18; ch18.check_quant_gemv_kernel('kernels_cu/exercises/solutions/quant_gemv.cu')" \
  2>&1 | tee "$OUT/ch18_gpu_check.txt"
cp engine/exercises/recorded/gpu_cells.json "$OUT/gpu_cells.json"
timeout 300 python3 -m engine.exercises.record_cells --only 18_quantization --out "$OUT/gpu_cells.json" 2>&1 | tail -5
timeout 240 python3 -m engine.exercises.record_gpu --out "$OUT/gpu_run.json" 2>&1 | tail -3
python3 -m engine.kernel_bench --only quant_gemv 2>&1 | grep llama | tee "$OUT/kernel_bench_quant_gemv.txt"
python3 -m engine.bench --preset llama-3.2-1b --backend cupy --scenario quantized --prompt-len 128 --new-tokens 256 \
  --prefill-len 2048 2>&1 | grep '^{' | tee "$OUT/quantized.jsonl" | cut -c150-520
