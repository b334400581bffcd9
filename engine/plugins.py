"""Your code inside the real model: replace one stage of the engine for the span of a `with` block.

    import engine
    with engine.use_stage("rmsnorm", my_rmsnorm):                 # a NumPy function
        engine.load_model(d, backend="numpy").logits(ids)         # every RMSNorm call runs my_rmsnorm
    with engine.use_stage("rmsnorm", cuda_source=src, kernel="rmsnorm"):   # CUDA C, GPU backend
        llm.generate(prompts)                                     # your kernel, launched in place of ours

Every op in engine/ops/*.py (sampling's device half included) looks its stage up in `OVERRIDES` (one dict
lookup per call) and, when it finds an override, runs it instead of the engine's implementation.
So the override reaches everything built on the ops: `Model.logits`, `engine.LLM.generate`, the chat.

An overridden stage runs unfused and eagerly: `add_rmsnorm` becomes `residual += delta` followed by
your `rmsnorm`, and the CUDA graph of a decode step (engine/runtime/cuda_graphs.py) is not captured or
replayed while any override is active (`any_active()`), so each step launches your code for real.

Two stages before the model have hooks of their own, in the same `with` style: the safetensors header
reader (engine.formats.safetensors.use_header_reader, chapter 01: every file opened in the block is
parsed by your function) and the BPE merge loop (engine.text.tokenizer.use_merge_loop, chapter 02:
every encode() in the block merges with your function).

Overrides are process-wide: for the duration of the `with` block every thread that runs the model
sees them. Entering and leaving blocks is thread-safe (a lock), and blocks nest: leaving one puts
back whatever was active before it. Do not let two threads override the same stage at once.

The stages, what a NumPy function override receives and returns, and which kernel a CUDA override
replaces (with the same launch geometry and arguments as the engine's own launch; see STAGES):
"""
from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field


class PluginError(ValueError):
    """An override that cannot run: unknown stage, wrong arguments, wrong result, wrong backend."""


@dataclass(frozen=True)
class Stage:
    function: str   # the NumPy function's signature and result
    kernel: str     # the CUDA kernel it replaces and how it is launched
    engine_kernel: tuple[str, str]   # (kernels_cu stage, kernel name) of the engine's own kernel
    defines: str = ""                # -D macros the kernel is compiled with (filled per launch)


