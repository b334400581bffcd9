"""Run the ladder kernels of kernels_cu/ladders/ on the CPU, to check their logic without a GPU.

The kernel source is compiled with the host C++ compiler against a small header that gives it what
CUDA C provides: threadIdx / blockIdx / blockDim / gridDim, __syncthreads (a std::barrier over the
block's threads), warp shuffles (an exchange through a per-warp buffer between two barriers),
shared memory (one block runs at a time, so a `static` array is the block's), integer atomicAdd,
bf16 conversions rounded to nearest even, uint4 / float4. Every thread of a block is a std::thread; blocks run one
after the other. Inline PTX (mma.sync, ldmatrix, cp.async) is not emulated: the ladder files use
none (the engine's tensor-core kernels are checked on the GPU), and common.cuh's cp.async helpers take
their plain-copy branch, as on a GPU below sm_80.

    kern = HostKernels(KERNELS / "ladders" / "rmsnorm.cu", {"VPT": 4})
    kern.launch("rmsnorm_v4_float4", grid=(T,), block=(64,), args=[x, w, out, np.int32(H), np.float32(eps)])

Arguments: NumPy arrays (passed by pointer, written in place) and NumPy scalars of the kernel's
parameter types, as for CuPy's RawKernel.
"""
from __future__ import annotations

import ctypes
import hashlib
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

KERNELS = Path(__file__).resolve().parents[2] / "kernels_cu"
CXX = shutil.which("g++") or shutil.which("clang++")

HEADER = r"""
#pragma once
#include <barrier>
#include <cmath>
#include <cstring>
#include <cstdint>
#include <functional>
#include <memory>
#include <thread>
#include <vector>
#include <algorithm>
using std::min; using std::max;

struct dim3 { unsigned x = 1, y = 1, z = 1; };
struct uint2 { unsigned x, y; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct float2 { float x, y; };
struct alignas(16) float4 { float x, y, z, w; };
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
inline float2 make_float2(float a, float b) { return {a, b}; }

namespace emu {
struct Block {
    std::barrier<> *all;
    std::vector<std::unique_ptr<std::barrier<>>> warp;
    std::vector<float> slot;   // 32 per warp
};
inline Block *block = nullptr;
}
inline thread_local dim3 threadIdx;
inline dim3 blockIdx, blockDim, gridDim;
inline thread_local int emu_tid = 0;

inline void __syncthreads() { emu::block->all->arrive_and_wait(); }
inline void __syncwarp(unsigned = 0xffffffffu) { emu::block->warp[emu_tid / 32]->arrive_and_wait(); }
template <typename T> inline T __shfl_xor_sync(unsigned, T v, int off) {
    static_assert(sizeof(T) == 4, "32-bit shuffles only");
    float* s = emu::block->slot.data() + 32 * (emu_tid / 32);
    const int lane = emu_tid % 32;
    std::memcpy(&s[lane], &v, 4);
    __syncwarp();
    T r;
    std::memcpy(&r, &s[lane ^ off], 4);
    __syncwarp();
    return r;
}
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float __expf(float x) { return std::exp(x); }
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
template <typename T> inline T __ldg(const T* p) { return *p; }
template <typename T> inline T atomicAdd(T* p, T v) { return __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }
[[noreturn]] inline void __trap() { std::abort(); }

struct __nv_bfloat16 { unsigned short x; };
struct __nv_bfloat162 { __nv_bfloat16 x, y; };
inline float __bfloat162float(__nv_bfloat16 b) { unsigned u = (unsigned)b.x << 16; float f; std::memcpy(&f, &u, 4); return f; }
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
    unsigned u; std::memcpy(&u, &f, 4);
    if (std::isnan(f)) return {0x7FC0};
    u = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    return {(unsigned short)u};
}
inline __nv_bfloat16 __float2bfloat16(float f) { return __float2bfloat16_rn(f); }
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) { return {__float2bfloat16_rn(a), __float2bfloat16_rn(b)}; }
inline float2 __bfloat1622float2(__nv_bfloat162 v) { return {__bfloat162float(v.x), __bfloat162float(v.y)}; }

alignas(16) inline unsigned char emu_dynamic_smem[228 * 1024];

namespace emu {
inline void run(dim3 grid, dim3 blk, const std::function<void()>& body) {
    gridDim = grid; blockDim = blk;
    const int n = blk.x * blk.y * blk.z;
    for (unsigned bz = 0; bz < grid.z; ++bz) for (unsigned by = 0; by < grid.y; ++by) for (unsigned bx = 0; bx < grid.x; ++bx) {
        blockIdx = {bx, by, bz};
        std::barrier<> all(n);
        Block b{&all, {}, std::vector<float>(32 * ((n + 31) / 32))};
        for (int w = 0; w < (n + 31) / 32; ++w) b.warp.emplace_back(new std::barrier<>(std::min(32, n - 32 * w)));
        block = &b;
        std::vector<std::thread> threads;
        for (int t = 0; t < n; ++t) threads.emplace_back([&, t] {
            emu_tid = t;
            threadIdx = {unsigned(t % blk.x), unsigned((t / blk.x) % blk.y), unsigned(t / (blk.x * blk.y))};
            body();
            b.all->arrive_and_drop();                 // an exited thread no longer holds barriers up
            b.warp[t / 32]->arrive_and_drop();
        });
        for (auto& th : threads) th.join();
        block = nullptr;
    }
}
}
"""

