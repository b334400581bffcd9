"""Every kernels_cu/*.cu compiles, without a GPU.

With NVRTC (the compiler CuPy uses at run time) when libnvrtc and the CUDA headers are found: NVRTC
has no host headers, so this catches what nvcc would forgive. Otherwise with `nvcc -ptx`.
The paged-attention and flash-attention kernels are compiled for every variant the engine specializes them for;
the others with the launch constants their launchers pass.
"""
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from engine import gpu_compile
from engine.ops import argmax, flash_attention, gemv, moe, paged_attention, quant_gemv, sampling

KERNELS = Path(__file__).resolve().parent.parent / "kernels_cu"
# the engine's kernels, then the GPU track's skeletons (they must compile before the learner starts) and solutions
SOURCES = [p for pattern in ("*.cu", "exercises/*.cu", "exercises/solutions/*.cu") for p in sorted(KERNELS.glob(pattern))]
# the kernel ladders' numbered versions (every build of them: tests/test_kernel_ladders.py)
LADDERS = sorted(KERNELS.glob("ladders/*.cu"))
# Launch constants come from the Python launchers, passed as -D defines like at run time.
LAUNCH_CONSTANTS = {
    "paged_attention.cu": {"NWARPS": paged_attention.NWARPS},
    "flash_attention.cu": {"NWARPS": flash_attention.NWARPS, "BLOCK_N": flash_attention.BLOCK_N},
    "argmax.cu": {"THREADS": argmax.THREADS},
    "sampling.cu": {"THREADS": sampling.SAMPLE_THREADS},
    "gemv.cu": {"GEMV_MAX_ROWS": gemv.GEMV_MAX_ROWS, "NWARPS": gemv.NWARPS, "UNROLL": gemv.UNROLL},
    "quant_gemv.cu": {"QGEMV_MAX_ROWS": quant_gemv.QGEMV_MAX_ROWS, "QGEMV_WARPS": quant_gemv.QGEMV_WARPS,
                      "QGEMV_UNROLL": quant_gemv.QGEMV_UNROLL, "QMMA_WARPS": quant_gemv.QMMA_WARPS,
                      "QMMA_UNROLL": quant_gemv.QMMA_UNROLL, "QMMA_MIN_BLOCKS": quant_gemv.QMMA_MIN_BLOCKS},
    "moe.cu": {"MOE_TILE_M": moe.MOE_TILE_M, "MOE_TILE_N": moe.MOE_TILE_N, "MOE_MAX_EXPERTS": moe.MOE_MAX_EXPERTS},
}
# ... and for the kernels specialized per model shape, every shape the engine compiles them for
VARIANTS = {
    "paged_attention.cu": [{**LAUNCH_CONSTANTS["paged_attention.cu"], "HEAD_DIM": d, "GROUP": g}
                           for d in (16, 32, 64, 128, 256) for g in (1, 3, 4, 8)],
    "flash_attention.cu": [{**LAUNCH_CONSTANTS["flash_attention.cu"], "HEAD_DIM": d, "PAGED": p}
                           for d in flash_attention.KERNEL_HEAD_DIMS for p in (0, 1)],
    **{name: [constants] for name, constants in LAUNCH_CONSTANTS.items()
       if name not in ("paged_attention.cu", "flash_attention.cu")},
}


NVRTC, INCLUDE, NVCC = gpu_compile.nvrtc(), gpu_compile.cuda_include(), shutil.which("nvcc")


def nvrtc_compile(source: Path, defines: dict, arch: int) -> str:
    """'' on success, else NVRTC's log."""
    opts = ["-std=c++17", f"--gpu-architecture=compute_{arch}", f"-I{KERNELS}", f"-I{INCLUDE}"]
    opts += [f"-D{k}={v}" for k, v in defines.items()]
    return gpu_compile.nvrtc_log(source.read_text(), opts, source.name) or ""


# sm_90 (H100/H200, where it is measured) and sm_75 (a T4, the GPU many learners get for free);
# the tensor-core kernels (flash_attention, gemv) also at sm_80, the oldest GPU that runs them (A100).
ARCHS = {"flash_attention.cu": (90, 80, 75), "gemv.cu": (90, 80, 75)}
CASES = [(s, d, a) for s in SOURCES for d in VARIANTS.get(s.name, [{}]) for a in ARCHS.get(s.name, (90, 75))]


@pytest.mark.slow
@pytest.mark.skipif(not ((NVRTC and INCLUDE) or NVCC), reason="neither NVRTC (+ CUDA headers) nor nvcc is available")
@pytest.mark.parametrize("source,defines,arch", CASES, ids=[f"{s.relative_to(KERNELS)}{d or ''}-sm{a}" for s, d, a in CASES])
def test_kernel_compiles(source, defines, arch):
    if NVRTC and INCLUDE:
        log = nvrtc_compile(source, defines, arch)
    else:
        cmd = [NVCC, "-std=c++17", f"-arch=sm_{arch}", "-ptx", f"-I{KERNELS}", "-o", os.devnull, str(source)]
        cmd += [f"-D{k}={v}" for k, v in defines.items()]
        r = subprocess.run(cmd, capture_output=True, text=True)
        log = "" if r.returncode == 0 else r.stderr
    assert log == "", log


def source_defaults(source: Path) -> dict[str, str]:
    """NAME -> value of every `#ifndef NAME / #define NAME value` default in a kernel source."""
    return dict(re.findall(r"^#ifndef (\w+)[^\n]*\n#define \1 (\S+)", source.read_text(), re.M))


@pytest.mark.parametrize("name", sorted(LAUNCH_CONSTANTS))
def test_kernel_defaults_are_the_launch_constants(name):
    """A plain `nvcc kernels_cu/x.cu` builds the kernel the engine launches: its defaults are the
    values the launcher passes (a block size that differed would launch the wrong number of threads)."""
    defaults = source_defaults(KERNELS / name)
    assert {k: defaults.get(k) for k in LAUNCH_CONSTANTS[name]} == {k: str(v) for k, v in LAUNCH_CONSTANTS[name].items()}


@pytest.mark.slow
@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")
@pytest.mark.parametrize("source", SOURCES + LADDERS, ids=[str(s.relative_to(KERNELS)) for s in SOURCES + LADDERS])
def test_kernel_compiles_with_plain_nvcc(source):
    """As a learner would try it: no -D, no -I, from anywhere."""
    r = subprocess.run([NVCC, "-std=c++17", "-arch=sm_90", "-ptx", "-o", os.devnull, str(source)],
                       capture_output=True, text=True, cwd=os.path.dirname(os.devnull))
    assert r.returncode == 0, r.stderr
