#!/usr/bin/env bash
# The kernel ladders on the H200 (run from the repository root on the GPU machine; ~2-3 minutes).
# Every version of the five ladders (engine/bench/ladder.py, kernels_cu/ladders/) is checked against
# its NumPy reference and timed at every block size of its sweep, one process per ladder (a failure
# or a timeout loses only that ladder; each process writes its JSON after every case). Then the runs
# are merged into one file.
#
# Results in $OUT:
#   ladder_h200.json   the recorded run: copy it to notes/measurements/ladder/ladder_h200.json, where
#                      `python -m engine.kernel_bench --ladder all` shows it on machines without a GPU
#   ladder_h200.txt    the printed tables and the checks
#   ladder_env.txt     the environment (GPU, driver, CUDA, CuPy)
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
python3 -m engine.env > "$OUT/ladder_env.txt" 2>&1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv >> "$OUT/ladder_env.txt" 2>&1
: > "$OUT/ladder_h200.txt"
status=0
# seconds per ladder: the sum stays under 4 minutes even if every one ran to its limit
for entry in rmsnorm:35 softmax:35 paged_attention:60 gemv:50 flash_attention:55; do
  name=${entry%%:*}; limit=${entry##*:}
  echo "=== $name (at most ${limit}s)" | tee -a "$OUT/ladder_h200.txt"
  timeout --signal=INT "$limit" python3 -m engine.kernel_bench --ladder "$name" --json "$OUT/ladder_$name.json" \
    2>&1 | tee -a "$OUT/ladder_h200.txt"
  rc=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] || { echo "=== $name exited with $rc (124: stopped at its time limit)" | tee -a "$OUT/ladder_h200.txt"; status=1; }
done
python3 -m engine.bench.ladder --json "$OUT/ladder_h200.json" --merge \
  "$OUT"/ladder_rmsnorm.json "$OUT"/ladder_softmax.json "$OUT"/ladder_paged_attention.json \
  "$OUT"/ladder_gemv.json "$OUT"/ladder_flash_attention.json 2>&1 | tee -a "$OUT/ladder_h200.txt"
rm -f "$OUT"/ladder_rmsnorm.json "$OUT"/ladder_softmax.json "$OUT"/ladder_paged_attention.json \
  "$OUT"/ladder_gemv.json "$OUT"/ladder_flash_attention.json     # merged into ladder_h200.json
exit $status
