"""Where the time of one decode step goes: per-op times, bytes moved and bandwidth (chapter 14).

`python -m engine.bench --profile` runs `profile_decode(model, rows, context)`: a decode step of
`rows` sequences that each attend to `context` tokens, with every op of Model.run timed. The hook
costs nothing when off: Model.run is not touched; for the duration of `timed_ops()` the op
functions it calls (engine.model.forward_pass's names: linear, rmsnorm, paged_attention, ...) are replaced by
wrappers that record an event before and after each call. (Process-wide: profile with nothing
else running the model.)

Launch overhead would pollute the GPU times: when Python launches ops more slowly than the GPU runs
them, the interval between two events includes the GPU waiting for the host. So the step is queued
behind a short sleep kernel: the host gets every launch in while the GPU sleeps, then the GPU runs
the ops back to back and the events measure kernels only. The same step is also timed the two ways
a server runs it: eagerly from Python (wall time) and as a replayed CUDA graph.
"""
from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

import numpy as np

import engine.model.forward_pass as model_module
from engine.model.forward_pass import ForwardBatch

TIMED = ("embedding", "rmsnorm", "add_rmsnorm", "linear", "rope_qkv", "kv_write", "paged_attention",
         "flash_attention", "swiglu", "moe")
# the projections of a layer, by attribute: a dense layer's (qkv, o, gate_up, down) and a hybrid model's
# (engine/model/hybrid_weights.py: qkvg and o of a full-attention layer, in_proj and out of a linear one)
PROJECTIONS = ("qkv", "qkvg", "in_proj", "o", "out", "gate_up", "down")

_SLEEP_SOURCE = r"""
extern "C" __global__ void sleep_ns(unsigned long long ns) {   // one thread keeps the stream busy
    for (unsigned long long waited = 0; waited < ns; waited += 1000) __nanosleep(1000);
}
"""


class OpTimer:
    """Records (label, start mark, end mark, bytes moved) for every call of the timed ops."""

    def __init__(self, model, context_tokens: int = 0):
        self.model, self.gpu = model, model.backend.is_gpu
        self.context_tokens = context_tokens        # keys the attention of one layer reads, all rows together
        w = model.weights
        self.weight_names = {id(w.lm_head): "lm_head"}
        for lw in w.layers:       # a sparse layer's MLP is one "moe" call: its gate_up and down are None
            for attr in PROJECTIONS:
                if getattr(lw, attr, None) is not None:
                    self.weight_names[id(getattr(lw, attr))] = f"linear {attr}"
        self.records: list[tuple[str, object, object, int]] = []

    def mark(self):
        if not self.gpu:
            return time.perf_counter()
        import cupy as cp
        event = cp.cuda.Event()
        event.record()
        return event

    def elapsed_ms(self, start, end) -> float:
        if not self.gpu:
            return (end - start) * 1e3
        import cupy as cp
        return float(cp.cuda.get_elapsed_time(start, end))

    def bytes_moved(self, name: str, args) -> tuple[str, int]:
        """(label, bytes read + written) of one call, from the shapes of its arguments."""
        cfg = self.model.config
        act = 2 if self.gpu else 4                  # activations between ops: bf16 on the GPU
        if name == "linear":
            x, w = args[0], args[1]
            T, K = x.shape
            N = w.shape[0]
            return self.weight_names.get(id(w), "linear"), N * K * w.itemsize + T * K * x.itemsize + T * N * 4
        if name == "embedding":
            ids, table = args[0], args[1]
            return name, len(ids) * table.shape[1] * (table.itemsize + 4)
        if name == "rmsnorm":
            T, H = args[0].shape
            return name, T * H * (4 + act) + H * args[1].itemsize
        if name == "add_rmsnorm":
            T, H = args[0].shape
            return name, T * H * (3 * 4 + act) + H * args[2].itemsize
        if name == "rope_qkv":
            T, W = args[0].shape
            return name, T * W * (4 + act) + 2 * T * cfg.head_dim // 2 * 4
        if name == "kv_write":
            T = args[0].shape[0]
            return name, T * 2 * cfg.kv_dim * act * 2
        if name == "paged_attention":
            T = args[0].shape[0]
            return name, self.context_tokens * 2 * cfg.kv_dim * act + T * (cfg.qkv_dim + cfg.q_dim) * act
        if name == "flash_attention":
            T = args[0].shape[0]
            return name, T * (cfg.qkv_dim + cfg.q_dim) * act
        if name == "swiglu":
            T, I2 = args[0].shape
            return name, T * I2 * 4 + T * I2 // 2 * act
        if name == "moe":          # the router and the chosen experts: at most T*k of them (tokens may share)
            T, H = args[0].shape
            m, itemsize = cfg.moe, args[1].router.itemsize
            chosen = min(T * m.experts_per_token, m.num_experts)
            return name, (m.num_experts + 3 * chosen * m.expert_intermediate_size) * H * itemsize + T * H * (act + 4)
        return name, 0

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            label, nbytes = self.bytes_moved(name, args)
            start = self.mark()
            out = fn(*args, **kwargs)
            self.records.append((label, start, self.mark(), nbytes))
            return out
        return timed

    @contextmanager
    def timed_ops(self, module=model_module, names=TIMED):
        """Time every op Model.run calls (or the `names` of another module the pass calls, e.g.
        engine.model.hybrid_forward's), for the span of the block."""
        saved = {name: getattr(module, name) for name in names}
        for name, fn in saved.items():
            setattr(module, name, self.wrap(name, fn))
        try:
            yield self
        finally:
            for name, fn in saved.items():
                setattr(module, name, fn)

    def timeline(self) -> list[list]:
        """[label, start ms, end ms] of every call, from the first call's start (a per-kernel timeline)."""
        if not self.records:
            return []
        t0 = self.records[0][1]
        return [[label, round(self.elapsed_ms(t0, start), 5), round(self.elapsed_ms(t0, end), 5)]
                for label, start, end, _ in self.records]

    def table(self) -> tuple[list[dict], float]:
        """Per label: calls, ms, bytes (summed over the step); and the step's total of op times."""
        sums: dict[str, list] = defaultdict(lambda: [0, 0.0, 0])
        for label, start, end, nbytes in self.records:
            row = sums[label]
            row[0] += 1
            row[1] += self.elapsed_ms(start, end)
            row[2] += nbytes
        total = sum(row[1] for row in sums.values())
        return [{"kernel": label, "calls": c, "ms": ms, "bytes": b} for label, (c, ms, b) in sums.items()], total


