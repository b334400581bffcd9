"""`python -m engine.kernel_bench`: every CUDA kernel checked against its NumPy reference, then timed.

In the style of llm.c's dev/cuda: fresh random inputs of awkward shapes (not powers of two, GQA
ratios 1, 3, 4, 8), outputs poisoned before each run (NaN bits: an unwritten element fails the
check), relative error ||out - ref|| / ||ref|| against a float32/float64 reference computed from the
same bf16-rounded inputs, then CUDA-event timing after warm-up (median of many runs) and the
achieved bandwidth next to the device's measured copy bandwidth. Prints a table, writes JSON lines.
The `ladder` case times each version of a stage that keeps its first, naive kernel beside the fast
one (RMSNorm, the prefill softmax, paged attention), checked the same way: the chapters show it.
The `gemv` group puts the decode GEMV (kernels_cu/gemv.cu) beside cuBLAS on the decode projections
(1..8 rows), both timed from CUDA graphs that cycle over copies of W (no launch gaps, no L2 hits);
the `quant_gemv` group the int4 and int8 GEMV (kernels_cu/quant_gemv.cu) beside it at batch 1.

    python -m engine.kernel_bench [--json out.jsonl] [--quick] [--check-only] [--only GROUP ...]
    python -m engine.kernel_bench --ladder rmsnorm|softmax|paged_attention|flash_attention|gemv|all [--json run.json]

--check-only runs every check once and times nothing: the mode for `compute-sanitizer`, which
slows each launch down by orders of magnitude.
--ladder runs the numbered kernel ladders of engine/bench/ladder.py (kernels_cu/ladders/): every
version checked and timed at every block size of its sweep; without a GPU it compiles every version
and shows the recorded H200 run. The `ladders` group checks every version at its default block size.
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys

import numpy as np

from engine.backend import bf16_to_f32, copy_bandwidth, f32_to_bf16, gemm_tflops, matmul, resolve_backend

BF16_TOL = 1e-2      # bf16 operands (8 significant bits), fp32 accumulation
F32_TOL = 1e-5


def rel_err(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    if not np.all(np.isfinite(out)):
        return float("inf")
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


class Bench:
    def __init__(self, quick: bool, check_only: bool = False):
        self.backend = resolve_backend("cupy")
        import cupy as cp
        self.cp = cp
        self.rng = np.random.default_rng(1234)
        self.quick, self.check_only = quick, check_only
        self.rows: list[dict] = []
        self.copy_gbps = float("nan") if check_only else copy_bandwidth(self.backend)

    # -- helpers ------------------------------------------------------------------------------
    def bf16(self, *shape, scale=1.0):
        """(device bf16 bits, host float32 values of exactly those bits)."""
        host = f32_to_bf16(self.rng.standard_normal(shape, dtype=np.float32) * np.float32(scale))
        return self.cp.asarray(host), bf16_to_f32(host)

    def f32(self, *shape, scale=1.0):
        host = (self.rng.standard_normal(shape, dtype=np.float32) * np.float32(scale)).astype(np.float32)
        return self.cp.asarray(host), host

    def poisoned(self):
        """Context manager: every device allocation inside it starts as 0xFF bytes (NaN in bf16 and
        fp32, -1 in int32), so an output element a kernel forgets to write fails the check."""
        import contextlib
        cp = self.cp
        pool = cp.get_default_memory_pool()

        def alloc(size):
            mem = pool.malloc(size)
            cp.cuda.runtime.memsetAsync(mem.ptr, 0xFF, size, cp.cuda.get_current_stream().ptr)
            return mem

        @contextlib.contextmanager
        def ctx():
            cp.cuda.set_allocator(alloc)
            try:
                yield
            finally:
                cp.cuda.set_allocator(pool.malloc)
        return ctx()

    def time_ms(self, fn, reps: int | None = None) -> float | None:
        """Median over rounds of (time of `reps` back-to-back calls) / reps, by CUDA events
        (None with --check-only).

        Back to back, the launch queue stays full, so the figure is the kernel's time on the GPU
        rather than the host's launch latency.
        """
        if self.check_only:
            return None
        cp = self.cp
        reps = reps or (5 if self.quick else 20)
        for _ in range(3):
            fn()
        start, end = cp.cuda.Event(), cp.cuda.Event()
        times = []
        for _ in range(5):
            start.record()
            for _ in range(reps):
                fn()
            end.record()
            end.synchronize()
            times.append(cp.cuda.get_elapsed_time(start, end) / reps)
        return float(np.median(times))

    def graph_time_ms(self, fns, repeat: int = 1) -> float | None:
        """Median GPU time per call of `fns` (graph-capturable calls: no allocation, no host sync),
        replayed from one CUDA graph of `repeat` passes over the list (None with --check-only).

        What a decode step's graph sees: no host launch gaps between kernels, so a few-microsecond
        kernel is timed as itself (back-to-back launches from Python would time the host instead).
        """
        if self.check_only:
            return None
        cp = self.cp
        stream = cp.cuda.Stream(non_blocking=True)
        with stream:
            for fn in fns:
                fn()                          # warm-up outside the capture (compiles, cuBLAS picks its kernel)
            stream.synchronize()
            stream.begin_capture()
            try:
                for _ in range(repeat):
                    for fn in fns:
                        fn()
            finally:
                graph = stream.end_capture()
            graph.launch(stream)
            start, end = cp.cuda.Event(), cp.cuda.Event()
            times = []
            for _ in range(5):
                start.record(stream)
                graph.launch(stream)
                end.record(stream)
                end.synchronize()
                times.append(cp.cuda.get_elapsed_time(start, end) / (repeat * len(fns)))
        return float(np.median(times))

    def record(self, kernel, shape, err, tol, ms=None, nbytes=None, flops=None, note="", ladder=None):
        row = {"kernel": kernel, "shape": shape, "rel_err": err, "tol": tol, "ok": bool(err <= tol)}
        if ladder is not None:
            row["ladder"] = ladder    # the stage whose versions are compared, slowest first
        if ms is not None:
            row["ms"] = round(ms, 4)
        if nbytes is not None and ms:
            row["gbps"] = round(nbytes / (ms * 1e-3) / 1e9, 1)
            row["pct_of_copy"] = round(100 * row["gbps"] / self.copy_gbps, 1)
        if flops is not None and ms:
            row["tflops"] = round(flops / (ms * 1e-3) / 1e12, 1)
        if note:
            row["note"] = note
        self.rows.append(row)

    # -- kernels ------------------------------------------------------------------------------
    def embedding(self):
        from engine.ops.embedding import embedding, embedding_ref
        for V, H, T in [(1001, 577, 37), (128256, 2048, 2047)]:
            table, table_h = self.bf16(V, H)
            ids_h = self.rng.integers(0, V, T).astype(np.int32)
            ids = self.cp.asarray(ids_h)
            with self.poisoned():
                out = embedding(ids, table)
            ms = self.time_ms(lambda: embedding(ids, table))
            self.record("embedding_gather", f"V={V} H={H} T={T}", rel_err(out.get(), embedding_ref(ids_h, table_h)),
                        F32_TOL, ms, T * H * (2 + 4))

    def rmsnorm(self):
        from engine.ops.rmsnorm import add_rmsnorm, add_rmsnorm_ref, rmsnorm, rmsnorm_ref
        for T, H in [(3, 577), (2047, 2048)]:
            x, x_h = self.f32(T, H, scale=3)
            w, w_h = self.f32(H)
            with self.poisoned():
                out = rmsnorm(x, w, 1e-5)
            ms = self.time_ms(lambda: rmsnorm(x, w, 1e-5))
            self.record("rmsnorm", f"T={T} H={H}", rel_err(bf16_to_f32(out.get()), rmsnorm_ref(x_h, w_h, 1e-5)),
                        BF16_TOL / 2, ms, T * H * (4 + 2))
            d, d_h = self.f32(T, H)
            res_h = x_h.copy()
            with self.poisoned():
                out = add_rmsnorm(x, d, w, 1e-5)
            ref = add_rmsnorm_ref(res_h, d_h, w_h, 1e-5)
            err = max(rel_err(bf16_to_f32(out.get()), ref), rel_err(x.get(), res_h) / BF16_TOL * F32_TOL)
            ms = self.time_ms(lambda: add_rmsnorm(x, d, w, 1e-5))   # keeps adding d: fine for timing
            self.record("add_rmsnorm", f"T={T} H={H}", err, BF16_TOL / 2, ms, T * H * (4 * 3 + 2))

    def rope(self):
        from engine.formats.config import config_from_dict
        from engine.model.random_model import PRESETS
        from engine.ops.rope import qkv_bias_norm_ref, rope_qkv, rope_tables
        # Llama: plain rotation. Qwen2: + bias (rope_qkv_bias_norm). Qwen3: + q/k RMSNorm, head_dim 128
        # at full size, 10 and 24 (fewer pairs than a warp has lanes) in the tiny ones; T=1 is a decode.
        cases = [("tiny", 45), ("llama-3.2-1b", 2047), ("tiny-qwen2", 45), ("tiny-qwen3", 45),
                 ("tiny-qwen3-mqa-untied", 7), ("qwen2.5-0.5b", 2047), ("qwen3-0.6b", 2047), ("qwen3-0.6b", 1)]
        for preset, T in cases:
            cfg = config_from_dict(PRESETS[preset])
            cos_h, sin_h = rope_tables(cfg, 4096)
            cos, sin = self.cp.asarray(cos_h), self.cp.asarray(sin_h)
            qkv, qkv_h = self.f32(T, cfg.qkv_dim, scale=3.0)
            pos_h = self.rng.integers(0, 4096, T).astype(np.int32)
            pos = self.cp.asarray(pos_h)
            extra, extra_h = {}, {}                    # bias [qkv_dim], q_norm / k_norm [D] around 1
            if cfg.qkv_bias:
                extra["bias"], extra_h["bias"] = self.f32(cfg.qkv_dim, scale=0.5)
            for name in ("q_norm", "k_norm") if cfg.qk_norm else ():
                w, w_h = self.f32(cfg.head_dim, scale=0.2)
                extra[name], extra_h[name] = w + 1, w_h + 1
            with self.poisoned():
                out = rope_qkv(qkv, pos, cos, sin, cfg, **extra)
            ref = rope_qkv(qkv_h, pos_h, cos_h, sin_h, cfg, **extra_h)
            ms = self.time_ms(lambda: rope_qkv(qkv, pos, cos, sin, cfg, **extra))
            kernel = "rope_qkv_bias_norm" if extra else "rope_qkv"
            self.record(kernel, f"{preset} T={T}", rel_err(bf16_to_f32(out.get()), ref), BF16_TOL / 2, ms,
                        T * cfg.qkv_dim * (4 + 2))
            if extra:       # what the fusion saves: the same math as CuPy array ops, then rope_qkv
                unfused = lambda: rope_qkv(qkv_bias_norm_ref(qkv, extra.get("bias"), extra.get("q_norm"),  # noqa: E731,B023
                                                             extra.get("k_norm"), cfg), pos, cos, sin, cfg)
                out = unfused()
                self.record("rope_qkv after CuPy bias/norm (unfused)", f"{preset} T={T}",
                            rel_err(bf16_to_f32(out.get()), ref), BF16_TOL / 2, self.time_ms(unfused),
                            T * cfg.qkv_dim * (4 + 2))

    def linear(self):
        for M, N, K in [(37, 1001, 577), (2047, 3072, 2048), (2048, 8192 * 2, 2048)]:
            x, x_h = self.bf16(M, K)
            w, w_h = self.bf16(N, K, scale=K ** -0.5)
            out = self.cp.full((M, N), np.nan, dtype=self.cp.float32)
            matmul(x, w, out, trans_b=True)
            ref = x_h.astype(np.float64) @ w_h.astype(np.float64).T
            ms = self.time_ms(lambda: matmul(x, w, out, trans_b=True))
            self.record("gemmEx bf16->fp32", f"M={M} N={N} K={K}", rel_err(out.get(), ref), 1e-5, ms,
                        2 * (M * K + N * K) + 4 * M * N, flops=2 * M * N * K)
            out16 = self.cp.full((M, N), 0xFFFF, dtype=self.cp.uint16)
            matmul(x, w, out16, trans_b=True)
            self.record("gemmEx bf16->bf16", f"M={M} N={N} K={K}", rel_err(bf16_to_f32(out16.get()), ref), BF16_TOL / 2)

    # Decode projections: (name, N, K). Llama-3.2-1B and SmolLM2-135M, then the tiny test models'
    # odd sizes (K not a multiple of 32; K % 8 != 0 takes the element-load kernel).
    GEMV_SHAPES = [("llama-1b qkv", 3072, 2048), ("llama-1b o", 2048, 2048), ("llama-1b gate_up", 16384, 2048),
                   ("llama-1b down", 2048, 8192), ("llama-1b lm_head", 128256, 2048),
                   ("smollm2 qkv", 960, 576), ("smollm2 o", 576, 576), ("smollm2 gate_up", 3072, 576),
                   ("smollm2 down", 576, 1536), ("smollm2 lm_head", 49152, 576),
                   ("tiny qkv", 160, 72), ("tiny down", 72, 136), ("tiny lm_head", 397, 72), ("odd K", 241, 50)]
    GEMV_FLUSH_BYTES = 256 * 2**20    # distinct copies of W per timed pass: >> the 60 MB L2 of an H200

    def gemv(self):
        """Decode projections (T = 1, 2, 4, 8 rows) through kernels_cu/gemv.cu and through cuBLAS
        (backend.matmul) in the same run, both checked against a float64 reference (outputs poisoned)
        and timed from a CUDA graph cycling over copies of W (a decode step reads every weight once,
        never from L2). GB/s counts W + x + out; the floor is reading W at copy bandwidth."""
        from engine.backend import tensor_cores_usable
        from engine.ops.gemv import GEMV_MAX_ROWS, gemv
        cp = self.cp
        usable = tensor_cores_usable(cp.cuda.Device().id)
        if not usable:
            print("gemv: kernels_cu/gemv.cu needs sm_80+ (bf16 mma.sync); timing cuBLAS only", file=sys.stderr)
        for name, N, K in self.GEMV_SHAPES:
            w, w_h = self.bf16(N, K, scale=K ** -0.5)
            x8, x8_h = self.bf16(GEMV_MAX_ROWS, K)
            ref8 = _linear_ref64(x8_h, w_h)
            copies = [w]
            if not self.check_only:            # distinct addresses, same values: every pass reads HBM
                copies += [w.copy() for _ in range(min(511, -(-self.GEMV_FLUSH_BYTES // (2 * N * K)) - 1))]
            l2_note = "W copies fit in L2: not an HBM figure" if len(copies) * 2 * N * K < 128 * 2**20 else ""
            repeat = -(-8 // len(copies))      # at least 8 calls per replay
            tol = _fp32_acc_tol(K)
            for T in (1, 2, 4, 8):
                x, ref = x8[:T], ref8[:T]
                shape = f"{name} N={N} K={K} T={T}"
                nbytes = 2 * N * K + 2 * T * K + 4 * T * N
                out_cublas = cp.full((T, N), np.nan, dtype=cp.float32)
                matmul(x, w, out_cublas, trans_b=True)
                ms_cublas = self.graph_time_ms([lambda c=c: matmul(x, c, out_cublas, trans_b=True) for c in copies],
                                               repeat)
                self.record("gemmEx (cuBLAS) decode", shape, rel_err(out_cublas.get(), ref), tol, ms_cublas, nbytes,
                            note=l2_note)
                if not usable:
                    continue
                with self.poisoned():
                    out = gemv(x, w)
                ms = self.graph_time_ms([lambda c=c: gemv(x, c, out) for c in copies], repeat)
                speed = f"{ms_cublas / ms:.2f}x cuBLAS" if ms and ms_cublas else ""
                self.record("gemv_bf16 decode", shape, rel_err(out.get(), ref), tol, ms, nbytes,
                            note="; ".join(n for n in (speed, l2_note) if n))
            del copies

    QUANT_GEMV_SHAPES = GEMV_SHAPES[:4]       # Llama-3.2-1B's qkv, o, gate_up, down

    def quant_gemv(self):
        """Decode projections with int4 and int8 weights (kernels_cu/quant_gemv.cu, group 128) beside the
        bf16 path on the same W (the GEMV at 1 row, cuBLAS at 16, as linear() routes them), at 1 and 16
        rows, checked against the W each kernel multiplies (mma_weight_ref on the tensor-core path,
        dequantize_ref otherwise) and timed as `gemv` is (a CUDA graph cycling over copies of the
        weight). GB/s counts qweight + scales + zeros + x."""
        from engine.ops.linear import linear
        from engine.ops.quant_gemv import mma_weight_ref, quant_gemv, uses_tensor_cores
        from engine.ops.quantization import QuantizedWeight, dequantize_ref, quantize_ref
        cp = self.cp
        for name, N, K in self.QUANT_GEMV_SHAPES:
            w, w_h = self.bf16(N, K, scale=K ** -0.5)
            for T in (1, 16):
                x, x_h = self.bf16(T, K)
                shape = f"{name} N={N} K={K} T={T}"
                runs = [(f"{'gemv_bf16' if T <= 8 else 'cublas_bf16'} decode", w, 2 * N * K, None)]
                for bits in (4, 8):
                    qh = quantize_ref(w_h, bits, 128)
                    qw = QuantizedWeight(cp.asarray(qh.qweight), cp.asarray(qh.scales), cp.asarray(qh.zeros), bits,
                                         qh.group_size, qh.shape)
                    w_ref = mma_weight_ref(qh) if uses_tensor_cores(x, qw) else dequantize_ref(qh)
                    runs.append((f"quant_gemv int{bits} decode", qw, qw.nbytes, x_h @ w_ref.T))
                ms_bf16 = None
                for kernel, weight, wbytes, ref in runs:
                    fn, clone = (linear, lambda a: a.copy()) if ref is None else (quant_gemv, lambda q: QuantizedWeight(
                        q.qweight.copy(), q.scales.copy(), q.zeros.copy(), q.bits, q.group_size, q.shape))
                    copies = [weight]
                    if not self.check_only:        # distinct addresses, same values: every pass reads HBM
                        copies += [clone(weight) for _ in range(min(511, -(-self.GEMV_FLUSH_BYTES // wbytes) - 1))]
                    with self.poisoned():
                        out = fn(x, weight)
                    ms = self.graph_time_ms([lambda c=c: fn(x, c, out) for c in copies], -(-8 // len(copies)))
                    err = rel_err(out.get(), _linear_ref64(x_h, w_h) if ref is None else ref)
                    ms_bf16 = ms if ref is None else ms_bf16
                    speed = f"{ms_bf16 / ms:.2f}x bf16" if ms and ms_bf16 and ref is not None else ""
                    self.record(kernel, shape, err, _fp32_acc_tol(K), ms, wbytes + 2 * K * T, note=speed)
                    del copies

    def swiglu(self):
        from engine.ops.swiglu import swiglu, swiglu_ref
        for T, I in [(5, 137), (2047, 8192)]:
            gu, gu_h = self.f32(T, 2 * I, scale=2)
            with self.poisoned():
                out = swiglu(gu)
            ms = self.time_ms(lambda: swiglu(gu))
            self.record("swiglu", f"T={T} I={I}", rel_err(bf16_to_f32(out.get()), swiglu_ref(gu_h)), BF16_TOL / 2, ms,
                        T * I * (8 + 2))

    def argmax(self):
        from engine.ops.argmax import argmax_rows
        for R, V in [(3, 1001), (64, 128256)]:
            lg, lg_h = self.f32(R, V)
            lg_h[0, 17] = lg_h[0, 500] = 1e4    # a tie: the first index must win
            lg = self.cp.asarray(lg_h)
            with self.poisoned():
                out = argmax_rows(lg).get()
            err = float(np.mean(out != np.argmax(lg_h, axis=-1)))
            ms = self.time_ms(lambda: argmax_rows(lg))
            self.record("argmax_rows", f"R={R} V={V}", err, 0.0, ms, R * V * 4)

    def prefill_attention(self):
        from engine.formats.config import config_from_dict
        from engine.ops.attention import causal_attention_ref, prefill_attention
        from engine.ops.qkv_layout import split_qkv
        for Hq, Hkv, D, lens in [(6, 2, 16, [13, 1, 40]), (8, 8, 64, [77]), (12, 3, 32, [129, 5]),
                                 (32, 8, 64, [2048])]:
            cfg = config_from_dict({"model_type": "llama", "vocab_size": 10, "hidden_size": Hq * D,
                                    "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": Hq,
                                    "num_key_value_heads": Hkv, "head_dim": D})
            T = sum(lens)
            cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
            qkv, qkv_h = self.bf16(T, cfg.qkv_dim)
            with self.poisoned():
                out = prefill_attention(qkv, cu, cfg)
            q, k, v = split_qkv(qkv_h, cfg)
            ref = np.concatenate([causal_attention_ref(q[a:b], k[a:b], v[a:b], D ** -0.5).reshape(b - a, -1)
                                  for a, b in zip(cu[:-1], cu[1:])])
            ms = self.time_ms(lambda: prefill_attention(qkv, cu, cfg), reps=10) if T >= 2048 else None
            self.record("prefill_attention (cuBLAS+causal_softmax)", f"Hq={Hq} Hkv={Hkv} D={D} lens={lens}",
                        rel_err(bf16_to_f32(out.get()), ref), BF16_TOL, ms,
                        flops=4 * Hq * T * T * D if ms else None)

    def flash(self):
        """Tiled prefill attention on the tensor cores: awkward shapes checked against the NumPy
        reference (fresh prompts from qkv, and chunks over a cached prefix in shuffled pages), then
        the Llama-3.2-1B shape at 2k/8k/32k tokens with TFLOP/s next to the measured bf16 GEMM rate
        (and the chapter 06 cuBLAS + causal-softmax path where its T x T scores fit)."""
        from engine.ops.attention import prefill_attention
        from engine.ops.flash_attention import flash_attention, flash_attention_ref, kernel_supports
        from engine.ops.paged_attention import paged_attention
        gemm = float("nan") if self.check_only else gemm_tflops(self.backend)
        checks = [(6, 2, 16, [13, 1, 40], 0, 16), (8, 8, 64, [1, 63, 64, 65, 130], 0, 16),
                  (12, 3, 128, [129, 5], 0, 16), (16, 2, 64, [77, 200], 0, 7), (8, 1, 32, [70], 0, 16),
                  (32, 8, 64, [5, 64, 70], 100, 16), (16, 2, 128, [33, 1, 65], 17, 7)]
        for Hq, Hkv, D, lens, prefix, page_size in checks:
            cfg = _attention_config(Hq, Hkv, D)
            if not kernel_supports(cfg):
                self.record("flash_attention", f"D={D}", float("inf"), BF16_TOL, note="needs sm_80+")
                return
            case = self._flash_case(cfg, lens, prefix, page_size)
            with self.poisoned():
                out = flash_attention(*case["args"])
            ref = flash_attention_ref(*case["ref_args"], D ** -0.5, page_tables=case["tables_h"])
            self.record("flash_attention", f"Hq={Hq} Hkv={Hkv} D={D} lens={lens} prefix={prefix} PS={page_size}",
                        rel_err(bf16_to_f32(out.get()), ref.reshape(len(ref), -1)), BF16_TOL)
        cfg = _attention_config(32, 8, 64)
        for T in ([2048, 8192] if self.quick else [2048, 8192, 32768]):
            for prefix in ((0, 30720) if T == 2048 else (0,)):
                case = self._flash_case(cfg, [T], prefix, 16)
                args = case["args"]
                with self.poisoned():
                    out = flash_attention(*args)
                err = self._flash_spot_check(out, case, cfg)
                ms = self.time_ms(lambda a=args: flash_attention(*a), reps=5)
                flops = 4 * 32 * 64 * (T * prefix + T * (T + 1) / 2)      # QK^T and PV over the causal range
                shape = f"Llama-1B heads T={T}" + (f" after {prefix} cached" if prefix else "")
                tflops = flops / (ms * 1e-3) / 1e12 if ms else float("nan")
                self.record("flash_attention", shape, err, BF16_TOL, ms, flops=flops,
                            note=f"{100 * tflops / gemm:.0f}% of the bf16 GEMM rate ({gemm:.0f} TFLOP/s)")
                if prefix:    # what a chunk over the cache cost before: the decode kernel, one row per token
                    qkv, _, pos, _, kc, vc, tables = args
                    ms = self.time_ms(lambda a=(qkv, kc, vc, tables, case["seq_idx"], pos, cfg, prefix + T):
                                      paged_attention(*a), reps=3)
                    self.record("paged_attention on the chunk (before)", shape, 0.0, BF16_TOL, ms, flops=flops)
                elif T <= 8192:   # the chapter 06 rung: T x T scores through memory
                    ms = self.time_ms(lambda a=(args[0], args[1], cfg): prefill_attention(*a), reps=3)
                    self.record("prefill_attention cuBLAS+softmax (before)", shape, 0.0, BF16_TOL, ms, flops=flops)

    def _flash_case(self, cfg, lens, prefix, page_size):
        """Device inputs of flash_attention for sequences of `lens` query tokens, each after `prefix`
        cached tokens (0: fresh prompts, K/V from qkv). Host float32 copies for the reference."""
        cp = self.cp
        Hq, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        T = sum(lens)
        qkv, qkv_h = self.bf16(T, cfg.qkv_dim)
        cu_h = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        pos_h = np.concatenate([np.arange(prefix, prefix + n) for n in lens]).astype(np.int32)
        q_h = qkv_h[:, :Hq * D].reshape(T, Hq, D)
        case = {"tables_h": None}
        if prefix == 0:
            k_h = qkv_h[:, Hq * D:(Hq + Hkv) * D].reshape(T, Hkv, D)
            v_h = qkv_h[:, (Hq + Hkv) * D:].reshape(T, Hkv, D)
            case["args"] = (qkv, cu_h, cp.asarray(pos_h), cfg)
            case["ref_args"] = (q_h, k_h, v_h, cu_h, pos_h)
            case["keys_h"] = lambda s, n: (k_h[cu_h[s]:cu_h[s] + n], v_h[cu_h[s]:cu_h[s] + n])
            return case
        pages = [-(-(prefix + n) // page_size) for n in lens]
        num_pages = sum(pages) + 3
        perm = self.rng.permutation(num_pages).astype(np.int32)
        tables_h = np.full((len(lens), max(pages)), -1, dtype=np.int32)
        for s, n in enumerate(pages):
            tables_h[s, :n] = perm[sum(pages[:s]):sum(pages[:s]) + n]
        kc, kc_h = self.bf16(num_pages, page_size, Hkv, D)
        vc, vc_h = self.bf16(num_pages, page_size, Hkv, D)
        case["args"] = (qkv, cu_h, cp.asarray(pos_h), cfg, kc, vc, cp.asarray(tables_h))
        case["ref_args"] = (q_h, kc_h, vc_h, cu_h, pos_h)
        case["tables_h"] = tables_h
        case["seq_idx"] = cp.asarray(np.repeat(np.arange(len(lens), dtype=np.int32), lens))

        def keys(s, n):
            p = np.arange(n)
            rows = tables_h[s][p // page_size] * page_size + p % page_size
            return kc_h.reshape(-1, Hkv, D)[rows], vc_h.reshape(-1, Hkv, D)[rows]
        case["keys_h"] = keys
        return case

    def _flash_spot_check(self, out, case, cfg):
        """For the long timing cases: a few rows (the last one among them) against exact attention."""
        Hq, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q_h, pos_h = case["ref_args"][0], case["ref_args"][4]
        rows = np.unique(np.append(self.rng.integers(0, len(pos_h), 3), len(pos_h) - 1))
        got = bf16_to_f32(out.get()[rows])
        ref = np.empty((len(rows), Hq * D), np.float32)
        for i, r in enumerate(rows):
            k, v = case["keys_h"](0, int(pos_h[r]) + 1)                      # [ctx, Hkv, D]
            qg = q_h[r].reshape(Hkv, Hq // Hkv, D)
            scores = np.einsum("grd,sgd->grs", qg, k) * np.float32(D ** -0.5)
            p = np.exp(scores - scores.max(-1, keepdims=True))
            ref[i] = (np.einsum("grs,sgd->grd", p / p.sum(-1, keepdims=True), v)).reshape(-1)
        return rel_err(got, ref)

    def paged(self):
        from engine.formats.config import config_from_dict
        from engine.ops.kv_write import kv_write, kv_write_ref
        from engine.ops.paged_attention import paged_attention, paged_attention_ref
        from engine.ops.qkv_layout import split_qkv
        cp = self.cp
        cases = [(4, 4, 64, [1, 17, 33, 100], 16, None), (32, 8, 64, [5, 300, 1000], 16, None),
                 (16, 2, 128, [64, 257], 16, 3), (8, 1, 32, [31, 16, 2], 7, None), (12, 3, 64, [500], 16, 5),
                 (32, 8, 64, [2048] * 64, 16, None), (32, 8, 64, [2048] * 4, 16, None),
                 (32, 8, 64, [int(n) for n in np.random.default_rng(1).integers(100, 2049, 256)], 16, None)]  # a serving mix
        for Hq, Hkv, D, ctxs, BS, splits in cases:
            cfg, qkv, qkv_h, kc, kc_h, vc, vc_h, tables_h, seq_h, pos_h = self._paged_inputs(Hq, Hkv, D, ctxs, BS)
            S = len(ctxs)
            args = (cp.asarray(tables_h), cp.asarray(seq_h), cp.asarray(pos_h))
            big = S * max(ctxs) >= 8192
            ref = None if big else paged_attention_ref(split_qkv(qkv_h, cfg)[0], kc_h, vc_h, tables_h, seq_h, pos_h,
                                                       D ** -0.5).reshape(S, -1)
            for sp, tc in itertools.product([1, splits] if splits else [None], [True, False]):
                def run(sp=sp, tc=tc):
                    return paged_attention(qkv, kc, vc, *args, cfg, max(ctxs), splits=sp, tensor_cores=tc)
                with self.poisoned():
                    out = run()
                err = rel_err(bf16_to_f32(out.get()), ref) if ref is not None else \
                    self._paged_spot_check(out, qkv_h, kc_h, vc_h, tables_h, seq_h, pos_h, cfg)
                ms = self.time_ms(run)
                kv_bytes = sum(ctxs) * Hkv * D * 2 * 2
                self.record(f"paged_attention decode ({'tensor' if tc else 'CUDA'} cores)",
                            f"Hq={Hq} Hkv={Hkv} D={D} BS={BS} ctx={_short(ctxs)} splits={sp or 'auto'}",
                            err, BF16_TOL, ms, kv_bytes)
        # kv_write into shuffled slots
        cfg = config_from_dict({"model_type": "llama", "vocab_size": 10, "hidden_size": 2048, "intermediate_size": 8,
                                "num_hidden_layers": 1, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64})
        T, NB, BS = 2047, 200, 16
        qkv, qkv_h = self.bf16(T, cfg.qkv_dim)
        slots_h = self.rng.permutation(NB * BS)[:T].astype(np.int32)
        kc = cp.full((NB, BS, 8, 64), 0xFFFF, dtype=cp.uint16)
        vc = cp.full((NB, BS, 8, 64), 0xFFFF, dtype=cp.uint16)
        slots = cp.asarray(slots_h)
        kv_write(qkv, slots, kc, vc, cfg)
        kc_h, vc_h = np.full((NB, BS, 8, 64), np.nan, np.float32), np.full((NB, BS, 8, 64), np.nan, np.float32)
        _, k, v = split_qkv(qkv_h, cfg)
        kv_write_ref(k, v, kc_h, vc_h, slots_h)
        got_k, got_v = bf16_to_f32(kc.get()), bf16_to_f32(vc.get())
        written = ~np.isnan(kc_h)
        err = max(rel_err(got_k[written], kc_h[written]), rel_err(got_v[written], vc_h[written]))
        ms = self.time_ms(lambda: kv_write(qkv, slots, kc, vc, cfg))
        self.record("kv_write", f"T={T} slots shuffled", err, 0.0, ms, T * cfg.kv_dim * 2 * 2 * 2)

    def _paged_spot_check(self, out, qkv_h, kc_h, vc_h, tables_h, seq_h, pos_h, cfg):
        """For the large timing cases: check a few rows against the reference."""
        from engine.ops.paged_attention import paged_attention_ref
        from engine.ops.qkv_layout import split_qkv
        rows = np.unique(self.rng.integers(0, len(seq_h), 3))
        q = split_qkv(qkv_h, cfg)[0][rows]
        ref = paged_attention_ref(q, kc_h, vc_h, tables_h, seq_h[rows], pos_h[rows], cfg.head_dim ** -0.5)
        return rel_err(bf16_to_f32(out.get())[rows], ref.reshape(len(rows), -1))

    def sampling(self):
        from engine.ops.sampling import sample, sample_ref
        from engine.runtime.sampling_params import SamplingParams
        for R, V in [(6, 1001), (256, 128256)]:
            lg, lg_h = self.f32(R, V, scale=3)
            knobs = [(0.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 50, 1.0), (0.8, 0, 0.9), (1.2, 40, 0.8), (0.5, 1, 1.0)]
            params = [SamplingParams(temperature=t, top_k=k, top_p=p) for t, k, p in (knobs * R)[:R]]
            u = self.rng.random(R).tolist()
            with self.poisoned():
                got = sample(lg, params, u)
            ref = np.array([sample_ref(lg_h[r], p.temperature, p.top_k, p.top_p, u[r]) for r, p in enumerate(params)])
            ms = self.time_ms(lambda: sample(lg, params, u), reps=10)
            self.record("sample_rows", f"R={R} V={V} mixed knobs", float(np.mean(got != ref)), 0.02, ms, R * V * 4,
                        note="mismatch rate vs reference (fp32 reduction order may move a boundary)")

    # -- the numbered ladders of engine/bench/ladder.py: every version checked (and timed) at its
    #    default block size; `--ladder NAME` sweeps the block sizes and prints the ladder's own table.
    #    --quick and --check-only (compute-sanitizer) check the small shapes only.
    def ladders(self):
        from engine.backend import sm_count
        from engine.bench import ladder as lad
        lad._CTX_SMS[0] = sm_count(self.cp.cuda.Device().id)
        ctx = lad.Ctx(self.cp, copy_gbps=self.copy_gbps, sms=lad._CTX_SMS[0])
        for name, ladder in lad.LADDERS.items():
            quick = self.check_only or self.quick
            for r in lad.run_ladder(ctx, ladder, sweep=False, timed=not quick, small_only=quick, log=None):
                if "skipped" in r:
                    continue
                ms = r["us"] / 1000 if "us" in r else None
                work = ladder.work(next(c.params for c in ladder.cases if c.label == r["case"]))
                self.record(f"{name} v{r['version']} {r['kernel']}", f"{r['case']} {r['block']}",
                            r.get("rel_err", float("inf")), r["tol"], ms,
                            nbytes=work if ladder.metric == "GB/s" else None,
                            flops=work if ladder.metric != "GB/s" else None, note=r.get("error", ""))

    # -- the ladder: each stage's first (naive) version beside the fast one ----------------------
    def ladder(self):
        self._ladder_rmsnorm()
        self._ladder_softmax()
        self._ladder_paged()

    def _ladder_rmsnorm(self):
        from engine.ops.rmsnorm import rmsnorm, rmsnorm_naive, rmsnorm_ref
        for T, H in [(5, 577), (2047, 2048)]:
            x, x_h = self.f32(T, H, scale=3)
            w, w_h = self.f32(H)
            ref = rmsnorm_ref(x_h, w_h, 1e-5)
            for name, fn in [("rmsnorm_naive (1 thread per row)", rmsnorm_naive),
                             ("rmsnorm (1 block per row, block reduction)", rmsnorm)]:
                with self.poisoned():
                    out = fn(x, w, 1e-5)
                ms = self.time_ms(lambda fn=fn: fn(x, w, 1e-5))
                self.record(name, f"T={T} H={H}", rel_err(bf16_to_f32(out.get()), ref), BF16_TOL / 2, ms,
                            T * H * (4 + 2), ladder="rmsnorm")

    def _ladder_softmax(self):
        from engine.backend import load_kernel
        from engine.ops.attention import softmax
        cp = self.cp
        for H, T in [(3, 77), (32, 1024)]:
            scores, scores_h = self.f32(H, T, T, scale=4)
            scale = np.float32(64 ** -0.5)
            masked = np.where(np.tril(np.ones((T, T), dtype=bool)), scores_h * scale, -np.inf)
            ref = softmax(masked)                                                    # [H, T, T]
            threads = min(1024, max(32, 32 * ((T + 127) // 128)))
            versions = [("causal_softmax_naive (1 thread per row)",
                         lambda p: load_kernel("attention", "causal_softmax_naive")(
                             ((H * T + 127) // 128,), (128,), (scores, p, np.int32(H * T), np.int32(T), scale))),
                        ("causal_softmax (1 block per row, block reductions)",
                         lambda p: load_kernel("attention", "causal_softmax")(
                             (H * T,), (threads,), (scores, p, np.int32(T), scale)))]
            for name, launch in versions:
                with self.poisoned():
                    probs = cp.empty((H, T, T), dtype=cp.uint16)
                launch(probs)
                ms = self.time_ms(lambda launch=launch: launch(probs))
                self.record(name, f"H={H} T={T}", rel_err(bf16_to_f32(probs.get()), ref), BF16_TOL / 2, ms,
                            H * T * T * (4 + 2), ladder="prefill softmax")

    def _ladder_paged(self):
        from engine.ops.paged_attention import paged_attention, paged_attention_naive, paged_attention_ref
        from engine.ops.qkv_layout import split_qkv
        for Hq, Hkv, D, ctxs, BS in [(12, 3, 64, [1, 17, 200, 33], 7), (32, 8, 64, [2048] * 64, 16)]:
            cfg, qkv, qkv_h, kc, kc_h, vc, vc_h, tables_h, seq_h, pos_h = self._paged_inputs(Hq, Hkv, D, ctxs, BS)
            args = tuple(self.cp.asarray(a) for a in (tables_h, seq_h, pos_h))
            small = len(ctxs) * max(ctxs) < 8192
            ref = paged_attention_ref(split_qkv(qkv_h, cfg)[0], kc_h, vc_h, tables_h, seq_h, pos_h,
                                      D ** -0.5).reshape(len(ctxs), -1) if small else None
            versions = [("paged_attention_naive (1 warp per query head)",
                         lambda: paged_attention_naive(qkv, kc, vc, *args, cfg)),
                        ("paged_attention (cp.async pipeline, GQA-shared K/V)",
                         lambda: paged_attention(qkv, kc, vc, *args, cfg, max(ctxs), splits=1, tensor_cores=False)),
                        ("paged_attention_tc (the GQA group on the tensor cores)",
                         lambda: paged_attention(qkv, kc, vc, *args, cfg, max(ctxs), splits=1, tensor_cores=True))]
            for name, fn in versions:
                with self.poisoned():
                    out = fn()
                err = rel_err(bf16_to_f32(out.get()), ref) if small else \
                    self._paged_spot_check(out, qkv_h, kc_h, vc_h, tables_h, seq_h, pos_h, cfg)
                ms = self.time_ms(fn, reps=10)
                self.record(name, f"Hq={Hq} Hkv={Hkv} D={D} BS={BS} ctx={_short(ctxs)} splits=1", err, BF16_TOL, ms,
                            sum(ctxs) * Hkv * D * 2 * 2, ladder="paged attention")

    def _paged_inputs(self, Hq, Hkv, D, ctxs, BS):
        """A config, one decode row per sequence, and K/V caches whose pages are shuffled."""
        from engine.formats.config import config_from_dict
        cfg = config_from_dict({"model_type": "llama", "vocab_size": 10, "hidden_size": Hq * D,
                                "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": Hq,
                                "num_key_value_heads": Hkv, "head_dim": D})
        S = len(ctxs)
        mb = max((c + BS - 1) // BS for c in ctxs)
        NB = S * mb + 3
        perm = self.rng.permutation(NB).astype(np.int32)           # shuffled, non-contiguous pages
        tables_h = np.full((S, mb), -1, dtype=np.int32)
        for s, c in enumerate(ctxs):
            n = (c + BS - 1) // BS
            tables_h[s, :n] = perm[s * mb:s * mb + n]
        kc, kc_h = self.bf16(NB, BS, Hkv, D)
        vc, vc_h = self.bf16(NB, BS, Hkv, D)
        qkv, qkv_h = self.bf16(S, cfg.qkv_dim)
        pos_h = np.array(ctxs, dtype=np.int32) - 1
        seq_h = np.arange(S, dtype=np.int32)
        return cfg, qkv, qkv_h, kc, kc_h, vc, vc_h, tables_h, seq_h, pos_h

    def run(self, which):
        for name in which:
            getattr(self, name)()


def _fp32_acc_tol(K: int) -> float:
    """Relative error bound of an fp32-accumulated product of bf16-exact operands over K terms: the
    linear group's 1e-5 up to K = 2048, growing with K beyond (the tensor cores' fp32 accumulation
    truncates at each step; cuBLAS's own error is ~2e-6 at K = 2048 on the H200)."""
    return 1e-5 * max(1.0, K / 2048)


