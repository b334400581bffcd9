"""The one place that knows about CuPy (chapter 00).

Everything else asks this module:
  * which backend runs (`resolve_backend("auto" | "numpy" | "cupy")`) and, in one sentence, why
    CuPy is not used when it isn't;
  * for a compiled kernel (`load_kernel(stage, name)`), compiled once per stage from
    `kernels_cu/<stage>.cu` with NVRTC, compile errors reported with file and line (and for CUDA
    source text, e.g. a learner's kernel, `load_source`, compiled the same way);
  * for bf16 conversions on the host (`f32_to_bf16`, `bf16_to_f32`), bit-exact with PyTorch;
  * for matrix products on the GPU (`matmul`), cuBLAS `gemmEx` with bf16 operands and fp32 compute.

Device bf16 tensors are CuPy `uint16` arrays holding the raw bits: every CuPy version can hold
them, cuBLAS and the kernels see `__nv_bfloat16`, and the bits are the same as on disk.
"""
from __future__ import annotations

import functools
import os
import re
import time
import types
from dataclasses import dataclass
from pathlib import Path

import numpy as np


def _find_kernels_dir() -> Path:
    """The CUDA sources: $ENGINE_KERNELS_DIR when set; else engine/kernels_cu beside this file (an
    installed package: pyproject.toml maps the repository's top-level kernels_cu/ there); else the
    checkout's top-level kernels_cu/ (an editable install, or the checkout on sys.path)."""
    if os.environ.get("ENGINE_KERNELS_DIR"):
        return Path(os.environ["ENGINE_KERNELS_DIR"])
    package = Path(__file__).resolve().parent
    installed, checkout = package / "kernels_cu", package.parent / "kernels_cu"
    for place in (installed, checkout):
        if place.is_dir():
            return place
    raise FileNotFoundError(f"the CUDA sources (kernels_cu/) are in neither {installed} (an installed package) nor "
                            f"{checkout} (a checkout): reinstall the package, or set ENGINE_KERNELS_DIR to the folder")


KERNELS_DIR = _find_kernels_dir()
BACKENDS = ("auto", "numpy", "cupy")


class BackendError(RuntimeError):
    """The requested backend cannot run here; the message says why in one sentence."""


class KernelCompileError(RuntimeError):
    """NVRTC rejected a kernel source; the message points at kernels_cu/<stage>.cu(line)."""


# ----------------------------------------------------------------------------------------------
# Backend choice
# ----------------------------------------------------------------------------------------------

_PROBE_SOURCE = r"""
#include <cuda_bf16.h>
extern "C" __global__ void probe(float* out) { out[0] = __bfloat162float(__float2bfloat16(1.5f)); }
"""


@functools.cache
def cupy_unavailable_reason() -> str | None:
    """None when CuPy can run kernels here, else one sentence saying why not."""
    try:
        import cupy
    except ImportError:
        return "CuPy is not installed (pip install -e '.[cuda12]' or '.[cuda13]' on a GPU machine)."
    except Exception as exc:  # a broken install raises all sorts of things at import time
        return f"CuPy is installed but fails to import ({type(exc).__name__}: {exc})."
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        text = str(exc)
        if "NoDevice" in text:
            return f"CuPy is installed but no CUDA GPU is visible ({text})."
        return f"CuPy is installed but no usable NVIDIA driver was found ({text})."
    if count == 0:
        return "CuPy is installed but no CUDA GPU is visible."
    try:
        kernel = cupy.RawKernel(_PROBE_SOURCE, "probe", options=("-std=c++17",))
        out = cupy.zeros(1, dtype=cupy.float32)
        kernel((1,), (1,), (out,))
        if float(out[0]) != 1.5:
            return "CuPy compiled a test kernel but it computed a wrong result."
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if "cuda_bf16.h" in str(exc) or "cannot open source file" in str(exc):
            return ("CuPy cannot find the CUDA headers NVRTC needs (cuda_bf16.h); install the "
                    "'[ctk]' extra of cupy or set CUDA_PATH.")
        return f"CuPy cannot compile kernels with NVRTC ({first})."
    return None


