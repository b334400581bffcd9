#!/usr/bin/env bash
# Speculative decoding on the H200 (run from the repository root on the GPU machine). The default model
# travels in two halves (.gg1/, .gg2/; the gguf wheel in .whl/):
#   stash   copies the first half to /root/gg/
#   run     joins the halves, converts the default model, runs every GPU test, then `engine.bench
#           --scenario spec-decode` on it (batch 1, greedy, plain, n-gram and a draft model with
#           k = 2, 4, 8 in the same run; the draft is the model itself: every guess right, at full cost)
#   l1b     the random-weight Llama-3.2-1B: spec-decode with a 2-layer draft of its vocabulary, and the
#           256-request serve workload with and without speculation (alternating, so that a drift of
#           the machine falls on both alike)
#   serve   that serve comparison alone, eight runs
# Results land in $OUT.
set -uo pipefail
. notes/measurements/default_model.sh
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 M=/root/l1b
case ${1:-run} in
  stash)
    stash_first_half ;;
  run)
    join_and_convert
    python3 -m pytest -q -n 0 -p no:cacheprovider -m gpu tests/ 2>&1 | tee "$OUT/pytest_gpu.txt" | tail -6
    python3 -m engine.bench --model /root/smollm2 --backend cupy --scenario spec-decode --new-tokens 256 \
      --spec-draft /root/smollm2 2>&1 | grep '^{' | tee "$OUT/spec_decode_smollm2.jsonl" | cut -c150-560 ;;
  l1b)
    python3 -m engine.random_model llama-3.2-1b $M 2>&1 | tail -1
    python3 -c "from engine.model.random_model import PRESETS, write_random_model as w
w('/root/l1b-draft', {**PRESETS['llama-3.2-1b'], 'num_hidden_layers': 2}, seed=1)"
    python3 -m engine.bench --model $M --backend cupy --scenario spec-decode --new-tokens 256 \
      --spec-draft /root/l1b-draft 2>&1 | grep '^{' | tee "$OUT/spec_decode_l1b.jsonl" | cut -c150-560
    python3 -m engine.bench --model $M --backend cupy --scenario serve --requests 256 --kv-cache-mib 8192 \
      --serve-modes continuous+paged continuous+paged+spec continuous+paged+spec continuous+paged \
      2>&1 | grep '^{' | tee "$OUT/serve_spec.jsonl" | cut -c150-420 ;;
  serve)   # the serve comparison alone, eight runs interleaved (off on on off off on on off)
    python3 -m engine.random_model llama-3.2-1b $M 2>&1 | tail -1
    P=continuous+paged S=continuous+paged+spec
    python3 -m engine.bench --model $M --backend cupy --scenario serve --requests 256 --kv-cache-mib 8192 \
      --serve-modes $P $S $S $P $P $S $S $P 2>&1 | grep '^{' | tee "$OUT/serve_spec8.jsonl" | cut -c150-420 ;;
esac
