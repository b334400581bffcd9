"""Chapter 14 exercises: predict a decode step's floor from the model's bytes; find the bottleneck
of a step from its per-kernel timeline; bound a serving step whose host work overlaps the GPU's; fuse
the residual add into RMSNorm, measure what the fusion saves and run the model through it."""
from __future__ import annotations

import math
import statistics
import time
import tracemalloc
from collections.abc import Callable

import numpy as np

from engine.exercises import call_learner, check_cases
from engine.exercises.ch08 import config_label, preset_config
from engine.exercises.ch12 import decode_floor_ref
from engine.formats.config import LlamaConfig

IDLE = "idle"      # the label of the time no kernel runs (the GPU waits for the host)


def _call(fn: Callable, args: tuple) -> str:
    def show(a):
        if isinstance(a, LlamaConfig):
            return config_label(a)
        if isinstance(a, list) and len(a) > 4:
            return f"[{len(a)} kernels: {a[0]!r}, {a[1]!r}, ...]"
        return repr(a)
    return f"{getattr(fn, '__name__', 'fn')}({', '.join(show(a) for a in args)})"


# ----------------------------------------------------------------------------- the floor of a step

def step_floor_ms_ref(config: LlamaConfig, batch: int, context_len: int, bandwidth_gbps: float,
                      bytes_per_value: int = 2) -> float:
    """The shortest a decode step can take: every weight is read once (shared by the whole batch),
    and every sequence reads the K/V of its context_len tokens, at the copy bandwidth."""
    # chapter 12's floor in tokens/s is this step producing `batch` tokens
    return batch / decode_floor_ref(config, batch, context_len, bandwidth_gbps, bytes_per_value) * 1e3


def check_step_floor_ms(fn: Callable) -> bool:
    """fn(config, batch, context_len, bandwidth_gbps, bytes_per_value) -> milliseconds."""
    llama, smol = preset_config("llama-3.2-1b"), preset_config("smollm2-135m")
    setups = [(llama, 1, 512, 4200.0, 2), (llama, 64, 1024, 4200.0, 2), (llama, 256, 600, 4200.0, 2),
              (smol, 1, 128, 18.0, 4), (smol, 32, 4096, 3350.0, 2), (llama, 8, 0, 1000.0, 2)]
    cases = [(args, step_floor_ms_ref(*args)) for args in setups]
    hints = [("the weights were counted once per sequence; one read serves the whole batch",
              lambda c, b, n, bw, bpv: step_floor_ms_ref(c, b, n, bw, bpv) + (b - 1) * c.num_parameters() * bpv
              / (bw * 1e9) * 1e3),
             ("the K/V reads are missing (at batch 64 x 1,024 tokens they are a third of the bytes)",
              lambda c, b, n, bw, bpv: c.num_parameters() * bpv / (bw * 1e9) * 1e3),
             ("that is seconds; the answer is in milliseconds",
              lambda c, b, n, bw, bpv: step_floor_ms_ref(c, b, n, bw, bpv) / 1e3),
             ("GB/s means 1e9 bytes per second, not 2**30",
              lambda c, b, n, bw, bpv: step_floor_ms_ref(c, b, n, bw, bpv) * 1e9 / 2**30)]
    return check_cases("step_floor_ms", fn, cases, same=lambda g, w: math.isclose(float(g), w, rel_tol=1e-6),
                       hints=hints, label=_call)


# ----------------------------------------------------------------------------- the bottleneck

def bottleneck_ref(timeline: list) -> tuple[str, float]:
    """timeline: [label, start_ms, end_ms] of every kernel of one step, in launch order, one after the
    other on one stream. Returns (label, share): the label with the most time summed over its calls,
    where the gaps between one kernel's end and the next one's start count as IDLE, and its share of
    the step (first start to last end)."""
    totals: dict[str, float] = {}
    for i, (label, start, end) in enumerate(timeline):
        totals[label] = totals.get(label, 0.0) + (end - start)
        if i:
            totals[IDLE] = totals.get(IDLE, 0.0) + max(0.0, start - timeline[i - 1][2])
    span = timeline[-1][2] - timeline[0][1]
    label = max(totals, key=lambda k: totals[k])
    return label, totals[label] / span


