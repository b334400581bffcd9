"""`python -m engine.env`: the first thing a workshop participant runs (chapter 00).

Prints one [OK] / [FAIL] / [SKIP] line per component and exits 0 only when the chosen backend
(--backend, default auto) can run. A missing GPU stack is [SKIP], not [FAIL], unless --backend cupy
was asked for. With auto that is always true: NumPy is the fallback, and the
last line says which backend will run and, if it is not CuPy, why.
"""
from __future__ import annotations

import argparse
import platform
import shutil
import subprocess
import sys

from engine.backend import BACKENDS, BackendError, cupy_unavailable_reason, resolve_backend


def line(status: str, what: str, detail: str = "") -> None:
    print(f"[{status}] {what:<16} {detail}".rstrip())


ENABLE_GPU = "to enable the GPU: pip install -e '.[cuda12]' (or '.[cuda13]') on a machine with an NVIDIA GPU"


def check_gpu_stack(required: bool) -> None:
    """GPU components; a missing one is a [FAIL] only when the CuPy backend was asked for, else [SKIP]:
    the NumPy backend runs everything, and the line says what would enable the GPU."""
    missing = "FAIL" if required else "SKIP"
    try:
        import cupy
    except ImportError:
        line(missing, "CuPy", f"not installed; the NumPy backend runs instead ({ENABLE_GPU})")
        return
    except Exception as exc:
        line(missing, "CuPy", f"installed but fails to import ({type(exc).__name__}); NumPy backend runs instead")
        return
    line("OK", "CuPy", cupy.__version__)
    rt = cupy.cuda.runtime
    try:
        driver = rt.driverGetVersion()
    except Exception as exc:
        driver, why = 0, str(exc)
    else:
        why = "no NVIDIA driver is installed or visible"
    if driver == 0:
        line(missing, "CUDA driver", f"{why}; the NumPy backend runs instead")
        return
    line("OK", "CUDA driver", _cuda_version(driver))
    try:
        line("OK", "CUDA runtime", _cuda_version(rt.runtimeGetVersion()))
    except Exception as exc:
        line("FAIL", "CUDA runtime", str(exc))
    try:
        n = rt.getDeviceCount()
    except Exception as exc:
        line("FAIL", "GPU", str(exc))
        return
    for i in range(n):
        p = rt.getDeviceProperties(i)
        name = p["name"].decode() if isinstance(p["name"], bytes) else p["name"]
        line("OK", f"GPU {i}", f"{name}, compute capability {p['major']}.{p['minor']}, "
                                f"{p['totalGlobalMem'] / 2**30:.1f} GiB, {p['multiProcessorCount']} SMs")
    reason = cupy_unavailable_reason()
    line("OK" if reason is None else missing, "NVRTC kernel",
         "compiled and ran a bf16 test kernel" if reason is None else reason)


def _cuda_version(v: int) -> str:
    return f"{v // 1000}.{(v % 1000) // 10}"


def check_tools() -> None:
    nvcc = shutil.which("nvcc")
    if nvcc:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout.strip().splitlines()
        line("OK", "nvcc", out[-1] if out else nvcc)
    else:
        line("SKIP", "nvcc", "not on PATH (optional: only needed to compile kernels ahead of time)")
    try:
        import jupyterlab
        line("OK", "JupyterLab", jupyterlab.__version__)
    except ImportError:
        line("FAIL", "JupyterLab", "not installed (pip install jupyterlab) - needed to follow the chapters")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Check this machine for the engine's CPU and GPU backends.")
    ap.add_argument("--backend", default="auto", choices=BACKENDS)
    args = ap.parse_args(argv)
    ok_py = sys.version_info >= (3, 10)
    line("OK" if ok_py else "FAIL", "Python", f"{platform.python_version()} ({sys.executable})")
    import numpy
    line("OK", "NumPy", numpy.__version__)
    check_gpu_stack(required=args.backend == "cupy")
    check_tools()
    try:
        backend = resolve_backend(args.backend)
    except BackendError as exc:
        line("FAIL", "backend", str(exc))
        return 1
    line("OK", "backend", backend.describe())
    return 0 if ok_py else 1


if __name__ == "__main__":
    sys.exit(main())