def decode_batch_for(rows: int, context: int, page_size: int, vocab: int, seed: int = 0) -> ForwardBatch:
    """`rows` sequences at position context - 1 over distinct pages (page table of row r: its own run)."""
    pages = -(-context // page_size)
    tables = np.arange(rows * pages, dtype=np.int32).reshape(rows, pages)
    pos = np.full(rows, context - 1, dtype=np.int32)
    slots = (tables[:, -1] * page_size + (context - 1) % page_size).astype(np.int32)
    ids = np.random.default_rng(seed).integers(0, vocab, rows).astype(np.int32)
    return ForwardBatch(ids, pos, np.arange(rows + 1, dtype=np.int32), tables, slots, np.arange(rows, dtype=np.int32))


def _sleep(ms: float) -> None:
    from engine.backend import load_source
    load_source(_SLEEP_SOURCE, "<profile sleep>").get_function("sleep_ns")((1,), (1,), (np.uint64(ms * 1e6),))


def profile_decode(model, rows: int, context: int, page_size: int = 16, reps: int = 5) -> dict:
    """Per-op times of one decode step (median over `reps`), plus the eager and graph step times."""
    from engine.model.kv_cache import KVCache
    cfg = model.config
    fb = decode_batch_for(rows, context, page_size, cfg.vocab_size)
    assert fb.page_tables is not None                         # a decode batch: every row has its pages
    cache = KVCache(cfg, rows * fb.page_tables.shape[1], page_size, model.backend)
    for _ in range(2):                                        # compile kernels, let cuBLAS choose
        model.forward(fb, cache)
    model.backend.synchronize()
    runs = []
    for _ in range(reps):
        timer = OpTimer(model, context_tokens=rows * context)
        if model.backend.is_gpu:
            _sleep(20 + 0.2 * rows)                           # the GPU waits while every launch is queued
        with timer.timed_ops():
            model.forward(fb, cache)
        model.backend.synchronize()
        runs.append(timer.table())
    timeline = timer.timeline()                               # the last run's, call by call
    ops = []
    for i, row in enumerate(runs[0][0]):
        ms = float(np.median([run[0][i]["ms"] for run in runs]))
        ops.append({**row, "ms": ms})
    kernel_ms = sum(op["ms"] for op in ops)                  # the step's op times, each a median
    result = {"rows": rows, "context": context, "ops": ops, "kernels_ms": kernel_ms, "timeline": timeline,
              "eager_ms": _eager_step_ms(model, fb, cache)}
    if model.backend.is_gpu:
        result["graph_ms"] = _graph_step_ms(model, fb, cache)
    return result


def _eager_step_ms(model, fb, cache, reps: int = 10) -> float:
    model.backend.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        model.forward(fb, cache)
    model.backend.synchronize()
    return (time.perf_counter() - t) / reps * 1e3


def _graph_step_ms(model, fb, cache, reps: int = 20) -> float | None:
    import cupy as cp

    from engine.runtime.cuda_graphs import DecodeGraphs
    graphs = DecodeGraphs(model, cache, fb.num_tokens, enabled=True)
    if graphs.forward(fb) is None:                           # captures; None: graphs are off
        return None
    start, end = cp.cuda.Event(), cp.cuda.Event()
    cp.cuda.Device().synchronize()
    t = time.perf_counter()
    start.record()
    for _ in range(reps):
        graphs.forward(fb)
    end.record()
    end.synchronize()
    return (time.perf_counter() - t) / reps * 1e3


def profile_records(result: dict, copy_gbps: float) -> list[dict]:
    """One record per op label (sorted by time) and a total: ms, % of step, GB/s, % of copy bandwidth."""
    total = result["kernels_ms"]
    out = []
    for op in sorted(result["ops"], key=lambda o: -o["ms"]):
        gbps = op["bytes"] / (op["ms"] * 1e-3) / 1e9 if op["ms"] > 0 else 0.0
        out.append({"kernel": op["kernel"], "calls": op["calls"], "ms": round(op["ms"], 4),
                    "pct_of_step": round(100 * op["ms"] / total, 1) if total else 0.0,
                    "bytes": int(op["bytes"]), "gbps": round(gbps, 1),
                    "pct_of_copy": round(100 * gbps / copy_gbps, 1) if copy_gbps else None})
    moved = sum(op["bytes"] for op in result["ops"])
    summary = {"kernel": "step (kernels back to back)", "calls": sum(op["calls"] for op in result["ops"]),
               "ms": round(total, 4), "pct_of_step": 100.0, "bytes": int(moved),
               "gbps": round(moved / (total * 1e-3) / 1e9, 1) if total else 0.0,
               "floor_ms": round(moved / (copy_gbps * 1e9) * 1e3, 4) if copy_gbps else None,
               "eager_step_ms": round(result["eager_ms"], 4)}
    summary["pct_of_copy"] = round(100 * summary["gbps"] / copy_gbps, 1) if copy_gbps else None
    if result.get("graph_ms") is not None:
        summary["graph_step_ms"] = round(result["graph_ms"], 4)
    return out + [summary]


def format_table(records: list[dict], rows: int, context: int) -> str:
    lines = [f"decode step: {rows} row(s) x {context} tokens of context",
             f"{'kernel':<28}{'calls':>6}{'ms':>10}{'% step':>8}{'MB':>10}{'GB/s':>9}{'% copy':>8}"]
    for r in records:
        pct = "" if r["pct_of_copy"] is None else f"{r['pct_of_copy']:.1f}"
        lines.append(f"{r['kernel']:<28}{r['calls']:>6}{r['ms']:>10.4f}{r['pct_of_step']:>8.1f}"
                     f"{r['bytes'] / 1e6:>10.2f}{r['gbps']:>9.1f}{pct:>8}")
    last = records[-1]
    extra = [f"eager step (launched from Python): {last['eager_step_ms']:.4f} ms"]
    if "graph_step_ms" in last:
        extra.append(f"CUDA graph replay: {last['graph_step_ms']:.4f} ms")
    if last.get("floor_ms") is not None:
        extra.append(f"floor (bytes / copy bandwidth): {last['floor_ms']:.4f} ms")
    return "\n".join(lines + extra)
