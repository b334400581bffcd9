"""kernels_cu/moe.cu run on the CPU executor (engine/exercises/cuda_cpu: the CUDA C compiled for the host,
a block's threads as fibers, three launches in three thread orders) against the NumPy references, so the
kernels' indexing, tiling and synchronisation are checked on a machine without a GPU. What the executor
cannot show (speed, the GPU's memory model, the launch from CuPy) is for tests/test_gpu_appendix_moe.py."""
import numpy as np
import pytest

from engine.backend import KERNELS_DIR, bf16_to_f32, f32_to_bf16
from engine.exercises import cuda_check
from engine.exercises.cuda_check import Case
from engine.exercises.cuda_cpu import executor as cuda_cpu
from engine.ops.moe import GEMM_THREADS, GROUP_THREADS, MOE_MAX_EXPERTS, MOE_TILE_M, MOE_TILE_N, router_ref, tile_bound

pytestmark = pytest.mark.skipif(cuda_cpu.unavailable_reason() is not None,
                                reason=f"no CPU executor here: {cuda_cpu.unavailable_reason()}")
DEFINES = {"MOE_TILE_M": MOE_TILE_M, "MOE_TILE_N": MOE_TILE_N, "MOE_MAX_EXPERTS": MOE_MAX_EXPERTS}


def launch(kernel, grid, block, inputs, args, out_words):
    """Every launch's raw output words (uint32, one array per thread order); `args` maps the device
    inputs and `out` (out_words words, carved into the kernel's outputs) to the argument tuple."""
    so = cuda_cpu.build((KERNELS_DIR / "moe.cu").read_text(), "moe.cu", kernel, DEFINES)
    case = Case(kernel, grid, block, inputs, args, "f32", np.zeros((1, out_words), np.float32))
    outcome = cuda_cpu.run_case(so, kernel, case, 3, cuda_check.POISON["f32"], cuda_check.BITS["f32"])
    assert outcome.crash is None, outcome.crash
    return [r[:out_words] for r in outcome.runs]


def carve(out, *sizes):
    """Consecutive views of the output words (float32 or int32 each: (size, dtype))."""
    views, at = [], 0
    for size, dtype in sizes:
        views.append(out.reshape(-1)[at:at + size].view(dtype))
        at += size
    return views


def group_ref(experts: np.ndarray, E: int):
    """What moe_group must produce, up to the order of an expert's rows: offsets [E+1] and the tiles."""
    counts = np.bincount(experts.ravel(), minlength=E)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    tiles = [(e, r) for e in range(E) for r in range(offsets[e], offsets[e + 1], MOE_TILE_M)]
    return offsets, tiles


