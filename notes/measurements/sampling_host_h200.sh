#!/usr/bin/env bash
# Sampling's host work on the H200 (run from the repository root on the GPU machine; results land in $OUT):
#   1. the GPU tests that go through start_sampling: the pinned staging and the host never waiting for the
#      device (tests/test_ch08_sampling_staging.py), non-finite rows, a learner's sampling kernel, seeded
#      sampling (graphs, async scheduling, speculation), processed logits;
#   2. the sampling kernel's check and timing (kernel_bench --only sampling, through engine.ops.sampling.sample);
#   3. one sampled call's host and device time, the previous host path beside it;
#   4. the 256-request serving workload, greedy and sampled (temperature 0.8, top-k 50, top-p 0.95) on the
#      Llama-3.2-1B shape in the same run, and a summary: greedy tok/s, sampled tok/s, their ratio.
# Random weights only (no download): the tests use the tiny presets, the bench the preset's shape.
# Each part has its time limit (170 + 45 + 45 + 220 s: at most 8 minutes in all).
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
G=tests/test_gpu   # (the tests needing the downloaded default model are left out: the GPU machine is offline)
timeout 170 python3 -m pytest -q -n 0 -p no:cacheprovider tests/test_ch08_sampling_staging.py "$G"_hostile.py \
  "$G"_logits_processing.py::test_processing_and_logprobs_on_the_device_equal_numpy \
  "$G"_logits_processing.py::test_the_engine_follows_the_processed_logits_on_the_gpu \
  "$G"_ch12_engine_loop.py::test_graph_decode_equals_eager_decode "$G"_ch12_engine_loop.py::test_threads_share_one_llm_on_gpu \
  "$G"_ch12_engine_loop.py::test_async_scheduling_gives_the_tokens_of_one_step_at_a_time \
  "$G"_model.py::test_seeded_sampling_reproducible_on_gpu \
  "$G"_speculative.py::test_device_verification_equals_numpy_on_the_same_logits \
  "$G"_speculative.py::test_seeded_sampling_with_speculation_reproduces_itself \
  "tests/test_ch03_11_plugins.py::test_gpu_cuda_source_runs_inside_generate_and_the_chat[sampling]" \
  2>&1 | tee "$OUT/pytest_sampling_gpu.txt" | tail -8
timeout 45 python3 -m engine.kernel_bench --only sampling 2>&1 | tee "$OUT/kernel_bench_sampling.txt" | tail -4
# One call of the sampled path at the workload's mean and full batch (137 and 256 rows of 128,256 logits):
# host time while the device is busy (a host that waits for the device shows the spin's ~0.25 s here) and
# device time back to back; "before" replays the previous host path (four cp.asarray, isfinite + stack).
timeout 45 python3 - <<'PY' 2>&1 | tee "$OUT/sampling_host_time.txt"
import time
import cupy as cp
import numpy as np
from engine.backend import load_kernel
from engine.ops.sampling import SAMPLE_THREADS, start_sampling
from engine.runtime.sampling_params import SamplingParams, step_uniforms

def before(logits, params, u):
    R, V = logits.shape
    knobs = [cp.asarray(np.array(v, dtype=dt)) for v, dt in (([p.temperature for p in params], np.float32),
             ([p.top_k for p in params], np.int32), ([p.top_p for p in params], np.float32), (u, np.float32))]
    tokens = cp.empty(R, dtype=cp.int32)
    load_kernel("sampling", "sample_rows", THREADS=SAMPLE_THREADS)((R,), (SAMPLE_THREADS,), (logits, *knobs, tokens, np.int32(V)))
    both = cp.stack([tokens, cp.isfinite(logits).all(axis=1).astype(cp.int32)])
    host = np.frombuffer(cp.cuda.alloc_pinned_memory(both.nbytes), np.int32, both.size)
    cp.cuda.runtime.memcpyAsync(host.ctypes.data, both.data.ptr, both.nbytes, cp.cuda.runtime.memcpyDeviceToHost,
                                cp.cuda.get_current_stream().ptr)
    return both, host

def done(out):
    cp.cuda.Device().synchronize() if isinstance(out, tuple) else out.wait()

spin = cp.RawKernel('extern "C" __global__ void spin(long long n) '
                    '{ long long t = clock64(); while (clock64() - t < n) {} }', "spin")
N = 50
for R in (137, 256):
    logits = cp.asarray(np.random.default_rng(0).standard_normal((R, 128256), dtype=np.float32) * 3)
    params, u = [SamplingParams(temperature=0.8, top_k=50, top_p=0.95)] * R, step_uniforms(np.arange(R), np.zeros(R, np.int64))
    for name, call in (("before", lambda: before(logits, params, u)), ("after", lambda: start_sampling(logits, params, u))):
        for out in [call() for _ in range(N)]:     # warm: kernels compiled, pinned pools filled
            done(out)
        spin((1,), (1,), (np.int64(5 * 10**8),))
        first, last = cp.cuda.Event(), cp.cuda.Event()
        first.record()
        t0 = time.perf_counter()
        outs = [call() for _ in range(N)]
        host_us = (time.perf_counter() - t0) / N * 1e6
        last.record()
        last.synchronize()
        for out in outs:
            done(out)
        device_us = cp.cuda.get_elapsed_time(first, last) / N * 1e3
        print(f"R={R} {name:6s}: host {host_us:6.0f} us per call (device busy), device {device_us:6.0f} us per call")
PY
timeout 220 python3 -m engine.bench --preset llama-3.2-1b --backend cupy --scenario serve --requests 256 \
  --serve-modes continuous+paged continuous+paged+sampled 2>&1 | tee "$OUT/serve_sampled.log" | grep '^{' \
  > "$OUT/serve_sampled.jsonl"
python3 - "$OUT/serve_sampled.jsonl" <<'EOF'
import json, sys
runs = {r["mode"]: r["output_tok_per_s"] for r in map(json.loads, open(sys.argv[1])) if r.get("scenario") == "serve"}
greedy, sampled = runs.get("continuous+paged"), runs.get("continuous+paged+sampled")
print(f"greedy  {greedy} tok/s\nsampled {sampled} tok/s")
print(f"ratio   {sampled / greedy:.3f}" if greedy and sampled else "ratio   n/a (see serve_sampled.log)")
EOF