def _timeline(kernels: list[tuple[str, float]], gap: float) -> list:
    t, out = 0.0, []
    for label, ms in kernels:
        out.append([label, round(t, 6), round(t + ms, 6)])
        t += ms + gap
    return out


def _layers(n: int, per_layer: list[tuple[str, float]]) -> list[tuple[str, float]]:
    return [("embedding", 0.002)] + per_layer * n + [("lm_head", 0.06)]


def check_bottleneck(fn: Callable) -> bool:
    """fn(timeline) -> (label, share of the step)."""
    graph_b1 = _layers(16, [("linear qkv", 0.005), ("paged_attention", 0.004), ("linear o", 0.004),
                            ("linear gate_up", 0.02), ("swiglu", 0.002), ("linear down", 0.012)])
    long_ctx = _layers(16, [("linear qkv", 0.01), ("paged_attention", 0.09), ("linear o", 0.008),
                            ("linear gate_up", 0.03), ("linear down", 0.02)])
    timelines = [_timeline(graph_b1, 0.0),               # a replayed graph: back to back
                 _timeline(graph_b1, 0.02),              # launched from Python: gaps of 20 us
                 _timeline(long_ctx, 0.001),             # batch 64 x 4k: attention dominates
                 [["a", 0.0, 1.0], ["b", 1.5, 2.0], ["a", 2.0, 2.25]]]
    cases = [((timeline,), bottleneck_ref(timeline)) for timeline in timelines]

    def same(got, want):
        return got[0] == want[0] and math.isclose(float(got[1]), want[1], rel_tol=1e-6)

    hints = [("the gaps between kernels (the GPU waiting for Python's next launch) were not counted as idle",
              lambda tl: bottleneck_ref(_close_gaps(tl))),
             ("the share must be of the whole step (first start to last end), not of the kernel time",
              lambda tl: (bottleneck_ref(tl)[0], _kernel_share(tl))),
             ("calls of the same kernel must be summed, not compared one by one",
              lambda tl: _longest_call(tl))]
    return check_cases("bottleneck", fn, cases, same=same, hints=hints, label=_call)


def _close_gaps(timeline: list) -> list:
    t, out = timeline[0][1], []
    for label, start, end in timeline:
        out.append([label, t, t + end - start])
        t += end - start
    return out


def _kernel_share(timeline: list) -> float:
    label, _ = bottleneck_ref(timeline)
    busy = sum(e - s for _, s, e in timeline)
    return sum(e - s for lab, s, e in timeline if lab == label) / busy if label != IDLE else 0.0


def _longest_call(timeline: list) -> tuple[str, float]:
    label, start, end = max(timeline, key=lambda k: k[2] - k[1])
    return label, (end - start) / (timeline[-1][2] - timeline[0][1])


# ----------------------------------------------------------------------------- host/GPU overlap

def overlapped_tok_per_s_ref(host_ms: float, gpu_ms: float, tokens_per_step: float) -> float:
    """Output tokens per second of a serving loop whose host work for step n + 1 (scheduling, batch
    arrays, bookkeeping) runs while the GPU computes step n: a step then lasts as long as the slower
    of the two, max(host_ms, gpu_ms), instead of host_ms + gpu_ms one after the other."""
    return tokens_per_step / (max(host_ms, gpu_ms) / 1e3)


def check_overlapped_tok_per_s(fn: Callable) -> bool:
    """fn(host_ms, gpu_ms, tokens_per_step) -> output tokens per second."""
    # the H200 serving step (1.8 ms of host Python, 3.5 ms waiting for the GPU, 128 tokens a step),
    # the same GPU at its floor (the host becomes the limit), a host-bound step, a tie, batch 1
    setups = [(1.8, 3.5, 128.1), (1.8, 1.85, 128.1), (4.0, 2.0, 64), (2.5, 2.5, 256), (0.4, 1.2, 1)]
    cases = [(args, overlapped_tok_per_s_ref(*args)) for args in setups]
    hints = [("that is host and GPU one after the other (the loop without overlap): overlapped, a step "
              "lasts as long as the slower of the two",
              lambda h, g, t: t / ((h + g) / 1e3)),
             ("the host's time was left out: when it is the slower one, it sets the step",
              lambda h, g, t: t / (g / 1e3)),
             ("a step cannot be shorter than the slower of the two: max, not min",
              lambda h, g, t: t / (min(h, g) / 1e3)),
             ("the times are in milliseconds: that is tokens per millisecond",
              lambda h, g, t: t / max(h, g)),
             ("that is steps per second; each step produces tokens_per_step tokens",
              lambda h, g, t: 1e3 / max(h, g))]
    return check_cases("overlapped_tok_per_s", fn, cases,
                       same=lambda g, w: math.isclose(float(g), w, rel_tol=1e-6), hints=hints)


