"""The kernel ladders (engine/bench/ladder.py, kernels_cu/ladders/): on any machine.

- every rung of every ladder compiles (NVRTC or nvcc, no GPU needed), for sm_90 and the oldest GPU it
  is meant for;
- the ladder files' rungs run on the CPU (tests/helpers/ladder_host_emulator.py: the host compiler,
  a thread per CUDA thread, real barriers and shuffles) and match the NumPy references at several
  block sizes, the engine's kernels they build on too;
- the registry is numbered 1..N, each rung names a kernel its source defines and its header describes;
- the command's CPU path: a recorded run is shown labelled as recorded (a fixture written here, not a
  figure of the product), a missing one is said to be missing, a malformed one is refused by name.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest

from engine.backend import bf16_to_f32, f32_to_bf16
from engine.bench import ladder as lad

sys.path.insert(0, str(Path(__file__).parent))
from helpers.ladder_host_emulator import CXX, HostKernels  # noqa: E402

KERNELS = lad.KERNELS_DIR
BUILDS = lad.all_builds()
TOOL = lad.compiler()


# -- every rung compiles ---------------------------------------------------------------------------

def _archs(build):
    return (90, 80) if build.min_arch >= 80 else (90, 75)


COMPILES = [(b, a) for b in BUILDS for a in _archs(b)]


@pytest.mark.slow
@pytest.mark.skipif(TOOL is None, reason="neither NVRTC (+ CUDA headers) nor nvcc is available")
@pytest.mark.parametrize("build,arch", COMPILES, ids=[f"{b.label()}-sm{a}" for b, a in COMPILES])
def test_rung_compiles(build, arch):
    log = lad.compile_build(build, arch, TOOL)
    assert log == "", log


def test_every_ladder_source_is_built():
    """Each kernels_cu/ladders/*.cu is some rung's source (no orphan file), and vice versa."""
    files = {p.relative_to(KERNELS).as_posix() for p in (KERNELS / "ladders").glob("*.cu")}
    built = {b.source for b in BUILDS}
    assert files <= built, f"ladder files no rung builds: {sorted(files - built)}"
    assert {lad.LADDERS[n].source.removeprefix("kernels_cu/") for n in lad.LADDERS} == files


def test_compile_check_reports_the_file_and_line(tmp_path, monkeypatch, capsys):
    """A broken rung makes the compile check fail with the compiler's message naming the source."""
    if TOOL is None:
        pytest.skip("no CUDA compiler here")
    broken = tmp_path / "ladders"
    broken.mkdir()
    (tmp_path / "common.cuh").write_text((KERNELS / "common.cuh").read_text())
    (broken / "rmsnorm.cu").write_text((KERNELS / "ladders" / "rmsnorm.cu").read_text()
                                       .replace("ss += xr[i] * xr[i];", "ss += xr[i] * undefined_name;", 1))
    (tmp_path / "rmsnorm.cu").write_text((KERNELS / "rmsnorm.cu").read_text())
    monkeypatch.setattr(lad, "KERNELS_DIR", tmp_path)
    assert lad.compile_check(["rmsnorm"]) == 1
    out = capsys.readouterr().out
    assert "FAILED" in out and "ladders/rmsnorm.cu" in out and "undefined_name" in out


# -- the registry ------------------------------------------------------------------------------------

def _kernel_names(source: Path) -> set[str]:
    return set(re.findall(r'extern "C" __global__ void\s+(?:__launch_bounds__\([^)]*\)\s*)?(\w+)\s*\(',
                          source.read_text()))


@pytest.mark.parametrize("name", list(lad.LADDERS))
def test_ladder_is_numbered_and_documented(name):
    ladder = lad.LADDERS[name]
    versions = [r.version for r in ladder.rungs if isinstance(r.version, int)]
    assert versions == list(range(1, len(versions) + 1)) and 3 <= len(versions) <= 6, versions
    header = (lad.REPO / ladder.source).read_text().split("#include")[0]
    for r in ladder.rungs:
        assert r.what and r.sizes and r.unit, r
        if r.origin.endswith(".cu"):
            assert r.kernel in _kernel_names(lad.REPO / r.origin), f"{r.origin} defines no kernel {r.kernel}"
        if isinstance(r.version, int):    # the file's header lists every rung, by number and kernel
            assert re.search(rf"^//\s+v{r.version}\s+.*{re.escape(r.kernel)}", header, re.M), \
                f"{ladder.source}'s header does not describe v{r.version} {r.kernel}"
        for case in ladder.cases:
            for size in r.sizes:
                for b in r.builds(case.params, size):
                    assert (KERNELS / b.source).is_file(), b
    for kernel in _kernel_names(lad.REPO / ladder.source):
        assert any(r.kernel == kernel and r.origin == ladder.source for r in ladder.rungs), \
            f"{ladder.source} defines {kernel}, which no rung runs"
    assert any(c.timed for c in ladder.cases) and any(not c.timed for c in ladder.cases)


# -- the rungs run on the CPU and match the references ------------------------------------------------

needs_cxx = pytest.mark.skipif(CXX is None, reason="no host C++ compiler")
RNG = np.random.default_rng(7)


def _bf16(*shape, scale=1.0):
    bits = f32_to_bf16(RNG.standard_normal(shape, dtype=np.float32) * np.float32(scale))
    return bits, bf16_to_f32(bits)


def _poisoned(shape, dtype):
    """An output buffer of 0xFF bytes (NaN in fp32 and bf16): an element a kernel skips fails the check."""
    return np.full(int(np.prod(shape)) * np.dtype(dtype).itemsize, 0xFF, np.uint8).view(dtype).reshape(shape)


def _err(out, ref):
    return lad.rel_err(out, ref)


def _rmsnorm_runs(engine, ladder, T, H):
    """(kernel, its file, block -> (grid, arguments before eps; None where the output goes))."""
    i32 = np.int32
    return [("rmsnorm_naive", engine, lambda b: ((-(-T // b),), [None, i32(T), i32(H)])),
            ("rmsnorm", engine, lambda b: ((T,), [None, i32(H)])),
            ("rmsnorm_v2_smem_tree", ladder, lambda b: ((T,), [None, i32(H)])),
            ("rmsnorm_v4_float4", ladder, lambda b: ((T,), [None, i32(H)])),
            ("rmsnorm_v5_warp_row", ladder, lambda b: ((-(-T // (b // 32)),), [None, i32(T), i32(H)]))]


@pytest.mark.slow
@needs_cxx
def test_rmsnorm_rungs_on_the_cpu():
    from engine.ops.rmsnorm import rmsnorm_ref
    ladder = HostKernels(KERNELS / "ladders" / "rmsnorm.cu")
    engine = HostKernels(KERNELS / "rmsnorm.cu")
    for T, H in [(5, 576), (3, 4100), (4, 68)]:
        x = (RNG.standard_normal((T, H), dtype=np.float32) * 3).astype(np.float32)
        w = RNG.standard_normal(H, dtype=np.float32)
        ref = rmsnorm_ref(x, w, lad.EPS)
        for name, kern, make in _rmsnorm_runs(engine, ladder, T, H):
            for block in (32, 64):
                out = _poisoned((T, H), np.uint16)
                grid, args = make(block)
                kern.launch(name, grid, (block,), [x, w, out] + args[1:] + [np.float32(lad.EPS)])
                assert _err(bf16_to_f32(out), ref) < 5e-3, (name, T, H, block)


@pytest.mark.slow
@needs_cxx
def test_softmax_rungs_on_the_cpu():
    ladder = HostKernels(KERNELS / "ladders" / "softmax.cu")
    engine = HostKernels(KERNELS / "attention.cu")
    scale = np.float32(lad.SOFTMAX_SCALE)
    for H, T in [(2, 37), (2, 36)]:
        s = (RNG.standard_normal((H, T, T), dtype=np.float32) * 4).astype(np.float32)
        x = np.where(np.tril(np.ones((T, T), bool)), s * scale, -np.inf)
        e = np.exp(x - x.max(-1, keepdims=True))
        ref = e / e.sum(-1, keepdims=True)
        names = ["causal_softmax_naive", "causal_softmax", "causal_softmax_v2_smem_tree", "causal_softmax_v4_online"]
        names += ["causal_softmax_v5_float4"] if T % 4 == 0 else []
        for name in names:
            for block in (32, 64):
                out = _poisoned((H, T, T), np.uint16)
                kern = engine if name in ("causal_softmax_naive", "causal_softmax") else ladder
                if name == "causal_softmax_naive":
                    kern.launch(name, (-(-H * T // block),), (block,), [s, out, np.int32(H * T), np.int32(T), scale])
                else:
                    kern.launch(name, (H * T,), (block,), [s, out, np.int32(T), scale])
                assert _err(bf16_to_f32(out), ref) < 5e-3, (name, H, T, block)


def _paged_case(Hq, Hkv, D, ctxs, BS):
    S = len(ctxs)
    mb = max(-(-c // BS) for c in ctxs)
    NB = S * mb + 2
    perm = RNG.permutation(NB).astype(np.int32)
    tables = np.full((S, mb), -1, np.int32)
    for s, c in enumerate(ctxs):
        tables[s, :-(-c // BS)] = perm[s * mb:s * mb + -(-c // BS)]
    kc, kc_h = _bf16(NB, BS, Hkv, D)
    vc, vc_h = _bf16(NB, BS, Hkv, D)
    qkv, qkv_h = _bf16(S, (Hq + 2 * Hkv) * D)
    return tables, kc, kc_h, vc, vc_h, qkv, qkv_h, np.array(ctxs, np.int32) - 1


@pytest.mark.slow
@needs_cxx
def test_paged_attention_rungs_on_the_cpu():
    from engine.ops.paged_attention import paged_attention_ref
    Hq, Hkv, D, ctxs, BS = 8, 2, 64, [1, 17, 40, 9], 7
    defines = {"HEAD_DIM": D, "GROUP": Hq // Hkv}
    ladder = HostKernels(KERNELS / "ladders" / "paged_attention.cu", defines)
    tables, kc, kc_h, vc, vc_h, qkv, qkv_h, pos = _paged_case(Hq, Hkv, D, ctxs, BS)
    S = len(ctxs)
    seq = np.arange(S, dtype=np.int32)
    ref = paged_attention_ref(qkv_h[:, :Hq * D].reshape(S, Hq, D), kc_h, vc_h, tables, seq, pos, D ** -0.5)
    unused = np.zeros(1, np.float32)
    runs = [("paged_attention_v2_vec", ladder, (1, 2, 4)), ("paged_attention_v3_gqa", ladder, (1, 2, 4, 8))]
    for warps in (1, 4):   # the first rung, chapter 11's solution, at two of its compile-time warp counts
        runs.append(("paged_attention", HostKernels(KERNELS / "exercises" / "solutions" / "paged_attention.cu",
                                                     {**defines, "NWARPS": warps}), (warps,)))
    for name, kern, sizes in runs:
        for warps in sizes:
            out = _poisoned((S, Hq * D), np.uint16)
            kern.launch(name, (S, Hkv, 1), (32 * warps,),
                        [qkv, np.int64(qkv.shape[1]), kc, vc, tables, np.int32(tables.shape[1]), seq, pos, np.int32(BS),
                         np.int32(Hkv), np.float32(D ** -0.5 * np.log2(np.e)), out, np.int64(Hq * D), unused, unused])
            assert _err(bf16_to_f32(out), ref.reshape(S, -1)) < 1e-2, (name, warps)


def _gemv_grids(N):
    """Blocks of each GEMV rung for N outputs, as a function of the block size (engine/bench/ladder.py's)."""
    return {"gemv_v1_thread": lambda b: -(-N // b), "gemv_v2_warp": lambda b: -(-N // (b // 32)),
            "gemv_v3_vec16": lambda b: -(-N // (b // 32)), "gemv_v4_rows": lambda b: -(-N // (4 * (b // 32))),
            "gemv_v5_splitk": lambda b: -(-N // 4)}


@pytest.mark.slow
@needs_cxx
def test_gemv_rungs_on_the_cpu():
    ladder = HostKernels(KERNELS / "ladders" / "gemv.cu")
    for T, N, K in [(3, 37, 584), (1, 9, 1032), (8, 5, 264), (2, 13, 50)]:
        w, w_h = _bf16(N, K, scale=K ** -0.5)
        x, x_h = _bf16(T, K)
        ref = x_h.astype(np.float64) @ w_h.astype(np.float64).T
        args = [x, w, None, np.int32(T), np.int32(N), np.int32(K)]
        for name, grid in _gemv_grids(N).items():
            if K % 8 and name not in ("gemv_v1_thread", "gemv_v2_warp"):
                continue
            for block in (32, 64, 128):
                out = _poisoned((T, N), np.float32)
                args[2] = out
                ladder.launch(name, (grid(block),), (block,), args)
                assert _err(out, ref) < 1e-5, (name, T, N, K, block)


@pytest.mark.slow
@needs_cxx
def test_flash_attention_rungs_on_the_cpu():
    from engine.ops.flash_attention import flash_attention_ref
    Hq, Hkv, D, T = 4, 2, 64, 45
    ladder = HostKernels(KERNELS / "ladders" / "flash_attention.cu", {"HEAD_DIM": D})
    qkv, qkv_h = _bf16(T, (Hq + 2 * Hkv) * D)
    q = qkv_h[:, :Hq * D].reshape(T, Hq, D)
    k = qkv_h[:, Hq * D:(Hq + Hkv) * D].reshape(T, Hkv, D)
    v = qkv_h[:, (Hq + Hkv) * D:].reshape(T, Hkv, D)
    ref = flash_attention_ref(q, k, v, np.array([0, T]), np.arange(T), D ** -0.5).reshape(T, -1)
    for name in ("flash_v2_thread_row", "flash_v3_smem_tiles"):
        for block in (32, 64):
            out = _poisoned((T, Hq * D), np.uint16)
            ladder.launch(name, (-(-T // block), Hq), (block,),
                          [qkv, np.int64(qkv.shape[1]), np.int32(T), np.int32(Hq), np.int32(Hkv),
                           np.float32(D ** -0.5 * np.log2(np.e)), out])
            assert _err(bf16_to_f32(out), ref) < 1e-2, (name, block)


@needs_cxx
def test_emulator_catches_a_wrong_kernel(tmp_path):
    """The CPU check can fail: a reduction that skips its last step gives a wrong norm."""
    from engine.ops.rmsnorm import rmsnorm_ref
    src = (KERNELS / "ladders" / "rmsnorm.cu").read_text().replace("for (int s = blockDim.x / 2; s > 0; s >>= 1)",
                                                                   "for (int s = blockDim.x / 2; s > 1; s >>= 1)")
    (tmp_path / "rmsnorm.cu").write_text(src)
    kern = HostKernels(tmp_path / "rmsnorm.cu")
    T, H = 2, 100
    x = RNG.standard_normal((T, H), dtype=np.float32)
    w = np.ones(H, np.float32)
    out = _poisoned((T, H), np.uint16)
    kern.launch("rmsnorm_v2_smem_tree", (T,), (32,), [x, w, out, np.int32(H), np.float32(lad.EPS)])
    assert _err(bf16_to_f32(out), rmsnorm_ref(x, w, lad.EPS)) > 1e-2


# -- the command without a GPU: the recorded run -----------------------------------------------------

def _fixture_run() -> dict:
    """A small run in the recorded format (made-up test values: they exist only in this test)."""
    rungs = [{"version": v, "kernel": f"k{v}", "origin": "kernels_cu/ladders/rmsnorm.cu", "what": f"step {v}",
              "unit": "threads", "sizes": [32, 64], "engine_default": {}} for v in (1, 2)]
    rows = [{"case": "T=8 H=64", "timed": True, "version": v, "kernel": f"k{v}", "size": b, "block": f"{b} threads",
             "default": b == 64, "tol": 5e-3, "rel_err": 1e-3, "ok": True, "us": us, "gbps": g, "pct": p}
            for v, b, us, g, p in [(1, 32, 40.0, 1.0, 0.1), (1, 64, 30.0, 1.5, 0.2), (2, 32, 3.0, 15.0, 1.9),
                                   (2, 64, 6.0, 7.5, 0.9)]]
    rows.append({"case": "T=1 H=3", "timed": False, "version": 2, "kernel": "k2", "size": 32, "block": "32 threads",
                 "default": True, "tol": 5e-3, "skipped": "needs H % 4 == 0 (float4 rows)"})
    lad._add_speedups(rows)
    return {"schema": lad.SCHEMA, "device": "Test GPU 9000", "date": "2001-02-03", "copy_gbps": 800.0,
            "gemm_tflops": None, "command": "python -m engine.kernel_bench --ladder rmsnorm",
            "ladders": [{"name": "rmsnorm", "title": "RMSNorm", "chapter": "04", "metric": "GB/s",
                         "source": "kernels_cu/ladders/rmsnorm.cu", "work": "bytes", "rungs": rungs, "rows": rows}]}


@pytest.mark.nogpu
def test_cpu_shows_the_recorded_run_labelled(tmp_path, capsys):
    path = tmp_path / "ladder.json"
    path.write_text(json.dumps(_fixture_run()))
    from engine.bench.kernels import main
    assert main(["--ladder", "rmsnorm", "--recorded", str(path), "--no-compile"]) == 0
    out = capsys.readouterr().out
    assert "RECORDED run, not measured on this machine: Test GPU 9000, 2001-02-03" in out
    table = out[out.index("-- T=8 H=64"):]
    head = table.splitlines()[1].split()
    assert head[:7] == ["v", "kernel", "block", "us", "GB/s", "%copy", "vs"]
    best = [ln for ln in table.splitlines() if ln.lstrip().startswith("*v")]
    assert len(best) == 2 and "30.00" in best[0] and "10.0x" in best[1]      # v1's best 30 us, v2's 3 us: 10x
    assert "check T=1 H=3: 0/0 ok (n/a: v2)" in out


@pytest.mark.nogpu
def test_cpu_says_plainly_when_nothing_is_recorded(tmp_path, capsys):
    from engine.bench.kernels import main
    assert main(["--ladder", "all", "--recorded", str(tmp_path / "none.json"), "--no-compile"]) == 0
    out = capsys.readouterr().out
    assert "No recorded run of the kernel ladders" in out and "ladder_h200.sh" in out
    assert "GB/s" not in out and "us" not in out.split()


@pytest.mark.nogpu
def test_cpu_refuses_a_malformed_recording(tmp_path, capsys):
    run = _fixture_run()
    del run["ladders"][0]["rows"][0]["block"]
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(run))
    assert lad.show_recorded(["rmsnorm"], path) == 1
    assert "lacks ['block']" in capsys.readouterr().err
    path.write_text(json.dumps({"schema": "something else"}))
    assert lad.show_recorded(["rmsnorm"], path) == 1


def test_recorded_run_in_the_repository_follows_the_schema():
    """Once the H200 run is recorded, it must hold every ladder with every rung (none missing)."""
    if not lad.RECORDED.is_file():
        pytest.skip(f"no recorded run yet ({lad.RECORDED.name})")
    run = lad.validate_run(json.loads(lad.RECORDED.read_text()))
    assert run["device"] and re.fullmatch(r"\d{4}-\d\d-\d\d", run["date"])
    recorded = {lad_["name"]: lad_ for lad_ in run["ladders"]}
    assert set(recorded) == set(lad.LADDERS)
    for name, ladder in lad.LADDERS.items():
        versions = {str(r["version"]) for r in recorded[name]["rows"]}
        assert versions == {str(r.version) for r in ladder.rungs}, name


def test_speedups_are_relative_to_v1s_best_block():
    rows = [{"version": 1, "us": 10.0}, {"version": 1, "us": 20.0}, {"version": 2, "us": 2.5},
            {"version": "ref", "us": 5.0}, {"version": 2, "skipped": "x"}]
    lad._add_speedups(rows)
    assert [r.get("speedup") for r in rows] == [1.0, 0.5, 4.0, 2.0, None]
    assert [bool(r.get("best")) for r in rows] == [True, False, True, True, False]


def test_work_figures():
    """GB/s and TFLOP/s count what each kernel must move or compute once."""
    assert lad.RMSNORM.work({"T": 2, "H": 4}) == 2 * 4 * 6 + 16
    assert lad.GEMV.work({"T": 1, "N": 3, "K": 8}) == 2 * 24 + 16 + 12
    assert lad.FLASH.work({"Hq": 1, "D": 2, "T": 3}) == 4 * 2 * 6
    assert lad.PAGED.work({"ctxs": [3, 5], "Hkv": 2, "D": 4}) == 8 * 2 * 4 * 4
    assert lad.SOFTMAX.work({"H": 1, "T": 2}) == 4 * 3 + 2 * 4


# -- the GPU driver itself (inputs, launch geometry, argument order, checks), on the CPU emulator ----

class _HostArray(np.ndarray):
    """A NumPy array with CuPy's .get(): stands in for device arrays when the driver runs on the emulator."""

    def get(self):
        return np.asarray(self).copy()


def _host(a):
    return np.asarray(a).view(_HostArray)


class _FakeCupy:
    """The part of CuPy that engine/bench/ladder.py uses to make inputs and read results, over NumPy."""
    float32, uint32, uint16, uint8, int32 = np.float32, np.uint32, np.uint16, np.uint8, np.int32

    class random:
        class RandomState:
            def __init__(self, seed):
                self.rng = np.random.default_rng(seed)

            def standard_normal(self, shape, dtype):
                return _host(self.rng.standard_normal(shape, dtype=dtype))

    class cuda:
        class Device:
            id = 0

            def synchronize(self):
                pass

        @staticmethod
        def get_current_stream():
            return _FakeCupy.cuda.Device()

    @staticmethod
    def empty(shape, dtype):
        return _host(np.empty(shape, dtype))

    @staticmethod
    def asarray(a):
        return _host(np.ascontiguousarray(a))

    @staticmethod
    def arange(n, dtype):
        return _host(np.arange(n, dtype=dtype))

    @staticmethod
    def get_default_memory_pool():
        class Pool:
            def free_all_blocks(self):
                pass
        return Pool()


class _EmulatedCtx(lad.Ctx):
    def kernel(self, build, name):
        key = (build, name)
        if key not in self._kernels:
            host = HostKernels(KERNELS / build.source, dict(build.defines))
            self._kernels[key] = lambda grid, block, args, shared_mem=0: host.launch(name, grid, block, list(args))
        return self._kernels[key]


SMALL_CASES = {"rmsnorm": {"T": 3, "H": 100}, "softmax": {"H": 2, "T": 12},
               "paged_attention": {"Hq": 8, "Hkv": 2, "D": 64, "ctxs": [1, 20, 9], "BS": 7},
               "gemv": {"T": 2, "N": 40, "K": 264}, "flash_attention": {"Hq": 4, "Hkv": 2, "D": 64, "T": 20}}


@pytest.mark.slow
@needs_cxx
@pytest.mark.parametrize("name", list(lad.LADDERS))
def test_ladder_driver_checks_every_rung_on_the_emulator(name, monkeypatch):
    """run_ladder with the emulator in place of the GPU: every rung the emulator can run (no tensor
    cores, no cuBLAS) passes its check, with the driver's own inputs, grids and argument order; the
    rows make a run that validates and prints."""
    import engine.backend
    monkeypatch.setattr(engine.backend, "tensor_cores_usable", lambda device: False)
    ladder = lad.LADDERS[name]
    cuBLAS = {("flash_attention", 1), ("gemv", "ref")}      # host-side library calls: GPU only
    small = lad.Ladder(**{**ladder.__dict__, "cases": [lad.Case("small", SMALL_CASES[name], False)],
                          "rungs": [r for r in ladder.rungs if (name, r.version) not in cuBLAS]})
    ctx = _EmulatedCtx(_FakeCupy, copy_gbps=1.0)
    rows = lad.run_ladder(ctx, small, sweep=False, timed=False, log=None)
    ran = [r for r in rows if "skipped" not in r]
    assert ran and all(r["ok"] for r in ran), [(r["version"], r.get("error"), r.get("rel_err")) for r in ran]
    assert {r["version"] for r in rows} == {r.version for r in small.rungs}
    skipped = [r for r in rows if "skipped" in r]
    assert all(r["skipped"] == "needs sm_80+ (mma.sync)" for r in skipped)
    run = {"schema": lad.SCHEMA, "device": "emulator", "date": "2001-02-03", "copy_gbps": 1.0,
           "ladders": [lad.describe(small) | {"rows": rows}]}
    text = lad.format_ladder(lad.validate_run(json.loads(json.dumps(run)))["ladders"][0], run)
    assert f"check small: {len(ran)}/{len(ran)} ok" in text


def test_merged_runs_keep_each_ladder_and_refuse_mixed_gpus(tmp_path, capsys):
    a, b = _fixture_run(), _fixture_run()
    b["ladders"][0]["name"] = "gemv"
    b["gemm_tflops"] = 700.0
    paths = [tmp_path / "a.json", tmp_path / "b.json"]
    for p, run in zip(paths, (a, b)):
        p.write_text(json.dumps(run))
    out = tmp_path / "merged.json"
    assert lad.main(["--json", str(out), "--merge", *map(str, paths), str(tmp_path / "missing.json")]) == 0
    merged = lad.validate_run(json.loads(out.read_text()))
    assert [x["name"] for x in merged["ladders"]] == ["rmsnorm", "gemv"] and merged["gemm_tflops"] == 700.0
    b["device"] = "Other GPU"
    with pytest.raises(lad.RecordedRunError, match="different GPUs"):
        lad.merge_runs([a, b])


def test_the_h200_script_runs_every_ladder():
    script = (lad.REPO / "notes" / "measurements" / "ladder_h200.sh").read_text()
    loop = re.search(r"for entry in ([^;]+);", script).group(1).split()
    names = [e.split(":")[0] for e in loop]
    assert names == list(lad.LADDERS) or sorted(names) == sorted(lad.LADDERS)
    assert sum(int(e.split(":")[1]) for e in loop) <= 240          # the GPU time it may take, at most
    for name in names:
        assert f"ladder_{name}.json" in script


class _ClockCupy:
    """Streams, events and graphs over a simulated GPU clock: a launch of `fn` advances it by fn.ms
    (at launch time, or when a captured graph replays)."""

    def __init__(self, capture_fails=False):
        self.now, self.capturing, self.capture_fails = 0.0, None, capture_fails
        clock = self

        class Event:
            def record(self, stream=None):
                self.t = clock.now

            def synchronize(self):
                pass

        class Graph:
            def __init__(self, work):
                self.work = work

            def launch(self, stream):
                clock.now += sum(self.work)

        class Stream:
            def __init__(self, non_blocking=False):
                pass

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False

            def begin_capture(self):
                if clock.capture_fails:
                    raise RuntimeError("operation not permitted when stream is capturing")
                clock.capturing = []

            def end_capture(self):
                graph, clock.capturing = Graph(clock.capturing), None
                return graph

            def synchronize(self):
                pass

        class cuda:
            pass
        cuda.Stream, cuda.Event = Stream, Event
        cuda.get_elapsed_time = staticmethod(lambda a, b: b.t - a.t)
        self.cuda = cuda

    def launcher(self, ms):
        def fn():
            if self.capturing is not None:
                self.capturing.append(ms)
            else:
                self.now += ms
        return fn


@pytest.mark.parametrize("ms", [0.004, 0.05, 1.5])       # graph-timed, graph-timed, launched between events
@pytest.mark.parametrize("capture_fails", [False, True])
def test_timer_reports_the_time_of_one_call(ms, capture_fails):
    cp = _ClockCupy(capture_fails)
    fns = [cp.launcher(ms) for _ in range(3)]                  # one launch per input copy
    assert lad.time_us(cp, fns) == pytest.approx(1000 * ms)
