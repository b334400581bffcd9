#!/usr/bin/env bash
# Qwen3.5 (hybrid Gated DeltaNet) and Qwen3-MoE on the H200: the GPU tests against the NumPy references
# (kernels, the whole models, every serving path), then python -m engine.bench on random weights of the
# real shapes: Qwen3.5-0.8B prefill of 8,192 tokens, batch-1 decode and the 256-request workload; the
# 4-layer Qwen3-30B-A3B slice's batch-1 decode (floor: its active parameters) and 64 concurrent requests.
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
python3 -m pytest -q -m gpu -p no:cacheprovider -x tests/test_gpu_appendix_linear_attention_model.py \
  tests/test_gpu_appendix_linear_attention.py tests/test_gpu_appendix_moe.py tests/test_gpu_appendix_qwen.py \
  tests/test_gpu_model.py tests/test_ch14_graph_runner.py 2>&1 | tee "$OUT/pytest_gpu.txt" | tail -6
python3 -m engine.random_model qwen3.5-0.8b /root/q35 --seed 1 >/dev/null
bench() { python3 -m engine.bench "$@" 2>&1 | grep '^{' ; }
{
  bench --model /root/q35 --backend cupy --scenario prefill --prompt-len 8192
  bench --model /root/q35 --backend cupy --scenario decode --prompt-len 128 --new-tokens 256
  bench --model /root/q35 --backend cupy --scenario serve --requests 256 --serve-modes continuous+paged
} | tee "$OUT/bench_qwen35.jsonl" | cut -c1-400
{
  bench --preset qwen3-30b-a3b-4l --backend cupy --scenario decode serve --requests 64 --serve-modes continuous+paged
} | tee "$OUT/bench_moe.jsonl" | cut -c1-400
