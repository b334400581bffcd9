"""The Gated DeltaNet kernels on a GPU (skipped elsewhere with the reason), through their CuPy wrappers
(engine/ops/gated_delta.py), against the NumPy references: the shapes of Qwen3.5-0.8B's linear layers
(16 key and 16 value heads of 128, 6144 conv channels, K = 4) and awkward ones, prefill lengths across
several chunks, decode steps that continue a prefill's state in place, shuffled slots, strided inputs.

    python -m pytest -m gpu tests/test_gpu_appendix_linear_attention.py
"""
import numpy as np
import pytest

from engine.ops.gated_delta import (
    causal_conv1d_ref,
    decay_log,
    gated_delta_chunked_ref,
    gated_delta_recurrent_ref,
    sigmoid,
)

pytestmark = pytest.mark.gpu   # skipped without a usable GPU (tests/conftest.py)

# (Hk, Hv, Dk, Dv): Qwen3.5-0.8B, value heads 2x key heads (the 9B's ratio), awkward small ones
HEADS = [(16, 16, 128, 128), (4, 8, 128, 128), (2, 6, 24, 40), (1, 3, 7, 5)]
LENGTHS = [[1], [300], [17, 1, 64, 5], [129, 2]]


def rel(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - b)) / max(np.max(np.abs(b)), 1e-30))


def packed(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def inputs(rng, T, Hk, Hv, Dk, Dv, pad=3):
    ld = 2 * Hk * Dk + Hv * Dv + pad
    qkv = rng.standard_normal((T, ld)).astype(np.float32)
    g = decay_log(rng.standard_normal((T, Hv)).astype(np.float32), rng.uniform(-4, 2, Hv).astype(np.float32),
                  rng.standard_normal(Hv).astype(np.float32))
    beta = sigmoid(rng.standard_normal((T, Hv)).astype(np.float32))
    return qkv, g, beta


def split(qkv, Hk, Hv, Dk, Dv):
    T = qkv.shape[0]
    return (qkv[:, :Hk * Dk].reshape(T, Hk, Dk), qkv[:, Hk * Dk:2 * Hk * Dk].reshape(T, Hk, Dk),
            qkv[:, 2 * Hk * Dk:2 * Hk * Dk + Hv * Dv].reshape(T, Hv, Dv))


def reference(qkv, g, beta, pool, slots, cu, heads):
    Hk, Hv, Dk, Dv = heads
    q, k, v = split(qkv, *heads)
    out, pool = np.empty((qkv.shape[0], Hv, Dv), np.float32), pool.copy()
    for s, slot in enumerate(slots):
        a, b = cu[s], cu[s + 1]
        out[a:b], pool[slot] = gated_delta_recurrent_ref(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], pool[slot])
    return out.reshape(len(out), -1), pool


@pytest.mark.parametrize("heads", HEADS, ids=["-".join(map(str, h)) for h in HEADS])
@pytest.mark.parametrize("lengths", LENGTHS, ids=["+".join(map(str, n)) for n in LENGTHS])
@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "recurrent"])
def test_gated_delta_kernels_match_numpy(heads, lengths, chunked):
    import cupy as cp

    from engine.ops.gated_delta import gated_delta_gpu
    rng = np.random.default_rng(sum(heads) + sum(lengths))
    cu = packed(lengths)
    qkv, g, beta = inputs(rng, int(cu[-1]), *heads)
    slots = rng.permutation(len(lengths) + 1)[:len(lengths)].astype(np.int32)      # one slot left unused
    pool = (0.3 * rng.standard_normal((len(lengths) + 1, heads[1], heads[2], heads[3]))).astype(np.float32)
    want_out, want_pool = reference(qkv, g, beta, pool, slots, cu, heads)
    dev_pool = cp.asarray(pool)
    out = gated_delta_gpu(cp.asarray(qkv), heads, cp.asarray(g), cp.asarray(beta), dev_pool, cp.asarray(slots), cu,
                          chunked=chunked)
    assert rel(out.get(), want_out) < 1e-4
    assert rel(dev_pool.get(), want_pool) < 1e-4          # the unused slot is untouched: it is in want_pool too