STAGES: dict[str, Stage] = {
    "embedding": Stage(
        "fn(ids [T] int32, table [V, H] float32) -> [T, H] float32",
        "embedding_gather<<<T, 128>>>(const int* ids, const bf16* table, float* out, int V, int H)",
        ("embedding", "embedding_gather")),
    "rmsnorm": Stage(
        "fn(x [T, H] float32, w [H] float32, eps float) -> [T, H] float32",
        "rmsnorm<<<T, threads>>>(const float* x, const float* w, bf16* out, int H, float eps), "
        "threads = min(1024, max(32, 32 * ceil(H / 4 / 32)))",
        ("rmsnorm", "rmsnorm")),
    "add_rmsnorm": Stage(
        "fn(residual [T, H], delta [T, H], w [H], eps) -> [T, H]; residual += delta IN PLACE first. "
        "Without an add_rmsnorm override but with an rmsnorm one, the engine adds and calls your rmsnorm",
        "add_rmsnorm<<<T, threads>>>(float* residual, const float* delta, const float* w, bf16* out, int H, "
        "float eps), threads as for rmsnorm",
        ("rmsnorm", "add_rmsnorm")),
    "rope": Stage(
        "fn(x [T, n_heads, D] float32, positions [T] int32, cos [P, D/2], sin [P, D/2]) -> [T, n_heads, D]; "
        "called once per layer on the q and k heads together (n_heads = Hq + Hkv); on Qwen models the "
        "q/k/v bias and q/k norm are applied before your function is called; on Qwen3.5 (partial rotary) x "
        "holds the first rotary_dim dimensions of each head and the tables rotary_dim / 2 columns",
        "rope_qkv<<<T, 256>>>(const float* qkv, const int* positions, const float* cos, const float* sin, "
        "bf16* out, int n_rotated = Hq + Hkv, int n_heads = Hq + 2 Hkv, int D): rotates q and k, copies v "
        "(on Qwen models it receives qkv with the bias added and q/k normalized)",
        ("rope", "rope_qkv")),
    "attention": Stage(
        "fn(q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D], scale float) -> [T, Hq, D]: causal GQA of ONE "
        "prompt (called once per prompt of the batch, per layer)",
        "causal_softmax<<<Hq * T, threads>>>(const float* scores [Hq, T, T], bf16* probs [Hq, T, T], int T, "
        "float scale), threads = min(1024, max(32, 32 * ceil(T / 128))); QK^T and PV stay cuBLAS",
        ("attention", "causal_softmax")),
    "swiglu": Stage(
        "fn(gate_up [T, 2I] float32: gate columns first) -> silu(gate) * up, [T, I]",
        "swiglu<<<min(ceil(T*I / 256), 65535), 256>>>(const float* gate_up, bf16* out, long long n = T*I, "
        "int I)",
        ("swiglu", "swiglu")),
    "moe_router": Stage(
        "fn(logits [T, E] float32, k int, norm_topk_prob bool) -> (weights [T, k] float32, experts [T, k] int): "
        "each token's k experts of highest softmax probability, best first, and their weights (renormalised "
        "to sum to 1 when norm_topk_prob); called once per sparse layer of a mixture-of-experts model",
        "moe_route<<<T, 32>>>(const float* logits, float* weights, int* experts, int E, int k, int norm_topk_prob), "
        "compiled with -DMOE_MAX_EXPERTS=1024 (E is at most that)",
        ("moe", "moe_route"), "MOE_MAX_EXPERTS"),
    "sampling": Stage(
        "fn(logits [V] float32, temperature, top_k, top_p, u) -> int token id: one row (temperature 0 = "
        "greedy; u in [0, 1) is the row's uniform draw)",
        "sample_rows<<<R, THREADS>>>(const float* logits [R, V], const float* temperature, const int* top_k, "
        "const float* top_p, const float* u, int* out, int V), compiled with -DTHREADS=1024; with an override "
        "it runs for greedy rows too",
        ("sampling", "sample_rows"), "THREADS"),
    "quant_gemv": Stage(
        "fn(x [T, K] float32, qw QuantizedWeight: int4 qweight uint32 [N, K/8], scales float16 [N, K/G], zeros "
        "uint8 [N, K/G], group_size G) -> x @ dequantize(W)^T, [T, N] float32: every int4 projection of a "
        "quantized model (NumPy backend only: on the GPU override it with CUDA source)",
        "quant_gemv_int4<<<ceil(N / 8), 256>>>(const unsigned short* x, long long ldx, const unsigned* qweight, "
        "const unsigned short* scales, const unsigned char* zeros, float* out, long long ldo, int T <= 8, int N, "
        "int K, int G), compiled with -DQGEMV_MAX_ROWS=8 -DQGEMV_WARPS=8 -DQGEMV_UNROLL=4: int4 decode rows "
        "(1..16, launched 8 rows at a time) of every projection; int8 weights keep the engine's kernels",
        ("quant_gemv", "quant_gemv_int4"), "QGEMV_MAX_ROWS, QGEMV_WARPS, QGEMV_UNROLL"),
    "kv_write": Stage(
        "fn(k [T, Hkv, D], v [T, Hkv, D], k_cache [NP, PS, Hkv, D], v_cache, slot_mapping [T]) -> None: "
        "writes IN PLACE, token t to row slot_mapping[t] of the flattened [NP*PS, Hkv, D] cache "
        "(NumPy backend only: on the GPU override it with CUDA source)",
        "kv_write<<<T, 128>>>(const bf16* qkv, const int* slot_mapping, bf16* k_cache, bf16* v_cache, "
        "int q_dim, int kv_dim)",
        ("kv_write", "kv_write")),
    "paged_attention": Stage(
        "fn(q [R, Hq, D], k_cache, v_cache, page_tables [S, MP], seq_idx [R], positions [R], scale) -> "
        "[R, Hq, D]: row r attends to positions 0..positions[r] of sequence seq_idx[r] "
        "(NumPy backend only: on the GPU override it with CUDA source)",
        "paged_attention<<<(R, Hkv, 1), 32 * NWARPS>>>(same arguments as kernels_cu/paged_attention.cu), "
        "compiled with -DHEAD_DIM=D -DGROUP=Hq/Hkv -DNWARPS=4 and launched with splits = 1 (no merge kernel)",
        ("paged_attention", "paged_attention"), "HEAD_DIM, GROUP, NWARPS"),
    "gated_delta": Stage(
        "fn(q [T, Hk, Dk], k [T, Hk, Dk], v [T, Hv, Dv], g [T, Hv], beta [T, Hv], state [Hv, Dk, Dv]) -> "
        "(o [T, Hv, Dv], the state after the last token): the gated delta rule of ONE sequence in one "
        "linear_attention layer of a Qwen3.5 model (a prompt, a chunk of one, or a decode token); q and k "
        "arrive raw (L2-normalise them, and scale q by 1/sqrt(Dk)); value head h reads key head "
        "h // (Hv / Hk). On the GPU backend it runs on host copies of each sequence's inputs and state",
        "gated_delta_chunked<<<(Hv, S), 128>>>(const float* qkv, long long ld, const float* g, "
        "const float* beta, const float* state_in, float* state_out, const int* slots, const int* cu_seqlens, "
        "float* out, int Hk, int Hv, int Dk, int Dv) (kernels_cu/gated_delta.cu: the engine's own; this stage "
        "takes a NumPy function)",
        ("gated_delta", "gated_delta_chunked")),
}

