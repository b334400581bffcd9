#!/usr/bin/env bash
# Prefix caching on the H200 (run from the repository root on the GPU machine). Two calls, as the
# default model travels in two halves (.gg1/, .gg2/; the gguf wheel in .whl/):
#   stash   copies the first half to /root/gg/
#   run     joins the halves, converts the default model, writes the random-weight Llama-3.2-1B, runs
#           every GPU test, then `engine.bench` shared-prefix, chat-turns and serve (with the cache on
#           and off in the same run, in the order off on on off off on so that a drift of the machine
#           over the run falls on both alike; 8 GiB pool). Results land in $OUT.
set -uo pipefail
. notes/measurements/default_model.sh
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 M=/root/l1b
case ${1:-run} in
  stash)
    stash_first_half ;;
  run)
    join_and_convert
    python3 -m engine.random_model llama-3.2-1b $M 2>&1 | tail -1
    python3 -m engine.env 2>&1 | tee "$OUT/env.txt" | tail -3
    python3 -m pytest -q -n 0 -p no:cacheprovider -m gpu tests/ 2>&1 | tee "$OUT/pytest_gpu.txt" | tail -12
    python3 -m engine.bench --model $M --backend cupy --scenario shared-prefix chat-turns --kv-cache-mib 8192 \
      2>&1 | grep '^{' | tee "$OUT/prefix.jsonl" | cut -c1-400
    python3 -m engine.bench --model $M --backend cupy --scenario serve --requests 256 --kv-cache-mib 8192 \
      --serve-modes continuous+paged+nocache continuous+paged continuous+paged continuous+paged+nocache \
                    continuous+paged+nocache continuous+paged \
      2>&1 | grep '^{' | tee "$OUT/serve.jsonl" | cut -c1-300 ;;
esac