def test_chunked_prefill_then_recurrent_decode_in_place():
    """The serving pattern: a prompt through the chunked kernel, then decode tokens through the recurrent
    one, the state staying in its pool slot the whole time; against one pass of the reference."""
    import cupy as cp

    from engine.ops.gated_delta import gated_delta_gpu
    heads = (16, 16, 128, 128)
    rng = np.random.default_rng(0)
    qkv, g, beta = inputs(rng, 200 + 6, *heads)
    pool = np.zeros((2, 16, 128, 128), np.float32)
    want, _ = reference(qkv, g, beta, pool, [1], packed([206]), heads)
    dev_pool, slots = cp.asarray(pool), cp.asarray(np.array([1], np.int32))
    got = [gated_delta_gpu(cp.asarray(qkv[:200]), heads, cp.asarray(g[:200]), cp.asarray(beta[:200]), dev_pool,
                           slots, packed([200])).get()]
    for t in range(200, 206):
        got.append(gated_delta_gpu(cp.asarray(qkv[t:t + 1]), heads, cp.asarray(g[t:t + 1]), cp.asarray(beta[t:t + 1]),
                                   dev_pool, slots, packed([1]), chunked=False).get())
    assert rel(np.concatenate(got), want) < 1e-4
    assert rel(got[0], gated_delta_chunked_ref(*split(qkv[:200], *heads), g[:200], beta[:200])[0].reshape(200, -1)) < 1e-4


@pytest.mark.parametrize("C,K,lengths", [(6144, 4, [1, 1, 1]), (6144, 4, [300, 7]), (37, 3, [5, 1, 20]), (9, 1, [4])])
def test_causal_conv1d_kernel_matches_numpy(C, K, lengths):
    import cupy as cp

    from engine.ops.gated_delta import causal_conv1d_gpu
    rng = np.random.default_rng(C + K)
    cu = packed(lengths)
    wide = rng.standard_normal((int(cu[-1]), C + 11)).astype(np.float32)      # the channels, then other columns
    w = rng.standard_normal((C, K)).astype(np.float32)
    pool = rng.standard_normal((len(lengths), K - 1, C)).astype(np.float32)
    slots = rng.permutation(len(lengths)).astype(np.int32)
    want_out, want_pool = np.empty((int(cu[-1]), C), np.float32), pool.copy()
    for s, slot in enumerate(slots):
        a, b = cu[s], cu[s + 1]
        want_out[a:b], want_pool[slot] = causal_conv1d_ref(wide[a:b, :C], w, pool[slot])
    dev_pool = cp.asarray(pool)
    out = causal_conv1d_gpu(cp.asarray(wide), cp.asarray(w), dev_pool, cp.asarray(slots), cu)
    assert rel(out.get(), want_out) < 1e-5
    np.testing.assert_array_equal(dev_pool.get(), want_pool)


def test_gates_kernel_matches_numpy():
    import cupy as cp

    from engine.ops.gated_delta import gates_gpu
    rng = np.random.default_rng(3)
    T, Hv = 333, 16
    proj = (4 * rng.standard_normal((T, 6144 + 2048 + 2 * Hv))).astype(np.float32)
    a_col, b_col = 6144 + 2048 + Hv, 6144 + 2048
    A_log, dt_bias = rng.standard_normal(Hv).astype(np.float32), rng.standard_normal(Hv).astype(np.float32)
    g, beta = gates_gpu(cp.asarray(proj), a_col, b_col, cp.asarray(A_log), cp.asarray(dt_bias))
    assert rel(g.get(), decay_log(proj[:, a_col:a_col + Hv], A_log, dt_bias)) < 1e-5
    assert rel(beta.get(), sigmoid(proj[:, b_col:b_col + Hv])) < 1e-5


def test_shapes_the_kernels_cannot_take_are_refused():
    import cupy as cp

    from engine.ops.gated_delta import GatedDeltaShapeError, causal_conv1d_gpu, gated_delta_gpu
    x = cp.zeros((4, 8), cp.float32)
    with pytest.raises(GatedDeltaShapeError, match="Dk, Dv <= 128"):
        gated_delta_gpu(x, (1, 1, 256, 64), x, x, cp.zeros((1, 1, 256, 64), cp.float32), cp.zeros(1, cp.int32),
                        packed([4]))
    with pytest.raises(GatedDeltaShapeError, match="K <= 8"):
        causal_conv1d_gpu(x, cp.zeros((8, 9), cp.float32), cp.zeros((1, 8, 8), cp.float32), cp.zeros(1, cp.int32),
                          packed([4]))
    with pytest.raises(GatedDeltaShapeError, match="at least one token"):
        causal_conv1d_gpu(x, cp.zeros((8, 4), cp.float32), cp.zeros((2, 3, 8), cp.float32), cp.zeros(2, cp.int32),
                          np.array([0, 4, 4], np.int32))
