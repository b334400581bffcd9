"""GPU checks of the decode GEMV (kernels_cu/gemv.cu through engine/ops/gemv.py); skipped without a
CUDA GPU, or below sm_80 (the kernel needs bf16 mma.sync; linear() keeps cuBLAS there).

`python -m engine.kernel_bench --only gemv` checks and times it against cuBLAS on the model shapes;
here: awkward shapes (K % 8 != 0, K not a multiple of 32, N not a multiple of the 16-column tile),
every row count 1..GEMV_MAX_ROWS, strided and unaligned views, rows that do not leak into each other,
CUDA graph capture, linear()'s switch, and the whole model with the GEMV on and off.
For the memory checker: compute-sanitizer --tool memcheck python -m pytest -m gpu tests/test_gpu_gemv.py
"""
import numpy as np
import pytest

# skipped without a usable GPU, or below sm_80 (tests/conftest.py)
pytestmark = pytest.mark.gpu(tensor_cores=True)

def tol(K):
    """bf16 operands (exact in fp32), fp32 accumulation, against float64: kernel_bench's bound."""
    from engine.bench.kernels import _fp32_acc_tol
    return _fp32_acc_tol(K)


def bf16(rng, *shape, scale=1.0):
    """(device bf16 bits, host float32 of exactly those values)."""
    import cupy as cp

    from engine.backend import bf16_to_f32, f32_to_bf16
    bits = f32_to_bf16(rng.standard_normal(shape).astype(np.float32) * np.float32(scale))
    return cp.asarray(bits), bf16_to_f32(bits)


def rel(got, ref):
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    assert np.isfinite(got).all(), "non-finite output (an element never written?)"
    return float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30))


def ref64(x, w):
    return x.astype(np.float64) @ w.astype(np.float64).T


# (N, K): K % 8 != 0 (element loads), K < 32, K % 32 != 0 with K % 8 == 0 (a partial last k-block),
# N below, at and past the 16-column tile, the model shapes (warps splitting K, one warp per block)
SHAPES = [(1, 8), (5, 3), (17, 50), (16, 72), (33, 136), (40, 130), (397, 72), (241, 50), (1001, 577),
          (960, 576), (576, 1536), (3072, 2048), (2048, 8192), (49152, 576)]


@pytest.mark.parametrize("N,K", SHAPES)
def test_gemv_matches_the_reference_for_every_row_count(N, K):
    import cupy as cp

    from engine.ops.gemv import GEMV_MAX_ROWS, gemv
    rng = np.random.default_rng(N * 7 + K)
    x, x_h = bf16(rng, GEMV_MAX_ROWS, K)
    w, w_h = bf16(rng, N, K, scale=K ** -0.5)
    ref = ref64(x_h, w_h)
    for T in range(1, GEMV_MAX_ROWS + 1):
        out = cp.full((T, N), np.nan, dtype=cp.float32)              # poisoned: unwritten stays NaN
        assert gemv(x[:T], w, out) is out
        assert rel(out.get(), ref[:T]) <= tol(K), f"T={T}"
        fresh = gemv(x[:T], w)
        assert fresh.shape == (T, N) and fresh.dtype == cp.float32
        np.testing.assert_array_equal(fresh.get(), out.get())


@pytest.mark.parametrize("K", [64, 72, 50])
def test_strided_and_unaligned_views(K):
    """Row strides (K % 8 == 0: the 16-byte kernel with ld != K), a 2-byte offset (element loads),
    rows of W taken from the middle of a bigger matrix, and an output view whose other columns
    stay untouched."""
    import cupy as cp

    from engine.ops.gemv import gemv
    rng = np.random.default_rng(K)
    T, N = 5, 37
    xb, xb_h = bf16(rng, T, K + 8)
    wb, wb_h = bf16(rng, N + 6, K + 8, scale=K ** -0.5)
    views = {
        "x unaligned": (xb[:, 1:K + 1], xb_h[:, 1:K + 1], wb[:N, :K], wb_h[:N, :K]),
        "w row stride": (xb[:, :K], xb_h[:, :K], wb[:N, :K], wb_h[:N, :K]),
        "w rows offset": (xb[:, :K], xb_h[:, :K], wb[3:3 + N, :K], wb_h[3:3 + N, :K]),
        "w unaligned": (xb[:, :K], xb_h[:, :K], wb[:N, 1:K + 1], wb_h[:N, 1:K + 1]),
    }
    for name, (x, x_h, w, w_h) in views.items():
        big = cp.full((T, N + 4), np.nan, dtype=cp.float32)
        gemv(x, w, big[:, 2:N + 2])
        got = big.get()
        assert np.isnan(got[:, :2]).all() and np.isnan(got[:, N + 2:]).all(), f"{name}: wrote outside out"
        assert rel(got[:, 2:N + 2], ref64(x_h, w_h)) <= tol(K), name


