"""Kernel ladders, in the style of llm.c's dev/cuda: numbered versions of one kernel, each a step up.

    python -m engine.kernel_bench --ladder rmsnorm        (or softmax, paged_attention, gemv, flash_attention, all)
    python -m engine.kernel_bench --ladder all --json ladder.json

Five ladders: RMSNorm (chapter 04), the attention softmax (06), paged decode attention (11), flash
prefill attention (13) and the decode GEMV (14). Version 1 is the first kernel anyone writes;
each later version changes one thing, and its comment header in kernels_cu/ladders/<name>.cu says
what and why it should be faster. Where the engine runs a rung, that rung is compiled from the
engine's own source (kernels_cu/<stage>.cu), not copied. notes/kernel_ladders.md walks through them.

On a GPU every version is checked against the NumPy reference (engine/ops/*_ref; outputs poisoned
with NaN bits first, so an element a kernel forgets to write fails) at EVERY block size of its sweep,
on awkward shapes and on the timed ones, then timed at every block size: CUDA events around a CUDA
graph of back-to-back launches (no host launch gaps), after warm-up, the median of 7 replays, cycling
over copies of the input so that no launch finds it in L2. The table gives microseconds, GB/s (or
TFLOP/s) and the share of the measured copy bandwidth (or bf16 GEMM rate), and the speedup over v1.

Without a GPU the command compiles every version (NVRTC or nvcc, no GPU needed: a broken rung shows
its compile error) and prints the recorded run of notes/measurements/ladder/ladder_h200.json, labelled
with its GPU and date; where no run is recorded it says so.
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import os
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from engine import gpu_compile
from engine.backend import KERNELS_DIR, bf16_to_f32

SCHEMA = "engine.kernel_ladder/1"
REPO = Path(__file__).resolve().parents[2]
RECORDED = REPO / "notes" / "measurements" / "ladder" / "ladder_h200.json"
HOW_TO_RECORD = ("bash notes/measurements/ladder_h200.sh on a CUDA GPU writes one; copy its ladder_h200.json "
                 "to notes/measurements/ladder/")
BF16_TOL = 1e-2
L2_FLUSH_BYTES = 256 * 2**20      # a timed pass cycles over this many bytes of input copies (several L2s)
GRAPH_TARGET_MS = 3.0             # GPU time per timed graph replay
ROUNDS = 7                        # replays; the median is reported


# ------------------------------------------------------------------------------------------------
# What a ladder is made of
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Build:
    """One compilation: a source under kernels_cu/ with -D defines (what the compile check runs)."""
    source: str                                   # relative to kernels_cu/, e.g. "ladders/gemv.cu"
    defines: tuple[tuple[str, int], ...] = ()
    min_arch: int = 75                            # 80: tensor-core code (mma.sync), traps below

    def label(self) -> str:
        d = " ".join(f"{k}={v}" for k, v in self.defines)
        return f"{self.source}" + (f" [{d}]" if d else "")


@dataclass
class Rung:
    version: int | str               # 1..N; "ref" for a comparison that is not a rung (cuBLAS)
    kernel: str                      # the kernel's name in its source (or the Python function)
    origin: str                      # where its code lives, relative to the repository
    what: str                        # what it changes over the rung below, in a line
    sizes: tuple                     # the block-size sweep
    unit: str                        # what a size counts: "threads", "warps", "splits", ...
    default: Callable[[dict], object] | object = None   # the size the engine's launcher (or the rung) uses
    builds: Callable[[dict, object], list[Build]] = lambda case, size: []   # noqa: E731
    needs: Callable[[dict], str | None] = lambda case: None                   # noqa: E731  # why not, or None
    sm80: bool = False               # tensor cores (mma.sync): sm_80+

    def default_size(self, case: dict):
        return self.default(case) if callable(self.default) else self.default

    def block_label(self, size) -> str:
        if size is None:
            return self.unit or "-"
        if isinstance(size, tuple):
            return f"{size[0]}w x {size[1]} keys"
        return f"{size} {self.unit}"


@dataclass
class Case:
    label: str
    params: dict
    timed: bool                      # checked only (awkward shapes) or checked and timed


@dataclass
class Ladder:
    name: str
    title: str
    chapter: str
    metric: str                      # "GB/s" (memory bound: vs copy bandwidth) or "TFLOP/s" (vs bf16 GEMM)
    source: str                      # the ladder's own file, kernels_cu/ladders/<name>.cu
    rungs: list[Rung]
    cases: list[Case]
    work: Callable[[dict], float]    # bytes (GB/s) or flops (TFLOP/s) of one call
    tol: Callable[[dict], float]
    make_inputs: Callable[..., dict]      # (ctx, params) -> dict of device inputs, output, reference
    launch: Callable[..., Callable]       # (ctx, rung, size, inputs, copy) -> zero-argument callable
    work_note: str = ""

    def builds(self) -> list[Build]:
        seen: dict[Build, None] = {}
        for case, rung in itertools.product(self.cases, self.rungs):
            for size in rung.sizes:
                for b in rung.builds(case.params, size):
                    seen.setdefault(b, None)
        return list(seen)


# ------------------------------------------------------------------------------------------------
# Device helpers
# ------------------------------------------------------------------------------------------------

@dataclass
class Ctx:
    cp: Any                          # the cupy module
    copy_gbps: float
    gemm_tflops: float | None = None
    seed: int = 1234
    sms: int = 0
    _kernels: dict = field(default_factory=dict)

    def rng(self):
        self.seed += 1
        return self.cp.random.RandomState(self.seed)

    def f32(self, shape, scale=1.0):
        return self.rng().standard_normal(shape, dtype=self.cp.float32) * self.cp.float32(scale)

    def bf16(self, shape, scale=1.0):
        """bf16 bits (uint16) of normal values, rounded to nearest even on the device."""
        cp = self.cp
        bits = self.f32(shape, scale).view(cp.uint32)
        return ((bits + (cp.uint32(0x7FFF) + ((bits >> 16) & cp.uint32(1)))) >> 16).astype(cp.uint16)

    def kernel(self, build: Build, name: str):
        """`name` from `build`, compiled once (the engine's NVRTC options, kernels_cu/ on the include path)."""
        key = (build, name)
        if key not in self._kernels:
            from engine.backend import load_source
            path = KERNELS_DIR / build.source
            self._kernels[key] = load_source(path.read_text(), path, tuple(build.defines)).get_function(name)
        return self._kernels[key]


def rel_err(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    if out.shape != ref.shape or not np.all(np.isfinite(out)):
        return float("inf")
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def poison(cp, arr) -> None:
    """0xFF bytes: NaN in fp32 and bf16, so an element the kernel does not write fails the check."""
    arr.view(cp.uint8).fill(0xFF)


def n_copies(nbytes: int) -> int:
    """Copies of an input to cycle over so that a timed pass reads L2_FLUSH_BYTES (at most 32)."""
    return int(min(32, max(1, math.ceil(L2_FLUSH_BYTES / max(nbytes, 1)))))


def time_us(cp, fns: list[Callable[[], object]]) -> float:
    """Median GPU time of one call, in microseconds. `fns` are the same launch over different input
    copies; a pass calls each once. Warm-up first; then a short call is captured into a CUDA graph of
    enough passes for ~GRAPH_TARGET_MS of GPU time (no host launch gaps between kernels), a long
    one (over 200 us, or one that cannot be captured: cuBLAS workspaces, allocations) is launched back
    to back between CUDA events. Median of ROUNDS replays."""
    stream = cp.cuda.Stream(non_blocking=True)
    start, end = cp.cuda.Event(), cp.cuda.Event()
    with stream:
        for fn in fns:
            fn()
        start.record(stream)
        for fn in fns:
            fn()
        end.record(stream)
        end.synchronize()
        est_ms = cp.cuda.get_elapsed_time(start, end) / len(fns)
        passes = max(1, min(math.ceil(GRAPH_TARGET_MS / max(est_ms * len(fns), 1e-3)), max(1, 1000 // len(fns))))
        graph = None
        if est_ms < 0.2:
            try:
                stream.begin_capture()
                try:
                    for _ in range(passes):
                        for fn in fns:
                            fn()
                finally:
                    graph = stream.end_capture()
                graph.launch(stream)
            except Exception:                 # not capturable: time eager launches instead
                graph = None
                stream.synchronize()
        times = []
        for _ in range(ROUNDS):
            start.record(stream)
            if graph is not None:
                graph.launch(stream)
            else:
                for _ in range(passes):
                    for fn in fns:
                        fn()
            end.record(stream)
            end.synchronize()
            times.append(cp.cuda.get_elapsed_time(start, end) / (passes * len(fns)))
    return 1000.0 * float(np.median(times))


# ------------------------------------------------------------------------------------------------
# RMSNorm (chapter 04)
# ------------------------------------------------------------------------------------------------

THREADS = (32, 64, 128, 256, 512, 1024)
EPS = 1e-5


def _rmsnorm_inputs(ctx, p):
    cp = ctx.cp
    T, H = p["T"], p["H"]
    x, w = ctx.f32((T, H), 3.0), ctx.f32((H,))
    from engine.ops.rmsnorm import rmsnorm_ref
    rows = _spot_rows(T, p)
    ref = rmsnorm_ref(x[cp.asarray(rows)].get(), w.get(), EPS)
    copies = [{"x": x}] + [{"x": x.copy()} for _ in range(n_copies(T * H * 4) - 1 if p.get("_timed") else 0)]
    return {"x": x, "w": w, "out": cp.empty((T, H), dtype=cp.uint16), "ref": ref, "rows": rows, "copies": copies,
            "result": lambda inp: bf16_to_f32(inp["out"][cp.asarray(rows)].get())}


def _rmsnorm_launch(ctx, rung, size, inp, copy):
    T, H = inp["out"].shape
    x, w, out = copy["x"], inp["w"], inp["out"]
    k = ctx.kernel(rung.builds({}, size)[0], rung.kernel)
    i32, f32 = np.int32, np.float32
    if rung.version == 1:
        return lambda: k((-(-T // size),), (size,), (x, w, out, i32(T), i32(H), f32(EPS)))
    if rung.version == 2:
        return lambda: k((T,), (size,), (x, w, out, i32(H), f32(EPS)), shared_mem=4 * size)
    if rung.version in (3, 4):
        return lambda: k((T,), (size,), (x, w, out, i32(H), f32(EPS)))
    return lambda: k((-(-T // (size // 32)),), (size,), (x, w, out, i32(T), i32(H), f32(EPS)))


def _rmsnorm_default_threads(case):
    from engine.ops.rmsnorm import _threads
    return _threads(case["H"])


def _h4(case):
    return None if case["H"] % 4 == 0 else "needs H % 4 == 0 (float4 rows)"


_RMS_PROD = [Build("rmsnorm.cu")]
_RMS_LADDER = [Build("ladders/rmsnorm.cu")]

RMSNORM = Ladder(
    name="rmsnorm", title="RMSNorm, fp32 rows in, bf16 out", chapter="04", metric="GB/s",
    source="kernels_cu/ladders/rmsnorm.cu",
    rungs=[
        Rung(1, "rmsnorm_naive", "kernels_cu/rmsnorm.cu", "one thread per row, the row summed serially",
             THREADS, "threads", 128, lambda c, s: _RMS_PROD),
        Rung(2, "rmsnorm_v2_smem_tree", "kernels_cu/ladders/rmsnorm.cu",
             "one block per row, coalesced, tree reduction in shared memory", THREADS, "threads", 256,
             lambda c, s: _RMS_LADDER),
        Rung(3, "rmsnorm", "kernels_cu/rmsnorm.cu", "warp shuffles + 32 floats of shared memory (the engine's)",
             THREADS, "threads", _rmsnorm_default_threads, lambda c, s: _RMS_PROD),
        Rung(4, "rmsnorm_v4_float4", "kernels_cu/ladders/rmsnorm.cu",
             "16-byte loads, the row kept in registers", THREADS, "threads", 256, lambda c, s: _RMS_LADDER, _h4),
        Rung(5, "rmsnorm_v5_warp_row", "kernels_cu/ladders/rmsnorm.cu",
             "one warp per row: no block barrier", THREADS, "threads", 128, lambda c, s: _RMS_LADDER, _h4),
    ],
    cases=[Case("T=5 H=577", {"T": 5, "H": 577}, False), Case("T=37 H=1000", {"T": 37, "H": 1000}, False),
           Case("T=3 H=4100", {"T": 3, "H": 4100}, False),
           Case("T=2047 H=2048 (Llama-3.2-1B prefill)", {"T": 2047, "H": 2048}, True),
           Case("T=2047 H=576 (SmolLM2 prefill)", {"T": 2047, "H": 576}, True)],
    work=lambda p: p["T"] * p["H"] * (4 + 2) + 4 * p["H"],
    tol=lambda p: BF16_TOL / 2,
    make_inputs=_rmsnorm_inputs, launch=_rmsnorm_launch,
    work_note="bytes: x read once (fp32), y written once (bf16), w",
)


# ------------------------------------------------------------------------------------------------
# The attention softmax (chapter 06)
# ------------------------------------------------------------------------------------------------

SOFTMAX_SCALE = 64 ** -0.5


def _softmax_inputs(ctx, p):
    cp = ctx.cp
    H, T = p["H"], p["T"]
    scores = ctx.f32((H, T, T), 4.0)
    rows = _spot_rows(H * T, p)
    got = scores.reshape(H * T, T)[cp.asarray(rows)].get()
    ref = np.zeros((len(rows), T), np.float32)
    for i, r in enumerate(rows):
        t = r % T
        x = got[i, :t + 1] * np.float32(SOFTMAX_SCALE)
        e = np.exp(x - x.max())
        ref[i, :t + 1] = e / e.sum()
    probs = cp.empty((H, T, T), dtype=cp.uint16)
    copies = [{"s": scores}] + [{"s": scores.copy()} for _ in range(n_copies(H * T * T * 4) - 1 if p.get("_timed") else 0)]
    return {"s": scores, "out": probs, "ref": ref, "rows": rows, "copies": copies,
            "result": lambda inp: bf16_to_f32(inp["out"].reshape(H * T, T)[cp.asarray(rows)].get())}


def _softmax_launch(ctx, rung, size, inp, copy):
    H, T, _ = inp["out"].shape
    s, out = copy["s"], inp["out"]
    k = ctx.kernel(rung.builds({}, size)[0], rung.kernel)
    i32, scale = np.int32, np.float32(SOFTMAX_SCALE)
    if rung.version == 1:
        return lambda: k((-(-H * T // size),), (size,), (s, out, i32(H * T), i32(T), scale))
    shared = 4 * size if rung.version == 2 else 0
    return lambda: k((H * T,), (size,), (s, out, i32(T), scale), shared_mem=shared)


def _softmax_default_threads(case):
    T = case["T"]
    return min(1024, max(32, 32 * ((T + 127) // 128)))      # engine/ops/attention.py's launch


_SM_PROD = [Build("attention.cu")]
_SM_LADDER = [Build("ladders/softmax.cu")]

SOFTMAX = Ladder(
    name="softmax", title="causal softmax of prefill attention, fp32 scores in, bf16 probabilities out",
    chapter="06", metric="GB/s", source="kernels_cu/ladders/softmax.cu",
    rungs=[
        Rung(1, "causal_softmax_naive", "kernels_cu/attention.cu", "one thread per row, three serial passes",
             THREADS, "threads", 128, lambda c, s: _SM_PROD),
        Rung(2, "causal_softmax_v2_smem_tree", "kernels_cu/ladders/softmax.cu",
             "one block per row, tree reductions in shared memory", THREADS, "threads", 256, lambda c, s: _SM_LADDER),
        Rung(3, "causal_softmax", "kernels_cu/attention.cu", "warp-shuffle block reductions (the engine's)",
             THREADS, "threads", _softmax_default_threads, lambda c, s: _SM_PROD),
        Rung(4, "causal_softmax_v4_online", "kernels_cu/ladders/softmax.cu",
             "online softmax: max and sum in one pass", THREADS, "threads", 256, lambda c, s: _SM_LADDER),
        Rung(5, "causal_softmax_v5_float4", "kernels_cu/ladders/softmax.cu", "16-byte loads, 8-byte stores",
             THREADS, "threads", 256, lambda c, s: _SM_LADDER,
             lambda c: None if c["T"] % 4 == 0 else "needs T % 4 == 0 (float4 rows)"),
    ],
    cases=[Case("H=3 T=77", {"H": 3, "T": 77}, False), Case("H=2 T=300", {"H": 2, "T": 300}, False),
           Case("H=4 T=260", {"H": 4, "T": 260}, False),
           Case("H=32 T=2048 (Llama-3.2-1B heads, 2k prompt)", {"H": 32, "T": 2048}, True)],
    work=lambda p: 4 * p["H"] * p["T"] * (p["T"] + 1) / 2 + 2 * p["H"] * p["T"] ** 2,
    tol=lambda p: BF16_TOL / 2,
    make_inputs=_softmax_inputs, launch=_softmax_launch,
    work_note="bytes: each row's causal scores read once (fp32), the whole row written once (bf16)",
)


# ------------------------------------------------------------------------------------------------
# Paged decode attention (chapter 11)
# ------------------------------------------------------------------------------------------------

def _attention_config(Hq, Hkv, D):
    from engine.formats.config import config_from_dict
    return config_from_dict({"model_type": "llama", "vocab_size": 10, "hidden_size": Hq * D, "intermediate_size": 8,
                             "num_hidden_layers": 1, "num_attention_heads": Hq, "num_key_value_heads": Hkv,
                             "head_dim": D})


def _paged_inputs(ctx, p):
    cp = ctx.cp
    Hq, Hkv, D, ctxs, BS = p["Hq"], p["Hkv"], p["D"], p["ctxs"], p["BS"]
    S = len(ctxs)
    rng = np.random.default_rng(ctx.seed)
    mb = max(-(-c // BS) for c in ctxs)
    NB = S * mb + 3
    perm = rng.permutation(NB).astype(np.int32)                 # shuffled, non-contiguous pages
    tables = np.full((S, mb), -1, dtype=np.int32)
    for s, c in enumerate(ctxs):
        tables[s, :-(-c // BS)] = perm[s * mb:s * mb + -(-c // BS)]
    kc, vc = ctx.bf16((NB, BS, Hkv, D)), ctx.bf16((NB, BS, Hkv, D))
    qkv = ctx.bf16((S, (Hq + 2 * Hkv) * D))
    pos = np.array(ctxs, dtype=np.int32) - 1
    rows = _spot_rows(S, p)
    q_h = bf16_to_f32(qkv[:, :Hq * D].get()).reshape(S, Hq, D)
    ref = np.empty((len(rows), Hq * D), np.float32)
    for i, r in enumerate(rows):                                 # exact attention of row r over its pages
        n = -(-ctxs[r] // BS)
        pages = cp.asarray(tables[r, :n])
        keys = bf16_to_f32(kc[pages].get()).reshape(-1, Hkv, D)[:ctxs[r]]
        vals = bf16_to_f32(vc[pages].get()).reshape(-1, Hkv, D)[:ctxs[r]]
        qg = q_h[r].reshape(Hkv, Hq // Hkv, D)
        sc = np.einsum("grd,sgd->grs", qg, keys) * np.float32(D ** -0.5)
        e = np.exp(sc - sc.max(-1, keepdims=True))
        ref[i] = np.einsum("grs,sgd->grd", e / e.sum(-1, keepdims=True), vals).reshape(-1)
    kv_bytes = 2 * kc.nbytes
    copies = [{"kc": kc, "vc": vc}] + [{"kc": kc.copy(), "vc": vc.copy()}
                                       for _ in range(n_copies(kv_bytes) - 1 if p.get("_timed") else 0)]
    return {"qkv": qkv, "kc": kc, "vc": vc, "tables": cp.asarray(tables), "seq": cp.arange(S, dtype=cp.int32),
            "pos": cp.asarray(pos), "out": cp.empty((S, Hq * D), dtype=cp.uint16), "ref": ref, "rows": rows,
            "copies": copies, "cfg": _attention_config(Hq, Hkv, D), "max_ctx": max(ctxs),
            "result": lambda inp: bf16_to_f32(inp["out"][cp.asarray(rows)].get())}


def _paged_launch(ctx, rung, size, inp, copy):
    cp = ctx.cp
    cfg = inp["cfg"]
    Hq, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    R = inp["qkv"].shape[0]
    splits = size if rung.version == 6 else 1
    warps = 4 if rung.version == 6 else size
    if splits > 1:
        part_ml = cp.empty((R, Hq, splits, 2), dtype=cp.float32)
        part_acc = cp.empty((R, Hq, splits, D), dtype=cp.float32)
    else:
        part_ml = part_acc = cp.empty(1, dtype=cp.float32)
    qkv, out = inp["qkv"], inp["out"]
    args = (qkv, np.int64(qkv.shape[1]), copy["kc"], copy["vc"], inp["tables"], np.int32(inp["tables"].shape[1]),
            inp["seq"], inp["pos"], np.int32(copy["kc"].shape[1]), np.int32(Hkv),
            np.float32(D ** -0.5 * np.log2(np.e)), out, np.int64(Hq * D), part_ml, part_acc)
    build = rung.builds({"D": D, "Hq": Hq, "Hkv": Hkv}, size)[0]
    k = ctx.kernel(build, rung.kernel)
    if splits == 1:
        return lambda: k((R, Hkv, 1), (32 * warps,), args)
    merge = ctx.kernel(build, "paged_attention_merge")

    def run():
        k((R, Hkv, splits), (32 * warps,), args)
        merge((R, Hq), (D,), (part_ml, part_acc, np.int32(splits), out, np.int64(Hq * D)))
    return run


def _paged_defines(c, warps=None):
    d = [("GROUP", c["Hq"] // c["Hkv"]), ("HEAD_DIM", c["D"])]
    return tuple(d + ([("NWARPS", warps)] if warps is not None else []))


def _paged_default_splits(case):
    if not _CTX_SMS[0]:
        return None
    from engine.ops.paged_attention import choose_splits
    return choose_splits(len(case["ctxs"]), case["Hkv"], max(case["ctxs"]), _CTX_SMS[0])


_CTX_SMS = [0]       # the SM count of the GPU in use (set when a ladder runs): the engine's split choice needs it
_SOLUTION = "exercises/solutions/paged_attention.cu"

PAGED = Ladder(
    name="paged_attention", title="paged decode attention, bf16 KV cache in shuffled pages", chapter="11",
    metric="GB/s", source="kernels_cu/ladders/paged_attention.cu",
    rungs=[
        Rung(1, "paged_attention", "kernels_cu/exercises/solutions/paged_attention.cu",
             "chapter 11's solution: a warp per query head, a lane per dimension, a key at a time",
             (1, 2, 4), "warps", 4, lambda c, s: [Build(_SOLUTION, _paged_defines(c, s))]),
        Rung(2, "paged_attention_v2_vec", "kernels_cu/ladders/paged_attention.cu",
             "16-byte lanes: several keys per warp step", (1, 2, 4), "warps", 4,
             lambda c, s: [Build("ladders/paged_attention.cu", _paged_defines(c))]),
        Rung(3, "paged_attention_v3_gqa", "kernels_cu/ladders/paged_attention.cu",
             "K/V loaded once for the GQA group, warps split the keys", (1, 2, 4, 8), "warps", 4,
             lambda c, s: [Build("ladders/paged_attention.cu", _paged_defines(c))]),
        Rung(4, "paged_attention", "kernels_cu/paged_attention.cu",
             "cp.async pipeline through shared memory (the engine's, CUDA cores)", (2, 4, 8), "warps", 4,
             lambda c, s: [Build("paged_attention.cu", _paged_defines(c, s))]),
        Rung(5, "paged_attention_tc", "kernels_cu/paged_attention.cu",
             "the GQA group on the tensor cores (the engine's on sm_80+)", (1, 2, 4), "warps", 4,
             lambda c, s: [Build("paged_attention.cu", _paged_defines(c, s), 80)], sm80=True),
        Rung(6, "paged_attention_tc", "kernels_cu/paged_attention.cu",
             "split-K: the context in slices + paged_attention_merge (4 warps)", (1, 2, 4, 8, 16, 32), "splits",
             _paged_default_splits, lambda c, s: [Build("paged_attention.cu", _paged_defines(c, 4), 80)], sm80=True),
    ],
    cases=[Case("Hq=8 Hkv=2 D=64 BS=7 ctx=[1,17,200,33,64]",
                {"Hq": 8, "Hkv": 2, "D": 64, "ctxs": [1, 17, 200, 33, 64], "BS": 7}, False),
           Case("Hq=8 Hkv=2 D=64 BS=16 ctx=[5,300,1000]", {"Hq": 8, "Hkv": 2, "D": 64, "ctxs": [5, 300, 1000], "BS": 16},
                False),
           Case("64 x 2048 keys (serving batch, Llama-3.2-1B heads)",
                {"Hq": 32, "Hkv": 8, "D": 64, "ctxs": [2048] * 64, "BS": 16}, True),
           Case("4 x 8192 keys (few long sequences)", {"Hq": 32, "Hkv": 8, "D": 64, "ctxs": [8192] * 4, "BS": 16}, True)],
    work=lambda p: sum(p["ctxs"]) * p["Hkv"] * p["D"] * 2 * 2,
    tol=lambda p: BF16_TOL,
    make_inputs=_paged_inputs, launch=_paged_launch,
    work_note="bytes: every key and value of the context read once (bf16)",
)


# ------------------------------------------------------------------------------------------------
# GEMV (chapter 14)
# ------------------------------------------------------------------------------------------------

def _gemv_inputs(ctx, p):
    cp = ctx.cp
    T, N, K = p["T"], p["N"], p["K"]
    w, x = ctx.bf16((N, K), K ** -0.5), ctx.bf16((T, K))
    x64 = bf16_to_f32(x.get()).astype(np.float64)
    w_h = w.get()
    ref = np.concatenate([x64 @ bf16_to_f32(w_h[i:i + 8192]).astype(np.float64).T for i in range(0, N, 8192)], axis=1)
    copies = [{"w": w}] + [{"w": w.copy()} for _ in range(n_copies(2 * N * K) - 1 if p.get("_timed") else 0)]
    return {"x": x, "w": w, "out": cp.empty((T, N), dtype=cp.float32), "ref": ref, "rows": list(range(T)),
            "copies": copies, "result": lambda inp: inp["out"].get()}


def _gemv_launch(ctx, rung, size, inp, copy):
    x, w, out = inp["x"], copy["w"], inp["out"]
    T, K = x.shape
    N = w.shape[0]
    i32 = np.int32
    if rung.version == "ref":
        from engine.backend import matmul
        return lambda: matmul(x, w, out, trans_b=True)
    k = ctx.kernel(rung.builds({}, size)[0], rung.kernel)
    args = (x, w, out, i32(T), i32(N), i32(K))
    if rung.version == 1:
        return lambda: k((-(-N // size),), (size,), args)
    if rung.version in (2, 3):
        return lambda: k((-(-N // (size // 32)),), (size,), args)
    if rung.version == 4:
        return lambda: k((-(-N // (4 * (size // 32))),), (size,), args)
    if rung.version == 5:
        return lambda: k((-(-N // 4),), (size,), args)
    from engine.ops.gemv import TILE_N
    shared = 0 if size == 1 else 32 * 16 * size
    return lambda: k((-(-N // TILE_N),), (32 * size,),
                     (x, np.int64(K), w, np.int64(K), out, np.int64(N), i32(T), i32(N), i32(K)), shared_mem=shared)


def _gemv_default_warps(case):
    if not _CTX_SMS[0]:
        return None
    from engine.ops.gemv import launch_geometry
    return launch_geometry(case["N"], case["K"], _CTX_SMS[0])[1]


def _k8(case):
    return None if case["K"] % 8 == 0 else "needs K % 8 == 0 (16-byte rows)"


def _gemv_prod_builds(case, size):
    from engine.ops import gemv
    return [Build("gemv.cu", (("GEMV_MAX_ROWS", gemv.GEMV_MAX_ROWS), ("NWARPS", gemv.NWARPS), ("UNROLL", gemv.UNROLL)), 80)]


_GEMV_LADDER = [Build("ladders/gemv.cu")]
_THREADS_512 = (32, 64, 128, 256, 512)      # v4, v5 use ~120 registers per thread: 512 threads at most

GEMV = Ladder(
    name="gemv", title="decode GEMV, out fp32 [T, N] = x bf16 [T, K] @ W bf16 [N, K]^T", chapter="14", metric="GB/s",
    source="kernels_cu/ladders/gemv.cu",
    rungs=[
        Rung(1, "gemv_v1_thread", "kernels_cu/ladders/gemv.cu", "one thread per output, walking its row of W",
             THREADS, "threads", 256, lambda c, s: _GEMV_LADDER),
        Rung(2, "gemv_v2_warp", "kernels_cu/ladders/gemv.cu", "one warp per output: coalesced 2-byte loads",
             THREADS, "threads", 256, lambda c, s: _GEMV_LADDER),
        Rung(3, "gemv_v3_vec16", "kernels_cu/ladders/gemv.cu", "16-byte loads (8 bf16 per lane)",
             THREADS, "threads", 256, lambda c, s: _GEMV_LADDER, _k8),
        Rung(4, "gemv_v4_rows", "kernels_cu/ladders/gemv.cu", "4 outputs per warp, 8 loads in flight per lane",
             _THREADS_512, "threads", 256, lambda c, s: _GEMV_LADDER, _k8),
        Rung(5, "gemv_v5_splitk", "kernels_cu/ladders/gemv.cu", "the block's warps split K of the same 4 outputs",
             _THREADS_512, "threads", 256, lambda c, s: _GEMV_LADDER, _k8),
        Rung(6, "gemv_bf16", "kernels_cu/gemv.cu", "tensor cores, streaming loads, the split sized for the SMs "
             "(the engine's)", (1, 2, 4, 8, 16), "warps", _gemv_default_warps, _gemv_prod_builds, _k8, sm80=True),
        Rung("ref", "gemmEx (cuBLAS)", "engine/backend.py matmul", "cuBLAS on the same shapes, for comparison",
             (None,), "cuBLAS"),
    ],
    cases=[Case("T=1 N=1001 K=584", {"T": 1, "N": 1001, "K": 584}, False),
           Case("T=3 N=67 K=1032", {"T": 3, "N": 67, "K": 1032}, False),
           Case("T=8 N=1001 K=584", {"T": 8, "N": 1001, "K": 584}, False),
           Case("T=2 N=77 K=50", {"T": 2, "N": 77, "K": 50}, False),
           Case("gate_up T=1 N=16384 K=2048 (Llama-3.2-1B)", {"T": 1, "N": 16384, "K": 2048}, True),
           Case("down T=1 N=2048 K=8192 (Llama-3.2-1B)", {"T": 1, "N": 2048, "K": 8192}, True),
           Case("gate_up T=8 N=16384 K=2048 (8 sequences)", {"T": 8, "N": 16384, "K": 2048}, True)],
    work=lambda p: 2 * p["N"] * p["K"] + 2 * p["T"] * p["K"] + 4 * p["T"] * p["N"],
    tol=lambda p: 1e-5 * max(1.0, p["K"] / 2048),
    make_inputs=_gemv_inputs, launch=_gemv_launch,
    work_note="bytes: W read once (bf16), x, out (fp32); W copies cycled so that no pass reads it from L2",
)


# ------------------------------------------------------------------------------------------------
# Flash prefill attention (chapter 13)
# ------------------------------------------------------------------------------------------------

FLASH_SIZES = ((2, 64), (4, 32), (4, 64), (4, 128), (8, 64))     # (warps, keys per tile) of the engine's kernel


def _flash_inputs(ctx, p):
    cp = ctx.cp
    Hq, Hkv, D, T = p["Hq"], p["Hkv"], p["D"], p["T"]
    qkv = ctx.bf16((T, (Hq + 2 * Hkv) * D))
    rows = _spot_rows(T, p)
    h = bf16_to_f32(qkv.get())
    q = h[:, :Hq * D].reshape(T, Hq, D)
    k = h[:, Hq * D:(Hq + Hkv) * D].reshape(T, Hkv, D)
    v = h[:, (Hq + Hkv) * D:].reshape(T, Hkv, D)
    ref = np.empty((len(rows), Hq * D), np.float32)
    for i, r in enumerate(rows):                                   # exact causal attention of query row r
        qg = q[r].reshape(Hkv, Hq // Hkv, D)
        sc = np.einsum("grd,sgd->grs", qg, k[:r + 1]) * np.float32(D ** -0.5)
        e = np.exp(sc - sc.max(-1, keepdims=True))
        ref[i] = np.einsum("grs,sgd->grd", e / e.sum(-1, keepdims=True), v[:r + 1]).reshape(-1)
    cu = np.array([0, T], dtype=np.int32)
    return {"qkv": qkv, "out": cp.empty((T, Hq * D), dtype=cp.uint16), "ref": ref, "rows": rows,
            "copies": [{}], "cfg": _attention_config(Hq, Hkv, D), "cu": cu, "cu_dev": cp.asarray(cu),
            "pos": cp.arange(T, dtype=cp.int32),
            "result": lambda inp: bf16_to_f32(inp["out"][cp.asarray(rows)].get())}


def _flash_launch(ctx, rung, size, inp, copy):
    cfg, qkv, out = inp["cfg"], inp["qkv"], inp["out"]
    Hq, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    T, ld = qkv.shape
    scale_log2e = np.float32(D ** -0.5 * np.log2(np.e))
    if rung.version == 1:
        from engine.ops.attention import prefill_attention

        def run():
            out[...] = prefill_attention(qkv, inp["cu"], cfg)
        return run
    k = ctx.kernel(rung.builds({"D": D}, size)[0], rung.kernel)
    if rung.version in (2, 3):
        return lambda: k((-(-T // size), Hq), (size,),
                         (qkv, np.int64(ld), np.int32(T), np.int32(Hq), np.int32(Hkv), scale_log2e, out))
    warps, _ = size
    cu = inp["cu_dev"]
    return lambda: k((Hq, -(-T // (16 * warps)), 1), (32 * warps,),
                     (qkv, np.int64(ld), qkv, qkv, np.int64(ld), np.int32(Hq * D), np.int32((Hq + Hkv) * D),
                      cu, inp["pos"], cu, np.int32(0), np.int32(1), np.int32(Hq // Hkv), scale_log2e, out,
                      np.int64(Hq * D)))


def _flash_prod_builds(case, size):
    warps, block_n = size
    return [Build("flash_attention.cu", (("BLOCK_N", block_n), ("HEAD_DIM", case.get("D", 64)), ("NWARPS", warps),
                                         ("PAGED", 0)), 80)]


FLASH = Ladder(
    name="flash_attention", title="causal prefill attention of one prompt, bf16 qkv in, bf16 out", chapter="13",
    metric="TFLOP/s", source="kernels_cu/ladders/flash_attention.cu",
    rungs=[
        Rung(1, "prefill_attention", "engine/ops/attention.py",
             "chapter 06: cuBLAS Q K^T, causal softmax kernel, cuBLAS P V (T x T scores in memory)",
             (None,), "cuBLAS + softmax", builds=lambda c, s: [Build("attention.cu")]),
        Rung(2, "flash_v2_thread_row", "kernels_cu/ladders/flash_attention.cu",
             "no score matrix: a thread per (row, head), online softmax over global memory", (32, 64, 128, 256),
             "threads", 128, lambda c, s: [Build("ladders/flash_attention.cu", (("HEAD_DIM", c.get("D", 64)),))]),
        Rung(3, "flash_v3_smem_tiles", "kernels_cu/ladders/flash_attention.cu",
             "K/V tiles shared by the block in shared memory, one rescale per 16 keys", (32, 64, 128, 256),
             "threads", 128, lambda c, s: [Build("ladders/flash_attention.cu", (("HEAD_DIM", c.get("D", 64)),))]),
        Rung(4, "flash_attention", "kernels_cu/flash_attention.cu",
             "tensor cores (mma.sync, ldmatrix), cp.async double buffering (the engine's)", FLASH_SIZES,
             "warps x keys", (4, 64), _flash_prod_builds, sm80=True),
    ],
    cases=[Case("Hq=4 Hkv=2 D=64 T=77", {"Hq": 4, "Hkv": 2, "D": 64, "T": 77}, False),
           Case("Hq=6 Hkv=2 D=64 T=130", {"Hq": 6, "Hkv": 2, "D": 64, "T": 130}, False),
           Case("Hq=32 Hkv=8 D=64 T=4096 (Llama-3.2-1B heads, 4k prompt)", {"Hq": 32, "Hkv": 8, "D": 64, "T": 4096}, True)],
    work=lambda p: 4 * p["Hq"] * p["D"] * p["T"] * (p["T"] + 1) / 2,
    tol=lambda p: BF16_TOL,
    make_inputs=_flash_inputs, launch=_flash_launch,
    work_note="flops: Q K^T and P V over the causal triangle",
)

LADDERS: dict[str, Ladder] = {lad.name: lad for lad in (RMSNORM, SOFTMAX, PAGED, FLASH, GEMV)}


def _spot_rows(n: int, p: dict) -> list[int]:
    """Rows to check: all of a small case; of a timed one, the first, the last and 30 in between."""
    if not p.get("_timed") or n <= 64:
        return list(range(n))
    rng = np.random.default_rng(n)
    return sorted({0, n - 1, *rng.choice(n, 30, replace=False).tolist()})


# ------------------------------------------------------------------------------------------------
# Running a ladder on the GPU
# ------------------------------------------------------------------------------------------------

def run_ladder(ctx: Ctx, ladder: Ladder, *, sweep: bool = True, timed: bool = True, small_only: bool = False,
               log=print, after_case=None) -> list[dict]:
    """Check every rung at every size (only its default size without `sweep`) on every case (only the
    small, checked-only ones with `small_only`), and time the timed cases; one row per (case, rung,
    size). `after_case(rows)` runs after each case."""
    from engine.backend import tensor_cores_usable
    cp = ctx.cp
    tc = tensor_cores_usable(cp.cuda.Device().id)
    rows: list[dict] = []
    for case in ladder.cases:
        if small_only and case.timed:
            continue
        params = {**case.params, "_timed": case.timed}
        inp = ladder.make_inputs(ctx, params)
        work, tol = ladder.work(case.params), ladder.tol(case.params)
        case_rows = []
        for rung in ladder.rungs:
            default = rung.default_size(case.params)
            sizes = list(rung.sizes) if sweep else []
            if default is not None and default not in sizes:   # the launcher's own pick is always measured
                sizes.append(default)
            sizes = sizes or [rung.sizes[0]]
            for size in sizes:
                row = {"case": case.label, "timed": case.timed, "version": rung.version, "kernel": rung.kernel,
                       "size": list(size) if isinstance(size, tuple) else size, "block": rung.block_label(size),
                       "default": size == default, "tol": tol}
                reason = rung.needs(case.params) or (None if tc or not rung.sm80 else "needs sm_80+ (mma.sync)")
                if reason:
                    rows.append({**row, "skipped": reason})
                    continue
                try:
                    fns = [ladder.launch(ctx, rung, size, inp, c) for c in inp["copies"]]
                    poison(cp, inp["out"])
                    fns[0]()
                    cp.cuda.get_current_stream().synchronize()
                    err = rel_err(inp["result"](inp), inp["ref"])
                    row.update(rel_err=err, ok=bool(err <= tol))
                    if timed and case.timed:
                        us = time_us(cp, fns)
                        row["us"] = round(us, 3)
                        rate = work / (us * 1e-6)
                        if ladder.metric == "GB/s":
                            row["gbps"] = round(rate / 1e9, 1)
                            row["pct"] = round(100 * row["gbps"] / ctx.copy_gbps, 1)
                        else:
                            row["tflops"] = round(rate / 1e12, 2)
                            if ctx.gemm_tflops:
                                row["pct"] = round(100 * row["tflops"] / ctx.gemm_tflops, 1)
                except Exception as exc:      # one broken rung or size must not hide the rest
                    cp.cuda.Device().synchronize()
                    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                    if "OUT_OF_RESOURCES" in first or "too many resources" in first:
                        # the kernel's registers per thread x this block size exceed the SM's register file:
                        # a limit of the block size, not a wrong kernel
                        rows.append({**row, "skipped": "too many registers per thread for this block size"})
                        continue
                    row.update(ok=False, error=f"{type(exc).__name__}: {first}"[:200])
                case_rows.append(row)
                rows.append(row)
        _add_speedups(case_rows)
        if log is not None:
            bad = [r for r in case_rows if not r.get("ok")]
            log(f"  {ladder.name} [{case.label}]: {len(case_rows) - len(bad)}/{len(case_rows)} checks ok"
                + "".join(f"\n    FAIL v{r['version']} {r['kernel']} {r['block']}: {_failure(r)}" for r in bad))
        del inp
        cp.get_default_memory_pool().free_all_blocks()
        if after_case is not None:
            after_case(rows)
    return rows


def _failure(row: dict) -> str:
    return row.get("error") or f"rel_err {row['rel_err']:.3g} > tol {row['tol']:.3g}"


def _add_speedups(rows: list[dict]) -> None:
    """speedup = the fastest time of the lowest timed version / this row's time; `best` marks each
    version's fastest block size."""
    timed = [r for r in rows if "us" in r]
    if not timed:
        return
    numbered = [r for r in timed if isinstance(r["version"], int)]
    base_v = min((r["version"] for r in numbered), default=None)
    base = min((r["us"] for r in numbered if r["version"] == base_v), default=None)
    for r in timed:
        r["speedup"] = round(base / r["us"], 2) if base else None
    for v in {str(r["version"]) for r in timed}:
        best = min((r for r in timed if str(r["version"]) == v), key=lambda r: r["us"])
        best["best"] = True


def measure(names: list[str], *, sweep: bool = True, log=print, checkpoint=None) -> dict:
    """Run the named ladders on this GPU; the run as a JSON-able dict (SCHEMA). `checkpoint(run)`
    gets the run so far after every case (a run cut short still leaves its finished cases)."""
    from engine.backend import copy_bandwidth, gemm_tflops, gpu_name, resolve_backend, sm_count
    backend = resolve_backend("cupy")
    import cupy as cp
    _CTX_SMS[0] = sm_count(cp.cuda.Device().id)
    ctx = Ctx(cp, copy_gbps=copy_bandwidth(backend), sms=_CTX_SMS[0])
    if any(LADDERS[n].metric == "TFLOP/s" for n in names):
        ctx.gemm_tflops = gemm_tflops(backend)
    log(f"device: {gpu_name()} ({ctx.sms} SMs), measured copy bandwidth {ctx.copy_gbps:,.0f} GB/s"
        + (f", bf16 GEMM {ctx.gemm_tflops:,.0f} TFLOP/s" if ctx.gemm_tflops else ""))
    run = {"schema": SCHEMA, "device": gpu_name(), "date": datetime.date.today().isoformat(),
           "sms": ctx.sms, "copy_gbps": round(ctx.copy_gbps, 1),
           "gemm_tflops": round(ctx.gemm_tflops, 1) if ctx.gemm_tflops else None,
           "cuda_runtime": cp.cuda.runtime.runtimeGetVersion(), "cupy": cp.__version__,
           "command": "python -m engine.kernel_bench --ladder " + " ".join(names), "ladders": []}
    for name in names:
        lad = LADDERS[name]
        entry = describe(lad) | {"copy_gbps": run["copy_gbps"], "gemm_tflops": run["gemm_tflops"], "rows": []}
        run["ladders"].append(entry)
        rows = run_ladder(ctx, lad, sweep=sweep, log=log,
                          after_case=None if checkpoint is None else
                          lambda rows, entry=entry: (entry.update(rows=rows), checkpoint(run)))
        entry["rows"] = rows
    return run


def merge_runs(runs: list[dict]) -> dict:
    """One run of the ladders of several runs on the same GPU (one process per ladder: a crash or a
    timeout in one loses only its own). Each ladder keeps the copy bandwidth and GEMM rate measured
    in its own process."""
    runs = [validate_run(r) for r in runs]
    if not runs:
        raise RecordedRunError("no runs to merge")
    devices = {r["device"] for r in runs}
    if len(devices) != 1:
        raise RecordedRunError(f"runs from different GPUs: {sorted(devices)}")
    merged = {k: v for k, v in runs[0].items() if k != "ladders"}
    merged["ladders"] = [lad for r in runs for lad in r["ladders"]]
    merged["gemm_tflops"] = next((r["gemm_tflops"] for r in runs if r.get("gemm_tflops")), None)
    merged["command"] = "python -m engine.kernel_bench --ladder " + " ".join(lad["name"] for lad in merged["ladders"])
    return merged


def describe(lad: Ladder) -> dict:
    timed = [c for c in lad.cases if c.timed]
    return {"name": lad.name, "title": lad.title, "chapter": lad.chapter, "metric": lad.metric, "source": lad.source,
            "work": lad.work_note,
            "rungs": [{"version": r.version, "kernel": r.kernel, "origin": r.origin, "what": r.what, "unit": r.unit,
                       "sizes": [list(s) if isinstance(s, tuple) else s for s in r.sizes],
                       "engine_default": {c.label: _jsonable(r.default_size(c.params)) for c in timed}}
                      for r in lad.rungs]}


def _jsonable(v):
    return list(v) if isinstance(v, tuple) else v


# ------------------------------------------------------------------------------------------------
# The table (the same for a run measured here and for a recorded one)
# ------------------------------------------------------------------------------------------------

ROW_KEYS = {"case", "timed", "version", "kernel", "block"}
LADDER_KEYS = {"name", "title", "chapter", "metric", "rungs", "rows"}
RUN_KEYS = {"schema", "device", "date", "copy_gbps", "ladders"}


class RecordedRunError(ValueError):
    """A recorded ladder file that does not follow SCHEMA (the message names what is missing)."""


def validate_run(run: dict) -> dict:
    if not isinstance(run, dict) or run.get("schema") != SCHEMA:
        raise RecordedRunError(f"not a kernel-ladder run (schema {run.get('schema') if isinstance(run, dict) else None!r},"
                               f" expected {SCHEMA!r})")
    missing = RUN_KEYS - run.keys()
    if missing:
        raise RecordedRunError(f"the run lacks {sorted(missing)}")
    for lad in run["ladders"]:
        missing = LADDER_KEYS - lad.keys()
        if missing:
            raise RecordedRunError(f"ladder {lad.get('name')!r} lacks {sorted(missing)}")
        for row in lad["rows"]:
            missing = ROW_KEYS - row.keys()
            if missing:
                raise RecordedRunError(f"a row of ladder {lad['name']!r} lacks {sorted(missing)}")
    return run


def format_ladder(lad: dict, run: dict) -> str:
    """The ladder's tables: one per timed case (every version at every block size; * its best), then
    one line per checked-only case."""
    rate, pct = ("GB/s", "%copy") if lad["metric"] == "GB/s" else ("TFLOP/s", "%gemm")
    copy_gbps = lad.get("copy_gbps") or run["copy_gbps"]
    gemm = lad.get("gemm_tflops") or run.get("gemm_tflops")
    ceiling = (f"measured copy bandwidth {copy_gbps:,.0f} GB/s" if lad["metric"] == "GB/s"
               else f"measured bf16 GEMM rate {gemm:,.0f} TFLOP/s" if gemm else "bf16 GEMM rate not measured")
    lines = [f"== {lad['name']} (chapter {lad['chapter']}): {lad['title']}"]
    for r in lad["rungs"]:
        tag = f"v{r['version']}" if isinstance(r["version"], int) else r["version"]
        lines.append(f"   {tag:<4} {r['kernel']:<24} {r['what']}  [{r['origin']}]")
    cases: dict[str, list[dict]] = {}
    for row in lad["rows"]:
        cases.setdefault(row["case"], []).append(row)
    for label, rows in cases.items():
        if not rows[0]["timed"]:
            continue
        lines.append(f"-- {label}; ceiling: {ceiling}" + (f"; {lad['work']}" if lad.get("work") else ""))
        lines.append(f"   {'v':<4} {'kernel':<24} {'block':<17} {'us':>10} {rate:>8} {pct:>6} {'vs v1':>7}  check")
        for row in rows:
            tag = f"v{row['version']}" if isinstance(row["version"], int) else str(row["version"])
            mark = "*" if row.get("best") else " "
            if "skipped" in row:
                lines.append(f"   {tag:<4} {row['kernel']:<24} {row['block']:<17} {'n/a: ' + row['skipped']}")
                continue
            if "error" in row:
                lines.append(f"   {tag:<4} {row['kernel']:<24} {row['block']:<17} FAILED: {row['error']}")
                continue
            value = row.get("gbps", row.get("tflops"))
            us = f"{row['us']:,.2f}" if "us" in row else "-"
            lines.append(f"  {mark}{tag:<4} {row['kernel']:<24} {row['block']:<17} {us:>10} "
                         f"{'-' if value is None else f'{value:,.1f}':>8} {row.get('pct', '-'):>6} "
                         f"{(str(row['speedup']) + 'x') if row.get('speedup') else '-':>7}  "
                         f"{'ok' if row.get('ok') else 'WRONG'} {row.get('rel_err', float('nan')):.1e}"
                         + ("  default" if row.get("default") else ""))
    if any(r["timed"] for r in lad["rows"]):
        lines.append("   * the version's fastest block size; default: the size its launcher uses (the engine's, for the "
                     "engine's kernels); vs v1: v1's fastest time / this time; check: rel. error vs the NumPy reference")
    checks = [(label, rows) for label, rows in cases.items() if not rows[0]["timed"]]
    for label, rows in checks:
        ran = [r for r in rows if "skipped" not in r]
        bad = [r for r in ran if not r.get("ok")]
        skipped = sorted({f"v{r['version']}" for r in rows if "skipped" in r})
        lines.append(f"   check {label}: {len(ran) - len(bad)}/{len(ran)} ok"
                     + (f" (n/a: {', '.join(skipped)})" if skipped else "")
                     + "".join(f"; WRONG v{r['version']} {r['block']}" for r in bad))
    return "\n".join(lines)


def show_recorded(names: list[str], path: Path = RECORDED) -> int:
    """Print the recorded run's tables for `names`, labelled as recorded; say so when there is none."""
    if not path.is_file():
        print(f"No recorded run of the kernel ladders: {_rel(path)} does not exist. {HOW_TO_RECORD}.")
        return 0
    try:
        run = validate_run(json.loads(path.read_text()))
    except (json.JSONDecodeError, RecordedRunError) as exc:
        print(f"{_rel(path)} is not a usable ladder run: {exc}", file=sys.stderr)
        return 1
    print(f"RECORDED run, not measured on this machine: {run['device']}, {run['date']} ({_rel(path)}; "
          f"{run.get('command', '')})")
    by_name = {lad["name"]: lad for lad in run["ladders"]}
    for name in names:
        if name not in by_name:
            print(f"(the recorded run has no {name!r} ladder)")
            continue
        print(format_ladder(by_name[name], run))
    return 0


def _rel(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return str(path)


# ------------------------------------------------------------------------------------------------
# Compiling every rung, with or without a GPU
# ------------------------------------------------------------------------------------------------

def all_builds(names: list[str] | None = None) -> list[Build]:
    seen: dict[Build, None] = {}
    for name in names or list(LADDERS):
        for b in LADDERS[name].builds():
            seen.setdefault(b, None)
    return list(seen)


def compiler() -> str | None:
    """'nvrtc' or 'nvcc' (whichever is here; no GPU needed), or None."""
    tool = gpu_compile.compiler()
    return None if tool is None else tool.lower()


def compile_build(build: Build, arch: int = 90, tool: str | None = None) -> str:
    """'' when `build` compiles for sm_`arch`, else the compiler's log (file and line)."""
    tool = tool or compiler()
    path = KERNELS_DIR / build.source
    defines = [f"-D{k}={v}" for k, v in build.defines]
    # kernels_cu/ and the file's own folder on the include path (its "../common.cuh"), as nvcc gives it
    includes = [f"-I{KERNELS_DIR}", f"-I{path.parent}"]
    if tool == "nvrtc":
        opts = ["-std=c++17", "--use_fast_math", f"--gpu-architecture=compute_{arch}", *includes,
                f"-I{gpu_compile.cuda_include()}", *defines]
        return gpu_compile.nvrtc_log(path.read_text(), opts, str(path)) or ""
    if tool == "nvcc":
        opts = ["-std=c++17", "--use_fast_math", f"-arch=sm_{arch}", *includes, *defines]
        return gpu_compile.nvcc_log(path.read_text(), opts, str(path)) or ""
    raise RuntimeError("no CUDA compiler here (neither NVRTC with the CUDA headers nor nvcc)")


def compile_check(names: list[str], arch: int = 90) -> int:
    """Compile every build of the named ladders; print one line, or each failure with its log."""
    tool = compiler()
    builds = all_builds(names)
    if tool is None:
        print(f"compile check skipped: no CUDA compiler here (NVRTC with the CUDA headers, or nvcc) for the "
              f"{len(builds)} builds of the ladders")
        return 0
    with ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 1))) as pool:
        logs = list(pool.map(lambda b: compile_build(b, arch, tool), builds))
    bad = [(b, log) for b, log in zip(builds, logs) if log]
    n_rungs = sum(len(LADDERS[n].rungs) for n in names)
    print(f"compiled {len(builds) - len(bad)}/{len(builds)} builds of the {n_rungs} rungs for sm_{arch} with {tool}"
          + ("" if not bad else ": FAILED"))
    for b, log in bad:
        print(f"  {b.label()}:\n" + "\n".join("    " + ln for ln in log.strip().splitlines()[:20]))
    return 1 if bad else 0


# ------------------------------------------------------------------------------------------------
# The command
# ------------------------------------------------------------------------------------------------

def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--ladder", nargs="+", metavar="NAME", choices=[*LADDERS, "all"],
                    help=f"run the kernel ladders ({', '.join(LADDERS)} or all): check and time every version "
                         "at every block size; without a GPU, compile them and show the recorded run")
    ap.add_argument("--recorded", type=Path, default=RECORDED, help="the recorded run shown without a GPU")
    ap.add_argument("--no-compile", action="store_true", help="without a GPU: skip the compile check")
    ap.add_argument("--no-sweep", action="store_true", help="each version at its default block size only")


def run_command(args) -> int:
    names = list(LADDERS) if "all" in args.ladder else list(dict.fromkeys(args.ladder))
    from engine.backend import cupy_unavailable_reason
    reason = cupy_unavailable_reason()
    if reason is not None:
        print(f"No GPU here: {reason} Compiling every version, then the recorded GPU run.")
        status = 0 if args.no_compile else compile_check(names)
        return show_recorded(names, args.recorded) or status
    def write(run):
        if args.json:
            Path(args.json).write_text(json.dumps(run, indent=1) + "\n")
    run = measure(names, sweep=not args.no_sweep, checkpoint=write)
    for lad in run["ladders"]:
        print(format_ladder(lad, run))
    write(run)
    if args.json:
        print(f"wrote {args.json}")
    rows = [r for lad in run["ladders"] for r in lad["rows"] if "skipped" not in r]
    return 1 if any(not r.get("ok") for r in rows) else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(ap)
    ap.add_argument("--json", default=None, help=f"write the run (schema {SCHEMA}) to this file")
    ap.add_argument("--merge", nargs="+", type=Path, metavar="RUN.json",
                    help="merge runs of single ladders (same GPU) into the --json file, then show it")
    args = ap.parse_args(argv)
    if args.merge:
        if not args.json:
            ap.error("--merge needs --json OUT (the merged run)")
        run = merge_runs([json.loads(p.read_text()) for p in args.merge if p.is_file()])
        Path(args.json).write_text(json.dumps(run, indent=1) + "\n")
        print(f"merged {len(run['ladders'])} ladders into {args.json}: {', '.join(lad['name'] for lad in run['ladders'])}")
        return 0
    if not args.ladder:
        args.ladder = ["all"]
    return run_command(args)


if __name__ == "__main__":
    sys.exit(main())
