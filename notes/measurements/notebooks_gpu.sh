#!/usr/bin/env bash
# The chapters that changed in the second edition, run on the GPU machine as scripts (no Jupyter there):
# `stash` keeps the first half of the default model, `run` joins it, converts it and runs the notebooks.
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
case ${1:-run} in
  stash) mkdir -p /root/gg && cp .gg1/part_aa /root/gg/ ;;
  run)
    cat /root/gg/part_aa .gg2/part_ab > /root/gg/model.gguf
    pip install -q --no-deps --target /tmp/site .whl/gguf-*.whl 2>&1 | tail -1
    export PYTHONPATH=/tmp/site:$PWD ENGINE_MODEL_DIR=/root/smollm2
    python3 -m engine.gguf_convert /root/gg/model.gguf /root/smollm2 2>&1 | tail -1
    python3 notes/measurements/run_notebooks_gpu.py chapters/15_prefix_caching.ipynb \
      chapters/solutions/15_prefix_caching_solutions.ipynb chapters/13_flash_attention.ipynb \
      chapters/11_paged_attention.ipynb chapters/14_performance.ipynb chapters/01_safetensors.ipynb \
      | tee "$OUT/notebooks_gpu.jsonl" | cut -c1-600 ;;
esac