def _linear_ref64(x, w, rows: int = 16384):
    """x [T, K] @ w[N, K]^T in float64, w converted a slice of rows at a time (lm_head: 2 GB at once)."""
    x64 = x.astype(np.float64)
    return np.concatenate([x64 @ w[i:i + rows].astype(np.float64).T for i in range(0, len(w), rows)], axis=1)


def _attention_config(Hq, Hkv, D):
    from engine.formats.config import config_from_dict
    return config_from_dict({"model_type": "llama", "vocab_size": 10, "hidden_size": Hq * D, "intermediate_size": 8,
                             "num_hidden_layers": 1, "num_attention_heads": Hq, "num_key_value_heads": Hkv,
                             "head_dim": D})


def _short(ctxs):
    if len(ctxs) <= 4:
        return str(ctxs)
    return f"{ctxs[0]}x{len(ctxs)}" if len(set(ctxs)) == 1 else f"{min(ctxs)}..{max(ctxs)}x{len(ctxs)}"


ALL = ["embedding", "rmsnorm", "rope", "linear", "gemv", "quant_gemv", "swiglu", "argmax", "prefill_attention", "flash", "paged",
       "sampling", "ladder", "ladders"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None, help="write one JSON line per check to this file")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--check-only", action="store_true", help="check every kernel once, time nothing")
    ap.add_argument("--only", nargs="*", default=ALL, choices=ALL)
    from engine.bench import ladder
    ladder.add_arguments(ap)
    args = ap.parse_args(argv)
    if args.ladder:     # the numbered ladders: on a GPU measured, elsewhere compiled and shown as recorded
        return ladder.run_command(args)
    from engine.backend import cupy_unavailable_reason
    reason = cupy_unavailable_reason()
    if reason is not None:   # one line, not a traceback: this tool only measures CUDA kernels
        print(f"engine.bench.kernels needs a CUDA GPU with CuPy: {reason}", file=sys.stderr)
        return 2
    b = Bench(args.quick, args.check_only)
    from engine.backend import gpu_name
    print(f"device: {gpu_name()}, measured copy bandwidth {b.copy_gbps:.0f} GB/s (read + write)")
    failures = []
    for name in args.only:
        try:
            b.run([name])
        except Exception as exc:   # report and keep going: one broken kernel should not hide the rest
            failures.append(f"{name}: {type(exc).__name__}: {exc}")
            print(f"[ERROR] {failures[-1]}", file=sys.stderr)
    print(f"{'kernel':<42} {'shape':<52} {'rel_err':>9} {'ok':>3} {'ms':>8} {'GB/s':>7} {'%copy':>6} {'TF/s':>6}")
    for r in b.rows:
        print(f"{r['kernel']:<42} {r['shape'][:52]:<52} {r['rel_err']:>9.2e} {'ok' if r['ok'] else 'NO':>3} "
              f"{r.get('ms', ''):>8} {r.get('gbps', ''):>7} {r.get('pct_of_copy', ''):>6} {r.get('tflops', ''):>6}")
    if args.json:
        with open(args.json, "w") as f:
            f.write(json.dumps({"device": gpu_name(), "copy_gbps": b.copy_gbps}) + "\n")
            for r in b.rows:
                f.write(json.dumps(r) + "\n")
    bad = [r for r in b.rows if not r["ok"]]
    return 1 if bad or failures else 0


if __name__ == "__main__":
    sys.exit(main())
