"""Compiling CUDA C for the GPU on a machine without one: NVRTC (CuPy's or NVIDIA's wheels, or the CUDA
toolkit) with the toolkit's or the wheels' headers, else nvcc. Used by the CPU executor's compile check
(engine/exercises/cuda_cpu), the kernel ladders (engine/bench/ladder.py) and the compile tests.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import glob
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path


def site_dirs() -> list[str]:
    dirs = list(sys.path)
    try:
        import site
        dirs += site.getsitepackages() + [site.getusersitepackages()]
    except Exception:   # a virtualenv without site's helpers
        pass
    return [d for d in dict.fromkeys(dirs) if d and os.path.isdir(d)]


@functools.cache
def nvrtc():
    """libnvrtc (CuPy's or NVIDIA's wheels, CUDA_PATH, the loader's path) loaded, or None."""
    roots = [os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME"), "/usr/local/cuda"]
    candidates = [os.path.join(r, sub, "libnvrtc.so*") for r in roots if r for sub in ("lib64", "lib")]
    for site in site_dirs():
        candidates += [os.path.join(site, "nvidia", d, "lib", "libnvrtc.so*") for d in ("cu13", "cu12", "cuda_nvrtc")]
    paths = [p for c in candidates for p in sorted(glob.glob(c)) if "builtins" not in p and "alt" not in p]
    found = ctypes.util.find_library("nvrtc")
    for path in paths + ([found] if found else []):
        try:
            # a wheel's libnvrtc finds its builtins library only if it is loaded first (it is not on the loader's path)
            for builtins in glob.glob(os.path.join(os.path.dirname(path), "libnvrtc-builtins.so.*")):
                if ".alt." not in builtins:
                    ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


@functools.cache
def cuda_include() -> str | None:
    """A folder with cuda_bf16.h for NVRTC (the CUDA toolkit, or NVIDIA's runtime wheels)."""
    roots = [os.path.join(r, "include") for r in (os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME"),
                                                  "/usr/local/cuda") if r]
    for site in site_dirs():
        roots += [os.path.join(site, "nvidia", d, "include") for d in ("cu13", "cu12", "cuda_runtime")]
    return next((r for r in roots if os.path.isfile(os.path.join(r, "cuda_bf16.h"))), None)


def compiler() -> str | None:
    """"NVRTC", "nvcc" or None: what compiles a kernel for the GPU here (no GPU needed)."""
    if nvrtc() is not None and cuda_include() is not None:
        return "NVRTC"
    if shutil.which("nvcc"):
        return "nvcc"
    return None


def nvrtc_log(text: str, options: list[str], name: str = "kernel.cu") -> str | None:
    """None when NVRTC compiles `text` with `options`, else its log (callers checked compiler())."""
    lib = nvrtc()
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), text.encode(), name.encode(), 0, None, None) != 0:
        return "NVRTC could not create a program from the source"
    opts = [o.encode() for o in options]
    status = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return None if status == 0 else log.value.decode(errors="replace")


def nvcc_log(text: str, options: list[str], name: str = "kernel.cu") -> str | None:
    """None when nvcc compiles `text` to PTX with `options`, else its log."""
    name = Path(name).name
    with tempfile.TemporaryDirectory(prefix="engine_nvcc_") as tmp:
        (Path(tmp) / name).write_text(text)
        cmd = [shutil.which("nvcc") or "nvcc", *options, "-ptx", "-o", os.devnull, name]
        try:
            r = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, timeout=120)
        except subprocess.TimeoutExpired:
            return f"{name}(1): error: nvcc did not finish within 120 s"
    return None if r.returncode == 0 else (r.stderr or r.stdout)
