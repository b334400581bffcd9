"""The CPU executor (engine/exercises/cuda_cpu): the GPU track's checker on a machine without a GPU.

Every worked solution passes its checker there; the deliberately broken kernels of the GPU tests get
the same named diagnosis (a race without __syncthreads included: three thread orders); compile errors
name the learner's line; endless loops, out-of-range accesses, deadlocks and wrong parameter types
get a verdict instead of a hang or a crash. The emulated CUDA itself (bf16 rounding, warp shuffles,
__syncthreads, shared memory) is checked on small kernels against NumPy.
"""
import platform
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from engine.backend import f32_to_bf16
from engine.exercises import cuda_check
from engine.exercises.cuda_check import POISON, Case, diagnose
from engine.exercises.cuda_cpu import executor as cuda_cpu
from engine.exercises.record_gpu import CHECKERS

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_ch03_11_cuda_exercises import BROKEN, _exercise, _solution  # noqa: E402

pytestmark = pytest.mark.skipif(cuda_cpu.unavailable_reason() is not None,
                                reason=f"no CPU executor here: {cuda_cpu.unavailable_reason()}")

# Where a CPU says more than a GPU: reading past an input buffer faults here (between inaccessible
# pages), where a GPU reads whatever lies beyond and the guard region only sees the writes.
CPU_EXPECTED = {("swiglu", "missing bounds check"): "a read 549 bytes past the end of argument 1 (gate_up)"}


def check_on_cpu(name, source, capsys):
    """(verdict, printed) of the CPU path of check_kernel, whatever this machine has."""
    verdict = cuda_check._check_on_cpu(_exercise(name), source, "no GPU in this test")
    return verdict, capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CHECKERS))
def test_every_worked_solution_passes_on_the_cpu_executor(name, capsys):
    verdict, out = check_on_cpu(name, cuda_check.SOLUTIONS_DIR / f"{name}.cu", capsys)
    assert verdict is True, out
    assert out.startswith(f"[OK] {_exercise(name).title}: all ") and "on the CPU executor" in out
    assert "speed not measured" in out and "yours" not in out


@pytest.mark.slow
@pytest.mark.parametrize("name", ["rmsnorm", "paged_attention"])
def test_a_skeleton_is_not_yet_written(name, capsys):
    verdict, out = check_on_cpu(name, None, capsys)
    assert verdict is False and "no output element was written" in out, out


@pytest.mark.slow
@pytest.mark.parametrize("name,old,new,expected", BROKEN, ids=[f"{b[0]}-{b[3][:24]}" for b in BROKEN])
def test_a_broken_kernel_gets_the_right_diagnosis_on_the_cpu(name, old, new, expected, capsys):
    source = _solution(name)
    assert old in source, old
    verdict, out = check_on_cpu(name, source.replace(old, new), capsys)
    assert verdict is False and out.startswith("[x]"), out
    assert CPU_EXPECTED.get((name, expected), expected) in out, out


def _line_of(source: str, needle: str) -> int:
    return next(i for i, line in enumerate(source.splitlines(), 1) if needle in line)


@pytest.mark.parametrize("gpu_tool", ["this machine's", "none"])
def test_a_compile_error_names_the_learners_line(gpu_tool, capsys, monkeypatch):
    if gpu_tool == "none":      # no NVRTC, no nvcc: the host compiler's error, at the same line
        monkeypatch.setattr(cuda_cpu, "gpu_compiler", lambda: None)
    source = _solution("rmsnorm").replace("ss += xr[i] * xr[i];", "ss += xr[i] * xs[i];")
    verdict, out = check_on_cpu("rmsnorm", source, capsys)
    assert verdict is False and out.startswith("[x] rmsnorm kernel: your_rmsnorm.cu failed to compile"), out
    assert f"your_rmsnorm.cu({_line_of(source, 'xs[i]')}): error" in out.splitlines()[0] and "xs" in out, out
    if gpu_tool == "none":
        assert "no NVRTC or nvcc here" in out
    source = _solution("rmsnorm").replace("const float inv_rms = rsqrtf(", "const float inv_rms = rsqrtff(")
    verdict, out = check_on_cpu("rmsnorm", source, capsys)
    assert verdict is False and f"your_rmsnorm.cu({_line_of(source, 'rsqrtff')})" in out.splitlines()[0], out


def test_a_wrong_kernel_name_is_named(capsys, monkeypatch):
    monkeypatch.setattr(cuda_cpu, "gpu_compiler", lambda: None)
    verdict, out = check_on_cpu("swiglu", _solution("swiglu").replace("void swiglu(", "void swish("), capsys)
    assert verdict is False and "has no kernel named swiglu" in out, out


