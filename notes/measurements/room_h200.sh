#!/usr/bin/env bash
# Serving a room on the H200 (run from the repository root on the GPU machine). The default model
# travels in two halves (.gg1/, .gg2/; the gguf wheel in .whl/):
#   stash   copies the first half to /root/gg/
#   run     joins the halves, converts the default model, writes the random-weight Llama-3.2-1B, runs
#           every GPU test, then `engine.bench --scenario fair-flood` with 512 seats (the room's 256
#           streaming requests from 8 keys, alone and again 1 s after one more key sent 1,000)
#   more    the server's wheels (.whl/: starlette, uvicorn, pydantic, httpx), then the flood with 512
#           seats and with 256 (the room alone fills them), and serve-http (one client: plain FIFO,
#           against LLM.generate in the same run)
# Results land in $OUT.
set -uo pipefail
. notes/measurements/default_model.sh
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 M=/root/l1b
flood() {   # $1: seats
  timeout 240 python3 -m engine.bench --model $M --backend cupy --scenario fair-flood --requests 256 --room-clients 8 \
    --flood-requests 1000 --max-seqs "$1" > "$OUT/fair_flood_$1.log" 2>&1
  grep '^{' "$OUT/fair_flood_$1.log" | tee "$OUT/fair_flood_$1.jsonl" | cut -c1-900; tail -3 "$OUT/fair_flood_$1.log"
}
case ${1:-run} in
  stash)
    stash_first_half ;;
  run)
    join_and_convert
    python3 -m engine.random_model llama-3.2-1b $M 2>&1 | tail -1
    python3 -m engine.env 2>&1 | tee "$OUT/env.txt" | tail -3
    python3 -m pytest -q -n 0 -p no:cacheprovider -m gpu tests/ 2>&1 | tee "$OUT/pytest_gpu.txt" | tail -12
    flood 512 ;;
  more)
    pip install -q --no-deps --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -1
    export PYTHONPATH=/tmp/site
    [ -d $M ] || python3 -m engine.random_model llama-3.2-1b $M 2>&1 | tail -1
    flood 512
    flood 256
    python3 -m engine.bench --model $M --backend cupy --scenario serve-http --requests 256 --kv-cache-mib 8192 \
      2>&1 | grep '^{' | tee "$OUT/serve_http.jsonl" | cut -c1-600 ;;
esac