__doc__ += "".join(f"\n  {name}:\n    NumPy: {s.function}\n    CUDA:  {s.kernel}\n" for name, s in STAGES.items())


@dataclass
class Override:
    """One active replacement: a NumPy function or a CUDA kernel (compiled once per set of defines)."""

    stage: str
    fn: Callable | None = None
    source: str | None = None
    kernel_name: str | None = None
    _kernels: dict = field(default_factory=dict, repr=False)
    # never given twice: the prefix cache names K/V computed under this override by it
    serial: int = field(default_factory=itertools.count().__next__, repr=False)

    def kernel(self, **defines):
        """The learner's kernel as a cupy.RawKernel, compiled by engine.backend's loader."""
        key = tuple(sorted(defines.items()))
        kernel = self._kernels.get(key)
        if kernel is None:
            from engine.backend import compile_source
            module = compile_source(self.source, f"<your {self.stage} kernel>", key)
            try:
                kernel = self._kernels[key] = module.get_function(self.kernel_name)
            except Exception as e:
                raise PluginError(f"your {self.stage} source has no kernel named {self.kernel_name!r} "
                                  f"(declare it extern \"C\" __global__): {e}") from None
        return kernel

    def require_function(self) -> Callable:
        """Called by an op on the NumPy backend: the learner's function (a CUDA override cannot run there)."""
        if self.fn is None:
            raise PluginError(f"the CUDA override of {self.stage!r} runs on the cupy backend; this model runs "
                              f"on NumPy (load it with backend='cupy', or override with a NumPy function)")
        return self.fn


# stage name -> the active override. Read by every op on every call: keep it a plain dict.
OVERRIDES: dict[str, Override] = {}
_LOCK = threading.Lock()


def any_active() -> bool:
    """True while any stage is overridden (CUDA graphs are then neither captured nor replayed)."""
    return bool(OVERRIDES)