@dataclass(frozen=True)
class Backend:
    """Which array library runs the model: `xp` is numpy or cupy."""

    name: str             # "numpy" | "cupy"
    xp: types.ModuleType  # the array module
    reason: str | None    # why CuPy is not used (None when it is)

    @property
    def is_gpu(self) -> bool:
        return self.name == "cupy"

    def synchronize(self) -> None:
        """Wait for the device to finish queued work (a no-op on the CPU): call before reading a clock."""
        if self.is_gpu:
            self.xp.cuda.Device().synchronize()

    def describe(self) -> str:
        if self.is_gpu:
            return f"cupy on {gpu_name()}"
        return f"numpy (CPU): {self.reason}" if self.reason else "numpy (CPU)"


def resolve_backend(name: str | Backend = "auto") -> Backend:
    """'auto' = CuPy when a GPU is usable, else NumPy; 'cupy' raises BackendError if impossible."""
    if isinstance(name, Backend):
        return name
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    if name == "numpy":
        return Backend("numpy", np, "the NumPy backend was asked for.")
    reason = cupy_unavailable_reason()
    if reason is None:
        import cupy
        return Backend("cupy", cupy, None)
    if name == "cupy":
        raise BackendError(f"backend 'cupy' is not usable: {reason}")
    return Backend("numpy", np, reason)


def gpu_name() -> str:
    import cupy
    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    return props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])


def copy_bandwidth(backend: Backend) -> float:
    """Measured copy bandwidth in GB/s (bytes read + written): the ceiling for memory-bound steps.
    2 GiB copied on the GPU (far past its 60 MB L2), 256 MiB on the CPU; best of five."""
    xp = backend.xp
    n = 2**29 if backend.is_gpu else 2**26
    a, b = xp.ones(n, dtype=xp.float32), xp.empty(n, dtype=xp.float32)
    best = float("inf")
    for _ in range(5):
        backend.synchronize()
        t = time.perf_counter()
        b[...] = a
        backend.synchronize()
        best = min(best, time.perf_counter() - t)
    return 2 * n * 4 / best / 1e9


def gemm_tflops(backend: Backend) -> float:
    """Measured bf16 GEMM rate in TFLOP/s (cuBLAS, 8192^3, fp32 accumulation): the tensor cores'
    practical peak, the ceiling for compute-bound steps (prefill). GPU only; best of five."""
    xp, n = backend.xp, 8192
    a = xp.asarray(f32_to_bf16(np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)))
    out = xp.empty((n, n), dtype=xp.uint16)
    matmul(a, a, out, trans_b=True)                  # warm-up (cuBLAS picks its algorithm)
    best = float("inf")
    for _ in range(5):
        backend.synchronize()
        t = time.perf_counter()
        matmul(a, a, out, trans_b=True)
        backend.synchronize()
        best = min(best, time.perf_counter() - t)
    return 2 * n ** 3 / best / 1e12


def is_device_array(x) -> bool:
    """True for a CuPy array (without importing CuPy when it was never imported)."""
    return type(x).__module__.startswith("cupy")


# ----------------------------------------------------------------------------------------------
# Kernel loader: kernels_cu/<stage>.cu -> cupy.RawModule, compiled once per stage
# ----------------------------------------------------------------------------------------------

NVRTC_OPTIONS = ("-std=c++17", "--use_fast_math")


def kernel_path(stage: str) -> Path:
    if not re.fullmatch(r"[a-z0-9_]+", stage):
        raise ValueError(f"kernel stage names are lowercase identifiers, got {stage!r}")
    return KERNELS_DIR / f"{stage}.cu"


@functools.cache
def load_module(stage: str, defines: tuple = ()):
    """Compile kernels_cu/<stage>.cu once per set of -D defines; errors name the file and line.

    `defines` are (NAME, value) pairs that specialize a kernel at compile time (e.g. HEAD_DIM),
    so that its per-thread arrays have fixed sizes and live in registers.
    """
    path = kernel_path(stage)
    if not path.is_file():
        raise FileNotFoundError(f"no kernel source {path}")
    return compile_source(path.read_text(), path, defines)


