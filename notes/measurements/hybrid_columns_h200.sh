#!/usr/bin/env bash
# The delta kernels with their value columns split over blocks: the GPU tests of the kernels and the model,
# the chapter's GPU cell recorded, the Qwen3.5 prefill and decode bench again, a per-op profile of an 8k prefill.
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
pip install -q --no-deps .wheels/gguf-*.whl 2>&1 | tail -1
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/gpu.txt"
timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider --maxfail=3 -o addopts="" \
  tests/test_gpu_appendix_linear_attention.py tests/test_gpu_appendix_linear_attention_model.py 2>&1 \
  | tee "$OUT/pytest_gpu.txt" | grep -E "FAILED|Error|passed|failed" | head -20
python3 -m engine.random_model qwen3.5-0.8b /root/q35 --seed 1 >/dev/null 2>&1
ENGINE_MODEL_DIR=/root/q35 timeout 50 python3 -m engine.exercises.record_cells --only appendix_linear_attention \
  --out "$OUT/gpu_cells.json" 2>&1 | tail -3
bench() { timeout "$1" python3 -m engine.bench "${@:2}" 2>&1 | grep '^{' ; }
{
  bench 40 --model /root/q35 --backend cupy --scenario prefill --prompt-len 8192
  bench 45 --model /root/q35 --backend cupy --scenario decode --prompt-len 128 --new-tokens 256
  } > "$OUT/bench_qwen35.jsonl"
python3 - "$OUT/bench_qwen35.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    d = json.loads(line)
    if d["scenario"] not in ("setup", "load"):
        print({k: d.get(k) for k in ("scenario", "ms", "tok_per_s", "decode_tok_per_s", "floor_tok_per_s",
                                      "output_tok_per_s", "pct_of_floor") if k in d})
PY
# then, if time is left: where an 8k prefill goes
timeout 40 python3 notes/measurements/hybrid_prefill_profile.py /root/q35 8192 2>&1 | tee "$OUT/prefill_profile.txt"
