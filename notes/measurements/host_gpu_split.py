"""Where a serving step's time goes, host against GPU (the 256-request workload through LLM.generate).

    python notes/measurements/host_gpu_split.py MODEL_DIR [async|sync]

Times the GPU work of each launched step with CUDA events (recorded before the forward pass and
after the sampler are queued: the step's kernels, including any gaps the host leaves between them)
and the host's time inside LLM._launch, by step kind; "GPU busy" is their sum against the wall
time. Then a cProfile of the engine loop thread's iterations (by internal and cumulative time).
"""
import argparse
import cProfile
import pstats
import sys
import time

import cupy as cp

from engine.bench import serve_workload, warm_up_requests
from engine.llm import LLM
from engine.sampling import SamplingParams

mode = sys.argv[2] if len(sys.argv) > 2 else "async"
args = argparse.Namespace(seed=0, requests=256, min_len=100, max_len=1024)
prompts, outs = serve_workload(args, 128256)
params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in outs]
llm = LLM(sys.argv[1], "cupy", kv_cache_mib=8192, max_context=2056, max_seqs=256,
          async_scheduling=mode == "async")
warm, lengths = warm_up_requests(prompts, llm.max_seqs, llm.max_context, llm.max_batch_tokens)
llm.generate(warm, [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in lengths])

events = []
launch = llm._launch


def timed_launch(batch, seeds, previous=None):
    start, end = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    t = time.perf_counter()
    out = launch(batch, seeds, previous)
    host = time.perf_counter() - t
    end.record()
    events.append((batch.kind, len(batch.rows), start, end, host))
    return out


llm._launch = timed_launch
cp.cuda.Device().synchronize()
t = time.perf_counter()
llm.generate(prompts, params)
cp.cuda.Device().synchronize()
sec = time.perf_counter() - t
log = llm.last_step_log
print(f"{mode}: {len(log)} steps in {sec:.2f} s = {sec / len(log) * 1e3:.2f} ms/step, {sum(outs) / sec:.0f} tok/s")
by_kind = {}
for kind, rows, start, end, host in events:
    k = by_kind.setdefault(kind, [0, 0.0, 0.0, 0])
    k[0] += 1
    k[1] += cp.cuda.get_elapsed_time(start, end)
    k[2] += host * 1e3
    k[3] += rows
busy = sum(k[1] for k in by_kind.values()) / 1e3
print(f"GPU busy {busy:.2f} s of {sec:.2f} s wall ({100 * busy / sec:.0f}%)")
for kind, (n, gpu, host, rows) in by_kind.items():
    print(f"  {kind:8s} steps {n:5d}  rows/step {rows / n:6.1f}  GPU ms/step {gpu / n:6.2f}  "
          f"launch host ms/step {host / n:6.2f}")

llm._launch = launch
profiler = cProfile.Profile()
iteration = llm._engine._iteration


def profiled(*a):
    profiler.enable()
    try:
        iteration(*a)
    finally:
        profiler.disable()


llm._engine._iteration = profiled
llm.generate(prompts, params)
stats = pstats.Stats(profiler)
stats.sort_stats("tottime").print_stats(30)
stats.sort_stats("cumulative").print_stats(40)
