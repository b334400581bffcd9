#!/usr/bin/env bash
# Structured outputs, logits processing and logprobs on the H200 (run from the repository root on the GPU
# machine). The default model travels in two halves (.gg1/, .gg2/; the gguf wheel in .whl/):
#   stash   copies the first half to /root/gg/
#   run     joins the halves, converts the default model, runs every GPU test, then
#           `engine.bench --scenario structured` (256 chat requests for a JSON record: free, free with
#           the host scheduling between steps, constrained to a JSON schema, and free again with the
#           constrained answers' lengths, interleaved)
#   bench   that bench alone
# Results land in $OUT.
set -uo pipefail
. notes/measurements/default_model.sh
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
case ${1:-run} in
  stash)
    stash_first_half ;;
  bench)   # the bench alone (the default model converted by an earlier `run` on this machine, or again)
    [ -d /root/smollm2 ] || join_and_convert
    python3 -m engine.bench --model /root/smollm2 --backend cupy --scenario structured --requests 256 \
      --new-tokens 128 2>&1 | grep '^{' | tee "$OUT/structured.jsonl" | cut -c150-600 ;;
  run)
    join_and_convert
    python3 -m pytest -q -n 0 -p no:cacheprovider -m gpu tests/ 2>&1 | tee "$OUT/pytest_gpu.txt" | tail -6
    python3 -m engine.bench --model /root/smollm2 --backend cupy --scenario structured --requests 256 \
      --new-tokens 128 2>&1 | grep '^{' | tee "$OUT/structured.jsonl" | cut -c150-600 ;;
esac
