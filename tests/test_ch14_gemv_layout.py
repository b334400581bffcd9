"""The GEMV kernel's index math, checked on the CPU (no GPU needed).

kernels_cu/gemv.cu is replayed here in NumPy with the same structure: the grid and block sizes of
engine/ops/gemv.py's launch_geometry, warp j's k-blocks, the main loop (UNROLL k-blocks, no bounds
checks) and the tail loop, each lane's 16-byte chunks, the registers it hands to mma.m16n8k16, the
shared-memory reduction over warps and the guarded writes. The mma itself is emulated from the
fragment layout of the PTX ISA (independently of the kernel's choice of which k goes where), so a
wrong fragment assignment, a k-block read twice or never, a bounds check missing in the main loop,
or an output written twice or never shows up as a mismatch against x @ W^T.
"""
import numpy as np
import pytest

from engine.ops import gemv as G

LANES = np.arange(32)
GID, QID = LANES >> 2, LANES & 3         # g = lane / 4, q = lane % 4


def _fragment_indices():
    """(row, col) of every register half of A [32, 4, 2], B [32, 2, 2] and C/D [32, 4] in its
    matrix, from the fragment layout of the PTX ISA for mma.m16n8k16 (row.col, bf16):
      a0 (row g, cols 2q, 2q+1)  a1 (row g+8, cols 2q..)  a2 (row g, cols 2q+8..)  a3 (row g+8, cols 2q+8..)
      b0 (k 2q, 2q+1; col g)     b1 (k 2q+8, 2q+9; col g)
      c0 c1 (row g, cols 2q, 2q+1)  c2 c3 (row g+8, cols 2q, 2q+1)
    (the lower half of a register holds the lower column / k)."""
    g, q, h = GID[:, None, None], QID[:, None, None], np.arange(2)[None, None, :]
    reg = np.arange(4)[None, :, None]
    a_rows = np.broadcast_to(g + 8 * (reg % 2), (32, 4, 2))
    a_cols = np.broadcast_to(2 * q + 8 * (reg // 2) + h, (32, 4, 2))
    reg = np.arange(2)[None, :, None]
    b_rows = np.broadcast_to(2 * q + 8 * reg + h, (32, 2, 2))
    b_cols = np.broadcast_to(g, (32, 2, 2))
    reg = np.arange(4)[None, :]
    c_rows = GID[:, None] + 8 * (reg // 2)
    c_cols = 2 * QID[:, None] + reg % 2
    for rows, cols, shape in ((a_rows, a_cols, (16, 16)), (b_rows, b_cols, (16, 8)), (c_rows, c_cols, (16, 8))):
        flat = np.ravel_multi_index((rows.ravel(), cols.ravel()), shape)
        assert np.array_equal(np.sort(flat), np.arange(shape[0] * shape[1])), "each element from one lane"
    return (a_rows, a_cols), (b_rows, b_cols), (c_rows, c_cols)


A_IDX, B_IDX, C_IDX = _fragment_indices()


def mma_m16n8k16(a, b, c):
    """D = A B + C for one warp. a [32, 4, 2]: registers a0..a3 of each lane, each a (low, high)
    pair of bf16; b [32, 2, 2]; c [32, 4] (layout: _fragment_indices)."""
    A, B, C = np.empty((16, 16)), np.empty((16, 8)), np.empty((16, 8))
    A[A_IDX], B[B_IDX], C[C_IDX] = a, b, c
    return (A @ B + C)[C_IDX]


def load8(row, k, K, vec):
    """[32, 8]: 8 values of each lane's row from its k on, zeros past K (the kernel's load8).
    row: [32, K] the row each lane reads; k: [32] first k of each lane."""
    cols = k[:, None] + np.arange(8)[None, :]                      # [32, 8]
    inside = cols < K
    if vec:
        assert (inside.all(axis=1) | ~inside.any(axis=1)).all(), "a 16-byte chunk straddles K"
    return np.where(inside, np.take_along_axis(row, np.minimum(cols, K - 1), axis=1), 0.0)


def step(acc, wa, wb, xv):
    """The kernel's two mmas of one k-block: the lane's own 8 k values fill its fragment slots."""
    pairs = lambda v, i: v[:, i:i + 2]                          # noqa: E731  (register = 2 bf16)
    for h in (0, 4):                                            # mma 1: k 8q+0..3, mma 2: 8q+4..7
        a = np.stack([pairs(wa, h), pairs(wb, h), pairs(wa, h + 2), pairs(wb, h + 2)], axis=1)
        b = np.stack([pairs(xv, h), pairs(xv, h + 2)], axis=1)
        acc = mma_m16n8k16(a, b, acc)
    return acc


def gemv_emulated(x, w, sms, vec):
    """out [T, N] as kernels_cu/gemv.cu computes it (float64 arithmetic), with the launch geometry
    of engine/ops/gemv.py. Unwritten outputs stay NaN; a second write to one fails."""
    T, K = x.shape
    N = w.shape[0]
    blocks, warps = G.launch_geometry(N, K, sms)
    out = np.full((T, N), np.nan)
    kblocks = -(-K // G.KBLOCK)
    full = K // G.KBLOCK if vec else 0
    for block in range(blocks):
        n0 = block * G.TILE_N
        na, nb = n0 + GID, n0 + GID + 8
        a_ok, b_ok = na < N, nb < N
        w_a = w[np.where(a_ok, na, 0)]                          # [32, K]: each lane's row (clamped)
        w_b = w[np.where(b_ok, nb, 0)]
        x_g = x[np.where(GID < T, GID, 0)]
        partial = []
        for warp in range(warps):
            acc = np.zeros((32, 4))
            kb = warp
            if vec:
                while kb + (G.UNROLL - 1) * warps < full:        # main loop: no bounds checks
                    for u in range(G.UNROLL):
                        k = (kb + u * warps) * G.KBLOCK + 8 * QID
                        assert (k + 8 <= K).all(), "the main loop reads past K"
                        assert (k % 8 == 0).all()               # 16-byte aligned chunks
                        acc = step(acc, load8(w_a, k, K, vec), load8(w_b, k, K, vec), load8(x_g, k, K, vec))
                    kb += G.UNROLL * warps
            while kb < kblocks:                                 # tail: one k-block at a time
                k = kb * G.KBLOCK + 8 * QID
                acc = step(acc, load8(w_a, k, K, vec), load8(w_b, k, K, vec), load8(x_g, k, K, vec))
                kb += warps
            partial.append(acc)
        acc = partial[0]
        for j in range(1, warps):                               # warp 0 adds the others, in order
            acc = acc + partial[j]
        for lane, q in zip(LANES, QID):
            for t, (ia, ib) in ((2 * q, (0, 2)), (2 * q + 1, (1, 3))):
                if t < T:
                    for n, ok, i in ((na[lane], a_ok[lane], ia), (nb[lane], b_ok[lane], ib)):
                        if ok:
                            assert np.isnan(out[t, n]), f"out[{t}, {n}] written twice"
                            out[t, n] = acc[lane, i]
    return out


CASES = [  # (T, N, K, sms): K % 8 != 0, K < 32, K not a multiple of 32, N not a multiple of 16,
    (1, 1, 8, 132), (8, 17, 50, 132), (3, 16, 72, 132), (5, 33, 136, 2), (2, 40, 576, 1),
    (8, 48, 2048, 1), (7, 24, 1024, 132), (4, 5, 130, 1), (6, 64, 264, 8), (1, 31, 4096, 132),
    # one warp per block, k-blocks left over after the main loop (and a partial last one)
    (3, 520, 232, 1), (2, 1030, 456, 2),
]


@pytest.mark.parametrize("vec", [True, False], ids=["16-byte loads", "element loads"])
@pytest.mark.parametrize("T,N,K,sms", CASES)
def test_emulated_kernel_matches_x_times_w_transposed(T, N, K, sms, vec):
    if vec and K % 8:
        pytest.skip("the 16-byte path needs K % 8 == 0 (the launcher picks the element-load kernel)")
    rng = np.random.default_rng(T * 1000 + K + N)
    x, w = rng.standard_normal((T, K)), rng.standard_normal((N, K))
    got = gemv_emulated(x, w, sms, vec)
    np.testing.assert_allclose(got, x @ w.T, rtol=1e-10, atol=1e-10)


def test_warps_split_k_on_narrow_matrices_and_keep_a_main_loop_step_each():
    """launch_geometry on the decode shapes (132 SMs, the H200): warps per block a power of two up
    to NWARPS, more of them where N has few 16-column tiles, each keeping UNROLL k-blocks."""
    shapes = {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192),
              "lm_head": (128256, 2048), "smol qkv": (960, 576), "smol lm_head": (49152, 576), "tiny": (160, 72)}
    got = {name: G.launch_geometry(N, K, 132) for name, (N, K) in shapes.items()}
    assert got["qkv"] == (192, 16) and got["o"] == (128, 16) and got["down"] == (128, 16)
    assert got["gate_up"] == (1024, 8) and got["lm_head"] == (8016, 1)
    for name, (N, K) in shapes.items():
        blocks, warps = got[name]
        assert blocks * G.TILE_N >= N > (blocks - 1) * G.TILE_N
        assert warps & (warps - 1) == 0 and 1 <= warps <= G.NWARPS
        assert warps == 1 or -(-K // G.KBLOCK) >= warps * G.UNROLL, name


@pytest.mark.slow
def test_the_switch_reads_the_environment():
    import subprocess
    import sys
    code = "import engine.ops.linear as l; print(l.USE_GEMV)"
    for value, want in (("0", "False"), ("off", "False"), ("1", "True"), (None, "True")):
        env = {k: v for k, v in __import__("os").environ.items() if k != "ENGINE_GEMV"}
        if value is not None:
            env["ENGINE_GEMV"] = value
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == want, (value, out.stdout, out.stderr)