# ----------------------------------------------------------------------------- a fusion, measured

def unfused_add_rmsnorm(residual: np.ndarray, delta: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """What the engine runs when only rmsnorm is replaced: the add, then RMSNorm as written in the
    papers (x * x, the mean, the division and the weight each a pass over memory with a new array)."""
    from engine.ops.rmsnorm import rmsnorm_ref
    residual += delta
    return rmsnorm_ref(residual, w, eps)


def _norm_cases():
    rng = np.random.default_rng(141)
    for T, H, scale in ((4, 8, 1.0), (3, 576, 3.0), (5, 72, 1e-3), (6, 2048, 50.0), (1, 7, 1.0), (33, 96, 1.0)):
        residual = rng.standard_normal((T, H), dtype=np.float32) * np.float32(scale)
        delta = rng.standard_normal((T, H), dtype=np.float32)
        w = (1.0 + 0.3 * rng.standard_normal(H, dtype=np.float32)).astype(np.float32)
        yield residual, delta, w, 1e-5


def _peak_and_ms(fn: Callable, residual, delta, w, eps: float, reps: int = 7) -> tuple[int, float]:
    """(peak bytes allocated by one call, median ms of `reps` calls), each call on fresh copies."""
    r = residual.copy()
    tracemalloc.start()
    try:
        fn(r, delta, w, eps)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    times = []
    for _ in range(reps):
        r = residual.copy()
        t0 = time.perf_counter()
        fn(r, delta, w, eps)
        times.append((time.perf_counter() - t0) * 1e3)
    return peak, statistics.median(times)


def check_fused_add_rmsnorm(fn: Callable) -> bool:
    """fn(residual [T, H], delta [T, H], w [H], eps) -> [T, H]: residual += delta IN PLACE, then return
    rmsnorm(residual) * w, allocating nothing of size [T, H] but the output (in-place ufuncs, out=, a
    sum of squares that builds no x * x). One verdict: right on every case, the residual updated, and
    at T = 256, H = 2,048 at most the output's bytes (plus a little) allocated. The [OK] line prints the
    measured bytes and time beside the unfused pair's."""
    from engine.exercises.ch03 import array_mismatch, describe
    from engine.ops.rmsnorm import rmsnorm_ref
    title = "fused_add_rmsnorm"
    hints = [("the norm was taken before the add: the residual stream is x + delta, and that is what is "
              "normalized (and written back)", lambda r, d, w, eps: rmsnorm_ref(r, w, eps)),
             ("that is the new residual, not its norm: return rmsnorm(residual) * w",
              lambda r, d, w, eps: r + d),
             ("delta alone was normalized; normalize residual + delta",
              lambda r, d, w, eps: rmsnorm_ref(d, w, eps)),
             ("eps went outside the square root: sqrt(mean(x^2) + eps)",
              lambda r, d, w, eps: (r + d) / (np.sqrt(np.mean((r + d) ** 2, -1, keepdims=True)) + np.float32(eps)) * w),
             ("the weight w is missing", lambda r, d, w, eps: rmsnorm_ref(r + d, np.ones_like(w), eps))]
    count = 0
    for residual, delta, w, eps in _norm_cases():
        want_residual = residual + delta
        want = rmsnorm_ref(want_residual, w, eps)
        mine = residual.copy()
        call = f"{getattr(fn, '__name__', 'fn')}{describe((residual, delta, w, eps))}"
        ok, got = call_learner(title, call, fn, mine, delta.copy(), w.copy(), eps)
        if not ok:
            return False
        reason = array_mismatch(got, want, 1e-4, 1e-5)
        if reason is not None:
            for text, mistake in hints:
                wrong = mistake(residual.copy(), delta, w, eps)
                if array_mismatch(got, wrong, 1e-4, 1e-5) is None:
                    reason += f" -- it looks like {text}"
                    break
            print(f"[x] {title}: {call} {reason}")
            return False
        if not np.allclose(mine, want_residual, rtol=1e-6, atol=1e-6):
            untouched = np.array_equal(mine, residual)
            print(f"[x] {title}: {call} returned the right norm but did not update the residual in place"
                  + (" (it is unchanged: `residual += delta`, or np.add(residual, delta, out=residual))"
                     if untouched else ""))
            return False
        count += 1
    rng = np.random.default_rng(142)
    T, H = 256, 2048
    residual, delta = (rng.standard_normal((T, H), dtype=np.float32) for _ in range(2))
    w = rng.standard_normal(H, dtype=np.float32)
    ok, result = call_learner(title, f"{title}(T={T}, H={H})", _peak_and_ms, fn, residual, delta, w, 1e-5)
    if not ok:
        return False
    (peak, ms), out_bytes = result, 4 * T * H
    ref_peak, ref_ms = _peak_and_ms(unfused_add_rmsnorm, residual, delta, w, 1e-5)
    if peak > out_bytes + out_bytes // 4:
        print(f"[x] {title}: right on all {count} cases, but at T={T}, H={H} it allocated {peak / out_bytes:.1f}x the "
              f"output's {out_bytes / 2**20:.0f} MiB at its peak: some [T, H] temporary is still built (x * x, "
              f"x / rms, ...). Square-and-sum without an array (np.einsum('th,th->t', x, x)), then scale into "
              f"one output array with out= or *=")
        return False
    print(f"[OK] {title}: all {count} cases pass (the residual updated in place); at T={T}, H={H} it allocated "
          f"{peak / 2**20:.1f} MiB at its peak and took {ms:.2f} ms, the unfused add + RMSNorm "
          f"{ref_peak / 2**20:.1f} MiB and {ref_ms:.2f} ms (median of 7, this CPU)")
    return True


def time_add_rmsnorm_in_model(fn: Callable, prompt_tokens: int = 128, reps: int = 2, model_dir=None) -> dict:
    """The default model's prefill of `prompt_tokens` tokens (NumPy backend) with the engine's add_rmsnorm
    (on the CPU: the add, then RMSNorm as written) and with yours plugged in (engine.use_stage): per-op
    times from the profiler of section 3 (OpTimer), median over `reps` passes. Prints the add_rmsnorm
    op's time and the pass's; returns them."""
    import engine
    from engine.bench.step_profile import OpTimer
    from engine.exercises.model_check import _default_model
    from engine.model.forward_pass import ForwardBatch
    residual, delta, w, eps = next(_norm_cases())
    ok, _ = call_learner("fused_add_rmsnorm", "fused_add_rmsnorm on a small case", fn, residual, delta, w, eps)
    if not ok:                                   # not attempted (or broken): say so before loading the model
        return {}
    model, _ = _default_model(model_dir, max(prompt_tokens, 256))
    ids = np.random.default_rng(14).integers(0, model.config.vocab_size, prompt_tokens).astype(np.int32).tolist()
    batch = ForwardBatch.single(ids)

    def measure(stage_fn):
        per_op, totals = [], []
        for _ in range(reps):
            timer = OpTimer(model)
            with timer.timed_ops():
                if stage_fn is None:
                    model.forward(batch)
                else:
                    with engine.use_stage("add_rmsnorm", stage_fn):
                        model.forward(batch)
            table, total = timer.table()
            row = next(r for r in table if r["kernel"] == "add_rmsnorm")
            per_op.append(row["ms"])
            totals.append(total)
        return statistics.median(per_op), statistics.median(totals), row["calls"]

    results = {}
    for name, stage_fn in (("the engine's add_rmsnorm", None), ("your fused_add_rmsnorm", fn)):
        op_ms, total_ms, calls = measure(stage_fn)
        results[name] = {"add_rmsnorm_ms": op_ms, "pass_ms": total_ms, "calls": calls}
        print(f"{name:<28} {calls} calls: {op_ms:7.1f} ms of a {total_ms:7.1f} ms prefill of {prompt_tokens} tokens "
              f"({op_ms / total_ms:.1%})")
    return results
