"""engine/ops/moe.py's GPU launcher (route, grouped_experts) run end to end on the CPU: CuPy's arrays are
NumPy arrays and every kernels_cu/moe.cu launch runs on the host emulator of tests/helpers (the host
compiler; a block's threads as std::threads). It checks what the kernel tests alone cannot: the
launcher's argument order, dtypes, grids and buffer sizes, and the five launches composed."""
import sys
import types

import numpy as np
import pytest
from helpers.ladder_host_emulator import CXX, KERNELS, HostKernels

from engine.backend import bf16_to_f32, f32_to_bf16
from engine.ops import moe as moe_ops
from engine.ops.swiglu import swiglu_ref

pytestmark = pytest.mark.skipif(CXX is None, reason="no host C++ compiler (g++ or clang++)")


@pytest.fixture
def emulated_gpu(monkeypatch):
    """cupy -> NumPy, load_kernel -> the host emulator, swiglu -> its reference rounded to bf16 (the
    swiglu kernel has tests of its own); records every launch."""
    launches = []
    fake = types.ModuleType("cupy")
    fake.empty, fake.float32, fake.int32, fake.uint16 = np.empty, np.float32, np.int32, np.uint16
    monkeypatch.setitem(sys.modules, "cupy", fake)

    def load_kernel(stage, name, **defines):
        assert stage == "moe"
        kernels = HostKernels(KERNELS / "moe.cu", defines)

        def launch(grid, block, args):
            launches.append((name, grid, block))
            kernels.launch(name, grid, block, list(args))
        return launch
    monkeypatch.setattr(moe_ops, "load_kernel", load_kernel)
    monkeypatch.setattr(moe_ops, "swiglu", lambda gate_up: f32_to_bf16(swiglu_ref(gate_up)))
    monkeypatch.setattr(moe_ops, "is_device_array", lambda a: isinstance(a, np.ndarray))
    return launches


@pytest.mark.parametrize("T,E,k,norm", [(4, 7, 3, True), (3, 128, 8, False)])
def test_route_launcher(emulated_gpu, T, E, k, norm):
    logits = np.random.default_rng(T).standard_normal((T, E)).astype(np.float32)
    w, e = moe_ops.route(logits, k, norm)
    want_w, want_e = moe_ops.router_ref(logits, k, norm)
    np.testing.assert_array_equal(e, want_e)
    np.testing.assert_allclose(w, want_w, rtol=2e-6)
    assert emulated_gpu == [("moe_route", (T,), (32,))]


@pytest.mark.parametrize("T,E,k,H,I", [(1, 16, 4, 40, 24), (37, 7, 3, 48, 20), (6, 4, 4, 33, 70)])
def test_grouped_experts_launcher(emulated_gpu, T, E, k, H, I):
    rng = np.random.default_rng(T + E)
    h = f32_to_bf16(rng.standard_normal((T, H)).astype(np.float32))
    gate_up = f32_to_bf16((rng.standard_normal((E, 2 * I, H)) / np.sqrt(H)).astype(np.float32))
    down = f32_to_bf16((rng.standard_normal((E, H, I)) / np.sqrt(I)).astype(np.float32))
    weights, experts = moe_ops.router_ref(rng.standard_normal((T, E)).astype(np.float32), k, True)
    unused = sorted(set(range(E)) - set(experts.ravel().tolist()))
    gate_up[unused], down[unused] = 0xFFFF, 0xFFFF                    # NaN: never to be read
    got = moe_ops.grouped_experts(h, weights, experts, gate_up, down)
    x, wg, wd = bf16_to_f32(h), bf16_to_f32(gate_up), bf16_to_f32(down)
    want = np.stack([sum(weights[t, j] * wd[e] @ swiglu_ref(wg[e] @ x[t]) for j, e in enumerate(experts[t]))
                     for t in range(T)])                                 # (experts_ref's swiglu is patched here)
    assert got.shape == (T, H) and got.dtype == np.float32 and np.isfinite(got).all()
    assert float(np.linalg.norm(got - want) / np.linalg.norm(want)) < 1e-2     # bf16 between the GEMMs
    assert [name for name, _, _ in emulated_gpu] == ["moe_group", "moe_expert_gemm", "moe_expert_gemm", "moe_combine"]
