#!/usr/bin/env bash
# The GPU check of the package layout and the runtime split (run from the repository root on the GPU
# machine, the engine's previous tree unpacked in .base/): stage "tests" converts the default model,
# writes the random-weight Llama-3.2-1B, runs every GPU test and compares the tokens of one workload
# under both trees; stage "bench" runs `engine.bench --scenario decode` and `--scenario serve` under
# both trees in the same call. Results land in $OUT.
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 ENGINE_MODEL_DIR=/root/smollm2 M=/root/l1b
NEW=$PWD; OLD=$PWD/.base
case ${1:-tests} in
  tests)
    python3 -m engine.gguf_convert /root/gg/model.gguf /root/smollm2 2>&1 | tail -2
    python3 -m engine.random_model llama-3.2-1b $M 2>&1 | tail -1
    python3 -m engine.env 2>&1 | tee "$OUT/env.txt" | tail -4
    python3 -m pytest -q -n 0 -p no:cacheprovider -m gpu tests/ 2>&1 | tee "$OUT/pytest_gpu.txt" | tail -15
    for tree in NEW OLD; do
      PYTHONPATH=${!tree} python3 notes/measurements/same_tokens.py $M | tee -a "$OUT/same_tokens.jsonl"
    done ;;
  rerun)   # a second sample of the serving figures, the trees in the other order
    [ -f $M/model.safetensors ] || python3 -m engine.random_model llama-3.2-1b $M 2>&1 | tail -1
    python3 -m pytest -q -n 0 -p no:cacheprovider tests/test_gpu_ch12_engine_loop.py 2>&1 | tee "$OUT/pytest_engine_loop.txt" | tail -3
    for tree in OLD NEW; do
      (cd ${!tree} && PYTHONPATH=$PWD python3 -m engine.bench --model $M --backend cupy --scenario decode serve \
         --requests 256 --kv-cache-mib 8192 2>&1 | grep '^{' | sed "s/^{/{\"tree\": \"$tree\", /" | tee -a "$OUT/rerun.jsonl")
    done ;;
  bench)
    for tree in NEW OLD; do
      (cd ${!tree} && PYTHONPATH=$PWD python3 -m engine.bench --model $M --backend cupy --scenario decode \
         --prompt-len 128 --new-tokens 256 2>&1 | grep '^{' | sed "s/^{/{\"tree\": \"$tree\", /" | tee -a "$OUT/decode.jsonl")
    done
    for tree in NEW OLD; do
      (cd ${!tree} && PYTHONPATH=$PWD python3 -m engine.bench --model $M --backend cupy --scenario serve \
         --requests 256 --kv-cache-mib 8192 2>&1 | grep '^{' | sed "s/^{/{\"tree\": \"$tree\", /" | tee -a "$OUT/serve.jsonl")
    done ;;
esac