BF16_H = "#pragma once\n#include \"emu_cuda.h\"\n"
PREAMBLE = ("#include \"emu_cuda.h\"\n#define __global__\n#define __device__\n#define __forceinline__ inline\n"
            "#define __shared__ static\n#define __launch_bounds__(...)\n#define __align__(n) __attribute__((aligned(n)))\n")


def _strip_comments(src: str) -> str:
    return re.sub(r"//[^\n]*", "", re.sub(r"/\*.*?\*/", "", src, flags=re.S))


def kernel_signatures(src: str) -> dict[str, list[str]]:
    """name -> parameter C types of every extern "C" __global__ kernel of `src`."""
    out = {}
    for m in re.finditer(r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s*)?(\w+)\s*\(([^)]*)\)',
                         _strip_comments(src)):
        params = [p.strip() for p in m.group(2).split(",") if p.strip()]
        out[m.group(1)] = [re.sub(r"\b__restrict__\b", "", p.rsplit(None, 1)[0] if "*" not in p.split()[-1]
                                  else p[:p.rindex("*") + 1]).strip() for p in params]
    return out


def _ctype(c_type: str):
    if "*" in c_type:
        return ctypes.c_void_p
    return {"int": ctypes.c_int, "long long": ctypes.c_longlong, "float": ctypes.c_float,
            "unsigned": ctypes.c_uint}[c_type.replace("const ", "").strip()]


class HostKernels:
    """The kernels of one .cu file compiled for the CPU (one shared library per source + defines)."""

    def __init__(self, source: Path, defines: dict | None = None):
        if CXX is None:
            raise RuntimeError("no host C++ compiler (g++ or clang++)")
        text = source.read_text()
        self.signatures = kernel_signatures(text)
        # dynamic shared memory: `extern __shared__ T name[];` -> a pointer to the emulator's buffer
        body = re.sub(r"extern\s+__shared__\s+(\w+)\s+(\w+)\[\];",
                      r"\1* \2 = reinterpret_cast<\1*>(emu_dynamic_smem);", text)
        wrappers = []
        for name, types in self.signatures.items():
            params = ", ".join(f"{t} a{i}" for i, t in enumerate(types))
            call = ", ".join(f"a{i}" for i in range(len(types)))
            wrappers.append(f'extern "C" void emu_{name}(unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, '
                            f'unsigned bz{", " + params if params else ""}) '
                            f'{{ emu::run({{gx, gy, gz}}, {{bx, by, bz}}, [&] {{ {name}({call}); }}); }}')
        defs = "".join(f"#define {k} {v}\n" for k, v in (defines or {}).items())
        unit = defs + PREAMBLE + f'#line 1 "{source}"\n' + body + "\n" + "\n".join(wrappers) + "\n"
        key = hashlib.sha1(unit.encode()).hexdigest()[:16]
        self.tmp = Path(tempfile.gettempdir()) / f"ladder_emu_{key}"
        self.tmp.mkdir(exist_ok=True)
        (self.tmp / "emu_cuda.h").write_text(HEADER)
        (self.tmp / "cuda_bf16.h").write_text(BF16_H)
        lib = self.tmp / "kernels.so"
        if not lib.exists():
            (self.tmp / "unit.cpp").write_text(unit)
            r = subprocess.run([CXX, "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", "-w", f"-I{self.tmp}",
                                f"-I{KERNELS}", f"-I{KERNELS / 'ladders'}", "-o", str(lib) + ".part", str(self.tmp / "unit.cpp")],
                               capture_output=True, text=True)
            if r.returncode != 0:
                raise RuntimeError(f"host compile of {source} failed:\n{r.stderr[-4000:]}")
            Path(str(lib) + ".part").rename(lib)
        self.lib = ctypes.CDLL(str(lib))

    def launch(self, name: str, grid, block, args) -> None:
        grid, block = tuple(grid) + (1,) * (3 - len(grid)), tuple(block) + (1,) * (3 - len(block))
        types = self.signatures[name]
        if len(args) != len(types):
            raise TypeError(f"{name} takes {len(types)} arguments, got {len(args)}")
        cargs = []
        for a, t in zip(args, types):
            if "*" in t:
                if not (isinstance(a, np.ndarray) and a.flags.c_contiguous):
                    raise TypeError(f"{name}: a {t} argument must be a C-contiguous NumPy array")
                cargs.append(ctypes.c_void_p(a.ctypes.data))
            else:
                cargs.append(_ctype(t)(a.item() if isinstance(a, np.generic) else a))
        getattr(self.lib, f"emu_{name}")(*[ctypes.c_uint(v) for v in grid + block], *cargs)