@functools.lru_cache(maxsize=64)
def load_source(source: str, origin: str = "kernel.cu", defines: tuple = ()):
    """compile_source, cached by the text: a checker compiles the same learner kernel once per case."""
    return compile_source(source, origin, defines)


def compile_source(source: str, origin, defines: tuple = ()):
    """Compile CUDA C text with the engine's NVRTC options (kernels_cu/ on the include path) into a
    cupy.RawModule. `origin` (a path, or a label such as "<your rmsnorm kernel>") names the source in
    compile errors. Used for kernels_cu/ and for a learner's kernel (engine/plugins.py, engine/exercises/).
    A source read from a file also finds its includes next to it, as nvcc does (kernels_cu/ladders/)."""
    import cupy
    beside = (f"-I{origin.parent}",) if isinstance(origin, Path) else ()
    options = NVRTC_OPTIONS + (f"-I{KERNELS_DIR}",) + beside + tuple(f"-D{k}={v}" for k, v in defines)
    try:
        module = cupy.RawModule(code=source, options=options)
        module.compile()  # compile now, not at first launch, so the error surfaces here
    except cupy.cuda.compiler.CompileException as exc:
        raise KernelCompileError(_point_at_source(str(exc), origin)) from None
    return module


_KERNELS: dict = {}


def load_kernel(stage: str, name: str, **defines):
    """The `extern "C"` kernel `name` of kernels_cu/<stage>.cu as a cupy.RawKernel.

    Looked up in a plain dict first: this sits on the decode loop's hot path (a few hundred
    launches per token), where even microseconds of Python per launch add up.
    """
    key = (stage, name, *defines.items())
    kernel = _KERNELS.get(key)
    if kernel is None:
        kernel = _KERNELS[key] = load_module(stage, tuple(sorted(defines.items()))).get_function(name)
    return kernel


@functools.cache
def tensor_cores_usable(device_id: int) -> bool:
    """bf16 mma.sync (the GEMV, flash and paged attention kernels) needs sm_80 (Ampere) or newer."""
    import cupy
    return int(cupy.cuda.Device(device_id).compute_capability) >= 80


@functools.cache
def sm_count(device_id: int = 0) -> int:
    """Number of streaming multiprocessors (asked once: the attribute query is slow)."""
    import cupy
    return cupy.cuda.runtime.deviceGetAttribute(cupy.cuda.runtime.cudaDevAttrMultiProcessorCount, device_id)


def _point_at_source(log: str, origin) -> str:
    """NVRTC names a temporary file; rewrite 'tmpXYZ.cu(12): error' as 'kernels_cu/x.cu(12): error'."""
    if isinstance(origin, Path):   # kernels_cu/x.cu, kernels_cu/exercises/x.cu: relative to the repository
        origin = origin.relative_to(KERNELS_DIR.parent) if KERNELS_DIR.parent in origin.parents else origin
    lines = [re.sub(r"\S*\.cu\((\d+)\)", lambda m: f"{origin}({m.group(1)})", ln) for ln in log.splitlines()]
    errors = [ln for ln in lines if "error" in ln]
    head = errors[0] if errors else (lines[0] if lines else "unknown error")
    return f"{origin} failed to compile: {head}\n" + "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# bf16 on the host: the top 16 bits of an IEEE float32, rounded to nearest even
# ----------------------------------------------------------------------------------------------

def f32_to_bf16(x) -> np.ndarray:
    """float32 -> bf16 bits (uint16), round-to-nearest-even (bit-exact with PyTorch for every
    non-NaN value); NaN -> 0x7FC0, the canonical quiet NaN of PyTorch's scalar conversion."""
    x = np.asarray(x, dtype=np.float32)
    shape = x.shape
    x = np.ascontiguousarray(x).reshape(-1)           # 0-d arrays too
    bits = x.view(np.uint32)
    # Adding 0x7FFF plus the lowest kept bit rounds to nearest, ties to even.
    rounded = (bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16)
    out = rounded.astype(np.uint16)
    out[np.isnan(x)] = 0x7FC0
    return out.reshape(shape)