def test_a_parameter_of_the_wrong_type_is_named(capsys):
    verdict, out = check_on_cpu("swiglu", _solution("swiglu").replace("long long n,", "int n,"), capsys)
    assert verdict is False and "parameter 3 of the kernel is an integer of 4 bytes" in out and "int64" in out, out


def test_an_endless_loop_is_stopped_with_a_verdict(capsys, monkeypatch):
    monkeypatch.setattr(cuda_cpu, "TIMEOUT_S", 3.0)
    source = _solution("embedding").replace("i < H; i += blockDim.x)\n        out[(long long)t * H + i] = bf2f",
                                            "i < H; i += 0)\n        out[(long long)t * H + i] = bf2f")
    assert "i += 0" in source
    verdict, out = check_on_cpu("embedding", source, capsys)
    assert verdict is False and "did not finish within 3 s" in out and "endless loop" in out, out


def test_a_write_far_past_the_end_is_a_crash_that_names_the_buffer(capsys):
    source = _solution("kv_write").replace("k_cache[dst + i] = k_src[i];", "k_cache[dst + i + (1 << 22)] = k_src[i];")
    verdict, out = check_on_cpu("kv_write", source, capsys)
    assert verdict is False and "the kernel crashed on the CPU executor: block (" in out, out
    assert "a write" in out or "an access" in out


def test_a_lane_that_returns_before_a_shuffle_is_a_deadlock_not_a_hang(capsys):
    source = _solution("rmsnorm").replace("float ss = 0.0f;", "float ss = 0.0f;\n    if (lane == 5) return;")
    verdict, out = check_on_cpu("rmsnorm", source, capsys)
    assert verdict is False and "cannot go on" in out and "lane 5" in out and "returned" in out, out


@pytest.mark.parametrize("body,expected", [
    ("volatile float big[200000]; big[threadIdx.x] = 1.0f; out[threadIdx.x] = big[threadIdx.x + 1];",
     "a stack overflow"),
    pytest.param("volatile int zero = 0; out[threadIdx.x] = (float)(7 / zero);", "an integer division by zero",
                 marks=pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"),
                                          reason="only x86 traps on an integer division by zero")),
    ("if (threadIdx.x == 3) __trap(); out[threadIdx.x] = 1.0f;", "__trap()"),
])
def test_a_fault_inside_the_kernel_is_named(body, expected):
    source = f'extern "C" __global__ void probe(float* out) {{ {body} }}'
    so = cuda_cpu.build(source, "probe.cu", "probe", {})
    case = Case("probe", (1,), 32, {}, lambda d: (d["out"],), "f32", np.ones((1, 32), np.float32))
    outcome = cuda_cpu.run_case(so, "probe", case, 3, POISON["f32"], cuda_check.BITS["f32"])
    assert outcome.crash is not None and expected in outcome.crash, outcome.crash


def test_what_the_kernel_prints_is_shown(capsys):
    first = "__device__ bool first() { return blockIdx.x == 0 && threadIdx.x == 0; }"
    source = _solution("swiglu").replace('#include "common.cuh"', f'#include "common.cuh"\n{first}')
    source = source.replace("const long long stride", 'if (first()) printf("hello from %d\\n", I);\n    const long long stride')
    verdict, out = check_on_cpu("swiglu", source, capsys)
    assert verdict is True and "your kernel printed (case T=5 I=137" in out and "> hello from 137" in out, out


def test_without_a_host_compiler_the_check_skips_and_shows_the_recorded_run(capsys, monkeypatch):
    monkeypatch.setattr(cuda_cpu, "unavailable_reason", lambda: "no host C++ compiler was found")
    verdict, out = check_on_cpu("rmsnorm", None, capsys)
    assert verdict is None and out.startswith("[skipped] rmsnorm kernel: needs a CUDA GPU")
    assert "no host C++ compiler" in out and "Recorded run of the worked solution" in out


# ----------------------------------------------------------------------------------------------
# The emulated CUDA against NumPy
# ----------------------------------------------------------------------------------------------

@dataclass
class Probe:
    """A one-off kernel run through run_case: out[rows, cols] (f32 or bf16 bits) from given inputs."""

    source: str
    kernel: str
    grid: tuple
    block: int
    inputs: dict
    args: object
    want: np.ndarray


def run_probe(p: Probe, dtype="f32", runs=3):
    so = cuda_cpu.build(p.source, "probe.cu", p.kernel, {})
    case = Case("probe", p.grid, p.block, p.inputs, p.args, dtype, p.want)
    outcome = cuda_cpu.run_case(so, p.kernel, case, runs, POISON[dtype], cuda_check.BITS[dtype])
    assert outcome.crash is None, outcome.crash
    return [r[:p.want.size].reshape(p.want.shape) for r in outcome.runs], outcome


