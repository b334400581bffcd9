#!/usr/bin/env bash
# Qwen3.5 (hybrid Gated DeltaNet) and Qwen3-MoE on a GPU: the GPU tests against the NumPy references
# (kernels, the whole models, every serving path, and the dense models' GPU paths the shared RoPE kernel
# and the decode graphs run), then python -m engine.bench
# on random weights of the real shapes: Qwen3.5-0.8B prefill of 8,192 tokens, batch-1 decode and the
# 256-request workload; the 4-layer Qwen3-30B-A3B slice's batch-1 decode (floor: its active parameters)
# and 64 concurrent requests. Each step is time-bounded so that a slow one leaves the others' output.
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
timeout 270 python3 -m pytest -q -m gpu -p no:cacheprovider --maxfail=8 -o addopts="" \
  tests/test_gpu_appendix_linear_attention_model.py tests/test_gpu_appendix_linear_attention.py \
  tests/test_gpu_appendix_moe.py tests/test_gpu_appendix_qwen.py tests/test_gpu_model.py \
  tests/test_ch14_graph_runner.py 2>&1 | tee "$OUT/pytest_gpu.txt" | grep -E "FAILED|Error|passed|failed" | head -30
python3 -m engine.random_model qwen3.5-0.8b /root/q35 --seed 1 >/dev/null
bench() { timeout "$1" python3 -m engine.bench "${@:2}" 2>&1 | grep '^{' ; }
{
  bench 60 --model /root/q35 --backend cupy --scenario prefill --prompt-len 8192
  bench 60 --model /root/q35 --backend cupy --scenario decode --prompt-len 128 --new-tokens 256
  bench 100 --model /root/q35 --backend cupy --scenario serve --requests 256 --serve-modes continuous+paged
} | tee "$OUT/bench_qwen35.jsonl" | cut -c1-300
bench 120 --preset qwen3-30b-a3b-4l --backend cupy --scenario decode serve --requests 64 --serve-modes continuous+paged \
  | tee "$OUT/bench_moe.jsonl" | cut -c1-300
# where an 8k Qwen3.5 prefill goes, op by op
timeout 60 python3 notes/measurements/hybrid_prefill_profile.py /root/q35 8192 2>&1 | tee "$OUT/prefill_profile.txt"