def bf16_to_f32(bits) -> np.ndarray:
    """bf16 bits (uint16) -> float32, exact (shift the bits back into the top half)."""
    bits = np.asarray(bits, dtype=np.uint16)
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32).reshape(bits.shape)


def round_to_bf16(x) -> np.ndarray:
    """float32 values rounded to the nearest bf16 (still float32): what the GPU stores."""
    return bf16_to_f32(f32_to_bf16(x))


# ----------------------------------------------------------------------------------------------
# cuBLAS matmul (row-major view of a column-major library)
# ----------------------------------------------------------------------------------------------
# cuBLAS is column-major: it sees a row-major [M, K] array as a column-major K x M matrix. So a
# row-major product C[M,N] = A[M,K] @ op(B) is computed as the column-major product
#     C^T (N x M) = op(B)^T (N x K) @ A^T (K x M),
# i.e. we call gemm with the operands swapped: first operand B, second operand A, m=N, n=M.
# With nn.Linear weights stored [out, in] = [N, K], `trans_b=True` gives y = x @ W^T.

_CUDA_DTYPE = {np.dtype(np.uint16): 14, np.dtype(np.float32): 0}   # CUDA_R_16BF, CUDA_R_32F
_CUBLAS_COMPUTE_32F = 68
_CUBLAS_GEMM_DEFAULT = -1
_OP_N, _OP_T = 0, 1
_WORKSPACE_BYTES = 32 * 2**20