def test_min_and_max_return_values_not_references():
    """min/max of two ints (lvalues of one type) once returned a reference to a parameter: garbage."""
    source = r'''extern "C" __global__ void minmax(const int* a, float* out) {
    const int x = a[0], y = a[1];
    out[0] = min(x, y); out[1] = max(x, y); out[2] = min(16, y); out[3] = max(2.5f, x);
}'''
    p = Probe(source, "minmax", (1,), 1, {"a": np.array([7, 3], np.int32)}, lambda d: (d["a"], d["out"]),
              np.zeros((1, 4), np.float32))
    (got, *_), _ = run_probe(p)
    assert got.reshape(-1).view(np.float32).tolist() == [3.0, 7.0, 3.0, 7.0]


def test_bf16_conversion_rounds_to_nearest_even_as_the_engine_does():
    rng = np.random.default_rng(1)
    x = np.concatenate([rng.standard_normal(4000).astype(np.float32) * 100,
                        # exact ties between two bf16 values: the even one wins
                        ((np.arange(1, 2001, dtype=np.uint32) << 16) | 0x8000).view(np.float32),
                        np.array([0.0, -0.0, np.inf, -np.inf, 3.0e38, 1e-40], np.float32)])
    source = r'''#include "common.cuh"
extern "C" __global__ void widen(const float* x, bf16* out, int n) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) out[i] = f2bf(x[i]);
}'''
    p = Probe(source, "widen", (3,), 128, {"x": x}, lambda d: (d["x"], d["out"], np.int32(x.size)),
              np.zeros((1, x.size), np.float32))
    (got, *_), _ = run_probe(p, "bf16")
    assert np.array_equal(got.reshape(-1), f32_to_bf16(x))


SHUFFLES = r'''#include "common.cuh"
extern "C" __global__ void shuffles(float* out) {
    const int lane = threadIdx.x & 31;
    const float v = (float)threadIdx.x;
    float* row = out + threadIdx.x * 6;
    row[0] = __shfl_xor_sync(0xffffffffu, v, 5);
    row[1] = __shfl_down_sync(0xffffffffu, v, 3);
    row[2] = __shfl_up_sync(0xffffffffu, v, 2);
    row[3] = __shfl_sync(0xffffffffu, v, 7);
    row[4] = warp_sum(v);
    row[5] = (float)__popc(__ballot_sync(0xffffffffu, lane % 3 == 0));
}'''


def test_warp_shuffles_exchange_within_each_warp_as_the_hardware_does():
    threads = 96
    p = Probe(SHUFFLES, "shuffles", (1,), threads, {}, lambda d: (d["out"],), np.zeros((threads, 6), np.float32))
    runs, _ = run_probe(p)
    t = np.arange(threads)
    lane, base = t % 32, t - t % 32
    want = np.stack([base + (lane ^ 5),
                     np.where(lane + 3 < 32, t + 3, t),
                     np.where(lane >= 2, t - 2, t),
                     base + 7,
                     np.array([np.sum(base[i] + np.arange(32)) for i in t]),
                     np.full(threads, 11)], axis=1).astype(np.float32)
    for r in runs:
        assert np.array_equal(r.view(np.float32), want)


BARRIER = r'''#include "common.cuh"
extern "C" __global__ void reverse(const float* x, float* out, int n) {
    __shared__ float tile[1024];
    tile[threadIdx.x] = x[blockIdx.x * n + threadIdx.x];
    SYNC
    out[blockIdx.x * n + threadIdx.x] = tile[n - 1 - threadIdx.x];
}'''


@pytest.mark.parametrize("sync", ["__syncthreads();", ""])
def test_syncthreads_is_a_real_barrier_and_its_absence_shows(sync):
    n, blocks = 256, 3
    x = np.random.default_rng(2).standard_normal((blocks, n)).astype(np.float32)
    p = Probe(BARRIER.replace("SYNC", sync), "reverse", (blocks,), n, {"x": x},
              lambda d: (d["x"], d["out"], np.int32(n)), x[:, ::-1].copy())
    runs, _ = run_probe(p)
    got = [r.view(np.float32) for r in runs]
    verdict = diagnose([r.reshape(-1) for r in runs], "f32", p.want, exact=True)
    if sync:
        assert all(np.array_equal(g, p.want) for g in got) and verdict is None
    else:     # unwritten shared memory holds the poison, and the three thread orders disagree
        assert not all(np.array_equal(g, p.want) for g in got)

