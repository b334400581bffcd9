#!/usr/bin/env bash
# Prefix caching on the H200, more samples (run from the repository root on the GPU machine):
# `engine.bench` shared-prefix twice and chat-turns once, then serve with the cache on and off
# interleaved (off on on off off on on off) on the random-weight Llama-3.2-1B, 8 GiB pool. $OUT gets
# prefix.jsonl and serve.jsonl.
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1 M=/root/l1b
[ -f $M/model.safetensors ] || python3 -m engine.random_model llama-3.2-1b $M 2>&1 | tail -1
for scenarios in shared-prefix "shared-prefix chat-turns"; do
  python3 -m engine.bench --model $M --backend cupy --scenario $scenarios --kv-cache-mib 8192 2>&1 | grep '^{' \
    | tee -a "$OUT/prefix.jsonl" | cut -c 380-900
done
[ "${1:-}" = "serve" ] && python3 -m engine.bench --model $M --backend cupy --scenario serve --requests 256 \
  --kv-cache-mib 8192 --serve-modes continuous+paged+nocache continuous+paged continuous+paged \
  continuous+paged+nocache continuous+paged+nocache continuous+paged continuous+paged continuous+paged+nocache \
  2>&1 | grep '^{' | tee "$OUT/serve.jsonl" | cut -c 300-420
exit 0