@contextmanager
def use_stage(stage: str, fn: Callable | None = None, *, cuda_source: str | None = None,
              kernel: str | None = None):
    """Replace `stage` by your NumPy function `fn`, or by the kernel `kernel` of `cuda_source`, until the
    block ends. The CUDA source is compiled when the block is entered, so a compile error shows here
    (paged_attention's at its first launch, once HEAD_DIM and GROUP are known)."""
    if stage not in STAGES:
        raise PluginError(f"unknown stage {stage!r}; the stages are {', '.join(STAGES)}")
    if (fn is None) == (cuda_source is None):
        raise PluginError("pass exactly one of: a function, or cuda_source= (with kernel=)")
    if fn is not None and not callable(fn):
        raise PluginError(f"the override of {stage!r} must be callable, got {type(fn).__name__}")
    if cuda_source is not None and not (isinstance(cuda_source, str) and isinstance(kernel, str) and kernel):
        raise PluginError("cuda_source= needs the CUDA C text and kernel= the name of its extern \"C\" kernel")
    override = Override(stage, fn, cuda_source, kernel)
    if cuda_source is not None and not STAGES[stage].defines:
        override.kernel()                       # compile now: errors belong to the `with` line
    with _LOCK:
        previous = OVERRIDES.get(stage)
        OVERRIDES[stage] = override
    try:
        yield override
    finally:
        with _LOCK:
            if previous is None:
                OVERRIDES.pop(stage, None)
            else:
                OVERRIDES[stage] = previous


@contextmanager
def use_stages(stages: dict[str, Callable]):
    """Several NumPy function overrides at once: {"rmsnorm": fn, "swiglu": fn2, ...}."""
    with _nested(list(stages.items())):
        yield


@contextmanager
def _nested(items):
    if not items:
        yield
        return
    (stage, fn), rest = items[0], items[1:]
    with use_stage(stage, fn), _nested(rest):
        yield


# ----------------------------------------------------------------------------------------------
# What the ops call to run a NumPy function override on either backend
# ----------------------------------------------------------------------------------------------

def to_host(x):
    """A backend array as the float32/int NumPy array a learner's function expects (bf16 decoded)."""
    from engine.backend import bf16_to_f32, is_device_array
    if not is_device_array(x):
        return x
    host = x.get()
    return bf16_to_f32(host) if host.dtype.name == "uint16" else host


def checked_result(stage: str, got, shape: tuple):
    """The function's result as a float32 NumPy array of `shape`, or a PluginError saying what is wrong."""
    import numpy as np
    try:
        out = np.asarray(got, dtype=np.float32)
    except (TypeError, ValueError) as e:
        raise PluginError(f"your {stage} returned something that is not an array of numbers ({e})") from None
    if out.shape != tuple(shape):
        raise PluginError(f"your {stage} returned shape {out.shape}; the model needs {tuple(shape)}")
    return out


def to_backend(out, like, bf16: bool):
    """Put a host float32 result where the engine's op would have: on the device of `like` (bf16 bits
    when the engine's kernel writes bf16), or leave it on the host for the NumPy backend."""
    from engine.backend import f32_to_bf16, is_device_array
    if not is_device_array(like):
        return out
    import cupy as cp
    return cp.asarray(f32_to_bf16(out)) if bf16 else cp.asarray(out)


def run_function(override: Override, shape: tuple, bf16_on_gpu: bool, like, *args):
    """Call the learner's function on host copies of args; return its checked result on the backend."""
    out = checked_result(override.stage, override.require_function()(*(to_host(a) for a in args)), shape)
    return to_backend(out, like, bf16_on_gpu)


def cache_function_on_gpu(stage: str):
    raise PluginError(f"a NumPy function override of {stage!r} reads or writes the KV cache and runs on the "
                      f"NumPy backend only; on the GPU pass cuda_source= and kernel=")