class _Cublas:
    """cuBLAS called directly through ctypes, on a handle of our own.

    Why not CuPy's cuBLAS bindings: they refuse to run while a stream is being captured into a CUDA
    graph, and the decode step is captured (engine/runtime/cuda_graphs.py). cuBLAS itself supports capture
    once the handle has a preallocated workspace (no allocation may happen inside a capture).
    """

    def __init__(self):
        import ctypes

        import cupy
        self.ctypes = ctypes
        self.lib = ctypes.CDLL(_cublas_library_path())
        self.handle = ctypes.c_void_p()
        self._check(self.lib.cublasCreate_v2(ctypes.byref(self.handle)), "cublasCreate")
        self.workspace = cupy.empty(_WORKSPACE_BYTES, dtype=cupy.uint8)
        self._check(self.lib.cublasSetWorkspace_v2(self.handle, ctypes.c_void_p(self.workspace.data.ptr),
                                                   ctypes.c_size_t(_WORKSPACE_BYTES)), "cublasSetWorkspace")
        self.scalars = np.zeros(2, dtype=np.float32)    # alpha, beta (host pointer mode, the default)
        c = ctypes
        self.lib.cublasGemmEx.argtypes = [c.c_void_p, c.c_int, c.c_int, c.c_int, c.c_int, c.c_int, c.c_void_p,
                                          c.c_void_p, c.c_int, c.c_int, c.c_void_p, c.c_int, c.c_int, c.c_void_p,
                                          c.c_void_p, c.c_int, c.c_int, c.c_int, c.c_int]
        self.lib.cublasGemmStridedBatchedEx.argtypes = [
            c.c_void_p, c.c_int, c.c_int, c.c_int, c.c_int, c.c_int, c.c_void_p,
            c.c_void_p, c.c_int, c.c_int, c.c_longlong, c.c_void_p, c.c_int, c.c_int, c.c_longlong, c.c_void_p,
            c.c_void_p, c.c_int, c.c_int, c.c_longlong, c.c_int, c.c_int, c.c_int]
        self.lib.cublasSetStream_v2.argtypes = [c.c_void_p, c.c_void_p]

    @staticmethod
    def _check(status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(f"{what} failed with cuBLAS status {status}")

    def gemm(self, op_b, m, n, k, alpha, beta, b, tb, ldb, sb, a, ta, lda, sa, c, tc, ldc, sc, batch):
        import cupy
        self._check(self.lib.cublasSetStream_v2(self.handle, cupy.cuda.get_current_stream().ptr), "cublasSetStream")
        self.scalars[:] = (alpha, beta)
        pa = self.scalars.ctypes.data
        pb = pa + 4
        if batch == 1:
            status = self.lib.cublasGemmEx(self.handle, op_b, _OP_N, m, n, k, pa, b, tb, ldb, a, ta, lda, pb,
                                           c, tc, ldc, _CUBLAS_COMPUTE_32F, _CUBLAS_GEMM_DEFAULT)
        else:
            status = self.lib.cublasGemmStridedBatchedEx(self.handle, op_b, _OP_N, m, n, k, pa, b, tb, ldb, sb,
                                                         a, ta, lda, sa, pb, c, tc, ldc, sc, batch,
                                                         _CUBLAS_COMPUTE_32F, _CUBLAS_GEMM_DEFAULT)
        self._check(status, "cublasGemmEx")


def _cublas_library_path() -> str:
    """The libcublas CuPy uses (found by cuda-pathfinder), else the system's."""
    import ctypes.util
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib
        return load_nvidia_dynamic_lib("cublas").abs_path
    except Exception:
        pass
    for name in ("libcublas.so.13", "libcublas.so.12", ctypes.util.find_library("cublas")):
        if name:
            try:
                ctypes.CDLL(name)
                return name
            except OSError:
                continue
    raise BackendError("cannot find libcublas (install the CUDA toolkit or the cuda extra)")


@functools.cache
def _cublas_for_device(device_id: int) -> _Cublas:
    return _Cublas()


def _matrix_layout(x, what: str):
    """(leading dimension, batch stride) in elements of a [.., rows, cols] view with unit col stride."""
    item = x.dtype.itemsize
    if x.ndim not in (2, 3) or x.strides[-1] != item:
        raise ValueError(f"matmul: {what} must be 2-D or 3-D with contiguous rows, got shape "
                         f"{x.shape} strides {x.strides}")
    ld = x.strides[-2] // item
    batch_stride = x.strides[0] // item if x.ndim == 3 else 0
    return max(ld, 1), batch_stride


def matmul(a, b, out, *, trans_b: bool = False, alpha: float = 1.0, beta: float = 0.0):
    """Row-major out = alpha * a @ op(b) + beta * out on the GPU through cuBLAS gemmEx.

    a:   [(batch,) M, K]                  bf16 (uint16) or float32 CuPy array
    b:   [(batch,) N, K] if trans_b else [(batch,) K, N]   same dtype as a
    out: [(batch,) M, N]                  float32 or bf16 (uint16); accumulation is always fp32
    Views with a row stride (e.g. one head's columns of a [T, H*D] matrix) are fine; a 3-D
    operand's batch stride may be 0 to broadcast it.
    """
    if a.dtype != b.dtype or a.dtype not in _CUDA_DTYPE or out.dtype not in _CUDA_DTYPE:
        raise ValueError(f"matmul: unsupported dtypes a={a.dtype} b={b.dtype} out={out.dtype}")
    M, K = a.shape[-2:]
    N = b.shape[-2] if trans_b else b.shape[-1]
    Kb = b.shape[-1] if trans_b else b.shape[-2]
    batch = out.shape[0] if out.ndim == 3 else 1
    if Kb != K or out.shape[-2:] != (M, N):
        raise ValueError(f"matmul: shapes do not chain: a{a.shape} b{b.shape} (trans_b={trans_b}) out{out.shape}")
    for x in (a, b):
        if x.ndim == 3 and x.shape[0] != batch:
            raise ValueError(f"matmul: batch sizes differ: a{a.shape} b{b.shape} out{out.shape}")
    lda, sa = _matrix_layout(a, "a")
    ldb, sb = _matrix_layout(b, "b")
    ldc, sc = _matrix_layout(out, "out")
    import cupy
    _cublas_for_device(cupy.cuda.Device().id).gemm(
        _OP_T if trans_b else _OP_N, N, M, K, alpha, beta,
        b.data.ptr, _CUDA_DTYPE[b.dtype], ldb, sb, a.data.ptr, _CUDA_DTYPE[a.dtype], lda, sa,
        out.data.ptr, _CUDA_DTYPE[out.dtype], ldc, sc, batch)
    return out