def test_a_row_does_not_depend_on_the_others():
    """Each output row's sum order depends on N and K only: the same bits whatever the batch holds,
    and a NaN in one row of x stays in that row of the output."""
    from engine.ops.gemv import GEMV_MAX_ROWS, gemv
    rng = np.random.default_rng(5)
    for N, K in [(2048, 2048), (241, 50), (160, 72)]:
        x, _ = bf16(rng, GEMV_MAX_ROWS, K)
        w, _ = bf16(rng, N, K, scale=K ** -0.5)
        full = gemv(x, w).get()
        for T in range(1, GEMV_MAX_ROWS):
            np.testing.assert_array_equal(gemv(x[:T], w).get(), full[:T], err_msg=f"N={N} K={K} T={T}")
        poisoned = x.copy()
        poisoned[3, K // 2] = 0x7FC0                                   # a bf16 NaN in row 3
        got = gemv(poisoned, w).get()
        assert np.isnan(got[3]).all()
        np.testing.assert_array_equal(np.delete(got, 3, axis=0), np.delete(full, 3, axis=0))


def test_bad_operands_are_refused():
    import cupy as cp

    from engine.ops.gemv import GEMV_MAX_ROWS, GemvInputError, gemv
    x = cp.zeros((2, 64), dtype=cp.uint16)
    w = cp.zeros((16, 64), dtype=cp.uint16)
    for args, match in [((cp.zeros((0, 64), cp.uint16), w), "rows"),
                        ((cp.zeros((GEMV_MAX_ROWS + 1, 64), cp.uint16), w), "rows"),
                        ((x.astype(cp.float32), w), "uint16"),
                        ((x, cp.zeros((16, 63), cp.uint16)), "chain"),
                        ((x, w, cp.zeros((2, 15), cp.float32)), "out"),
                        ((cp.zeros((2, 32), cp.uint16), w[:, ::2]), "contiguous rows")]:
        with pytest.raises(GemvInputError, match=match):
            gemv(*args)


def test_linear_switch_routes_decode_rows_to_the_gemv(monkeypatch):
    import cupy as cp

    import engine.ops.gemv as gemv_mod
    import engine.ops.linear as linear_mod
    rng = np.random.default_rng(9)
    w, w_h = bf16(rng, 300, 136, scale=136 ** -0.5)
    calls = []
    real = gemv_mod.gemv
    monkeypatch.setattr(gemv_mod, "gemv", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    for use in (True, False):
        monkeypatch.setattr(linear_mod, "USE_GEMV", use)
        calls.clear()
        for T in (1, 8, 9, 40):                                          # decode rows, then prefill rows
            x, x_h = bf16(rng, T, 136)
            out = linear_mod.linear(x, w)
            assert isinstance(out, cp.ndarray) and out.dtype == cp.float32 and out.shape == (T, 300)
            assert rel(out.get(), ref64(x_h, w_h)) <= tol(136)
        assert calls == ([1, 8] if use else [])
    monkeypatch.setattr(linear_mod, "USE_GEMV", True)                    # a weight above the size limit: cuBLAS
    monkeypatch.setattr(linear_mod, "GEMV_MAX_WEIGHT_ELEMENTS", w.size - 1)
    calls.clear()
    x, x_h = bf16(rng, 1, 136)
    assert rel(linear_mod.linear(x, w).get(), ref64(x_h, w_h)) <= tol(136) and calls == []


def test_gemv_replays_from_a_cuda_graph():
    """Captured once (no allocation, no host sync inside), replayed on new inputs."""
    import cupy as cp

    from engine.ops.gemv import gemv
    rng = np.random.default_rng(11)
    x, _ = bf16(rng, 4, 2048)
    w, w_h = bf16(rng, 3072, 2048, scale=2048 ** -0.5)
    pool, stream = cp.cuda.MemoryPool(), cp.cuda.Stream(non_blocking=True)
    with cp.cuda.using_allocator(pool.malloc), stream:
        gemv(x, w)                      # warm-up: compiles; its output goes back to the pool for the capture
        stream.synchronize()
        stream.begin_capture()
        out = gemv(x, w)
        graph = stream.end_capture()
    for seed in (1, 2):
        x2, x2_h = bf16(np.random.default_rng(seed), 4, 2048)
        x[...] = x2
        cp.cuda.Device().synchronize()
        graph.launch(stream)
        stream.synchronize()
        assert rel(out.get(), ref64(x2_h, w_h)) <= tol(2048)


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen2-mqa-untied"])
def test_model_logits_with_and_without_the_gemv(preset, tmp_path, monkeypatch):
    """A 6-token prompt runs every projection with 6 rows: through the GEMV (on) or cuBLAS (off);
    both within bf16 bounds of the NumPy backend, and of each other."""
    import engine
    import engine.ops.linear as linear_mod
    from engine.model.random_model import write_random_model
    model_dir = write_random_model(tmp_path / preset, preset, seed=3)
    ids = np.random.default_rng(0).integers(0, 200, 6)
    ref = engine.load_model(model_dir, backend="numpy").logits(ids)
    m = engine.load_model(model_dir, backend="cupy")
    got = {}
    for use in (True, False):
        monkeypatch.setattr(linear_mod, "USE_GEMV", use)
        got[use] = np.asarray(m.logits(ids))
        assert rel(got[use], ref) < 2e-2, f"USE_GEMV={use}"
    assert rel(got[True], got[False]) < 2e-2