@pytest.mark.parametrize("E,k,norm", [(7, 3, True), (7, 7, False), (40, 1, True), (128, 8, True), (300, 8, False)])
def test_route_matches_the_router_reference(E, k, norm):
    T = 6
    rng = np.random.default_rng(E * 10 + k)
    logits = (2 * rng.standard_normal((T, E))).astype(np.float32)
    logits[1, :] = 0.5                                 # every expert tied: the lowest indices win
    logits[2, [3, E - 1]] = logits[2].max() + 1        # a tie at the top, far apart
    want_w, want_e = router_ref(logits, k, norm)
    for out in launch("moe_route", (T,), 32, {"logits": logits},
                      lambda d: (d["logits"], *carve(d["out"], (T * k, np.float32), (T * k, np.int32)),
                                 np.int32(E), np.int32(k), np.int32(norm)), 2 * T * k):
        w, e = carve(out, (T * k, np.float32), (T * k, np.int32))
        np.testing.assert_array_equal(e.reshape(T, k), want_e)
        np.testing.assert_allclose(w.reshape(T, k), want_w, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("T,E,k", [(1, 128, 8), (3, 5, 2), (37, 7, 3), (700, 9, 4), (257, 64, 1)])
def test_group_sorts_the_pairs_by_expert(T, E, k):
    rng = np.random.default_rng(T + E)
    experts = np.stack([rng.choice(E, size=k, replace=False) for _ in range(T)]).astype(np.int32)   # [T, k]
    R, tiles = T * k, tile_bound(T * k, E)
    sizes = [(E + 1, np.int32), (R, np.int32), (R, np.int32), (tiles, np.int32), (tiles, np.int32), (1, np.int32)]
    want_offsets, want_tiles = group_ref(experts, E)
    runs = launch("moe_group", (1,), GROUP_THREADS, {"experts": experts},
                  lambda d: (d["experts"], np.int32(R), np.int32(k), np.int32(E), *carve(d["out"], *sizes)),
                  sum(s for s, _ in sizes))
    for out in runs:
        offsets, row_token, pair_row, tile_expert, tile_start, num_tiles = carve(out, *sizes)
        np.testing.assert_array_equal(offsets, want_offsets)
        assert sorted(pair_row.tolist()) == list(range(R)), "pair_row is not a permutation of the grouped rows"
        pairs = np.arange(R)
        np.testing.assert_array_equal(row_token[pair_row], pairs // k)          # each row names its token
        expert_of_row = np.searchsorted(offsets, pair_row, side="right") - 1
        np.testing.assert_array_equal(expert_of_row, experts.ravel())          # ... inside its expert's range
        n = int(num_tiles[0])
        assert n == len(want_tiles) <= tiles
        assert list(zip(tile_expert[:n].tolist(), tile_start[:n].tolist(), strict=True)) == want_tiles


def grouped_inputs(T, E, k, N, K, seed):
    """A routing, its grouping (in pair order within each expert), bf16 x [T, K] and w [E, N, K]."""
    rng = np.random.default_rng(seed)
    experts = np.stack([rng.choice(E, size=k, replace=False) for _ in range(T)]).astype(np.int32)
    offsets, tiles = group_ref(experts, E)
    order = np.argsort(experts.ravel(), kind="stable")             # grouped row -> pair
    row_token = (order // k).astype(np.int32)
    x = f32_to_bf16(rng.standard_normal((T, K)).astype(np.float32))
    w = f32_to_bf16((rng.standard_normal((E, N, K)) / np.sqrt(K)).astype(np.float32))
    unused = sorted(set(range(E)) - set(experts.ravel().tolist()))
    w[unused] = 0xFFFF                                              # NaN: a tile that read them would show it
    grid_tiles = tile_bound(T * k, E)
    tile_expert = np.zeros(grid_tiles, np.int32)
    tile_start = np.zeros(grid_tiles, np.int32)
    tile_expert[:len(tiles)], tile_start[:len(tiles)] = zip(*tiles, strict=True)
    return experts, offsets, row_token, x, w, tile_expert, tile_start, np.array([len(tiles)], np.int32), unused


@pytest.mark.parametrize("T,E,k,N,K", [(1, 9, 3, 70, 45), (5, 6, 2, 64, 32), (23, 7, 3, 130, 37), (2, 40, 8, 20, 96)])
@pytest.mark.parametrize("gather", [True, False])
def test_expert_gemm_computes_each_row_with_its_own_expert(T, E, k, N, K, gather):
    experts, offsets, row_token, x, w, tile_expert, tile_start, num_tiles, unused = grouped_inputs(T, E, k, N, K, N + K)
    R = T * k
    if not gather:        # the down projection's input: already one row per grouped row
        x = f32_to_bf16(np.random.default_rng(1).standard_normal((R, K)).astype(np.float32))
    source_rows = bf16_to_f32(x)[row_token] if gather else bf16_to_f32(x)
    expert_of_row = np.repeat(np.arange(E), np.diff(offsets))
    want = np.einsum("rk,rnk->rn", source_rows.astype(np.float64), bf16_to_f32(w)[expert_of_row].astype(np.float64))
    inputs = {"x": x, "row_token": row_token, "w": w, "tile_expert": tile_expert, "tile_start": tile_start,
              "offsets": offsets, "num_tiles": num_tiles}
    grid = (len(tile_expert), -(-N // MOE_TILE_N))
    assert unused or E <= T * k
    for out in launch("moe_expert_gemm", grid, GEMM_THREADS, inputs,
                      lambda d: (d["x"], d["row_token"], np.int32(gather), d["w"], d["tile_expert"], d["tile_start"],
                                 d["offsets"], d["num_tiles"], d["out"].view(np.float32), np.int32(N), np.int32(K)),
                      R * N):
        np.testing.assert_allclose(out.view(np.float32).reshape(R, N), want, rtol=1e-5, atol=1e-5)


def test_combine_sums_each_tokens_experts_by_weight():
    T, k, H = 7, 3, 50
    rng = np.random.default_rng(5)
    R = T * k
    y = rng.standard_normal((R, H)).astype(np.float32)
    pair_row = rng.permutation(R).astype(np.int32)
    weights = rng.random((T, k)).astype(np.float32)
    want = np.einsum("tj,tjh->th", weights, y[pair_row.reshape(T, k)])
    for out in launch("moe_combine", (T,), 256, {"y": y, "pair_row": pair_row, "weights": weights},
                      lambda d: (d["y"], d["pair_row"], d["weights"], d["out"].view(np.float32), np.int32(k),
                                 np.int32(H)), T * H):
        np.testing.assert_allclose(out.view(np.float32).reshape(T, H), want, rtol=1e-6, atol=1e-6)
