"""The Gated DeltaNet kernels (kernels_cu/gated_delta.cu) against the NumPy references of
engine/ops/gated_delta.py.

Without a GPU: each kernel runs on the CPU executor (engine/exercises/cuda_cpu: the same source built by
the host compiler, each launch in a child process with its buffers between inaccessible pages; three
launches in three thread orders, so a race shows as launches that disagree). Awkward shapes: packed
sequences of 1, 17 (more than one chunk of GDN_CHUNK = 16) and 3 tokens in shuffled state slots,
strided inputs, value heads 3x the key heads, head dims that are not powers of two, and the largest
head dim the kernels take (128). The output is poisoned and followed by a poisoned guard: an element
never written or a write past the end shows.
On a GPU the same comparisons run through the CuPy wrappers: tests/test_gpu_appendix_linear_attention.py.
"""
import numpy as np
import pytest

from engine.backend import KERNELS_DIR, bf16_to_f32, f32_to_bf16
from engine.exercises.cuda_check import Case
from engine.exercises.cuda_cpu import executor as cuda_cpu
from engine.formats.config import config_from_dict
from engine.model.random_model import PRESETS
from engine.ops.gated_delta import (
    GDN_THREADS,
    causal_conv1d_ref,
    decay_log,
    gated_delta_recurrent_ref,
    gated_rmsnorm_ref,
    sigmoid,
)
from engine.ops.rope import rope_qk_norm_partial, rope_tables

SOURCE = KERNELS_DIR / "gated_delta.cu"
POISON = np.uint32(0xFFFFFFFF)
RUNS = 3
cpu_only = pytest.mark.skipif(cuda_cpu.unavailable_reason() is not None,
                              reason=f"no CPU executor here: {cuda_cpu.unavailable_reason()}")
pytestmark = cpu_only

CU = np.array([0, 1, 18, 21], np.int32)       # three sequences: 1, 17 and 3 tokens
SLOTS = np.array([1, 2, 0], np.int32)         # each sequence's slot in a pool of three


def run(kernel: str, grid, inputs: dict, args, n_out: int, out_dtype: str = "f32", source=SOURCE) -> list[np.ndarray]:
    """The float32 output [n_out] of each of RUNS launches (the poisoned guard after it checked); a bf16
    output comes back as the float32 values of its bits."""
    so = cuda_cpu.build(source.read_text(), str(source.relative_to(KERNELS_DIR.parent)), kernel, {})
    case = Case(label=kernel, grid=grid, block=GDN_THREADS, inputs=inputs, args=args, out_dtype=out_dtype,
                want=np.zeros((1, n_out), np.float32))
    poison, bits_type = (POISON, np.uint32) if out_dtype == "f32" else (np.uint16(0xFFFF), np.uint16)
    outcome = cuda_cpu.run_case(so, kernel, case, RUNS, poison, bits_type)
    assert outcome.crash is None, outcome.crash
    outs = []
    for bits in outcome.runs:
        assert (bits[n_out:] == poison).all(), "a write past the end of the output"
        assert (bits[:n_out] != poison).all(), "an output element never written"
        outs.append(bits[:n_out].view(np.float32) if out_dtype == "f32" else bf16_to_f32(bits[:n_out]))
    return outs


def close(got, want, tol=2e-5):
    err = float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))
    assert err <= tol, f"relative error {err:.2e} > {tol:g}"


def test_gates():
    rng = np.random.default_rng(1)
    T, Hv, ld, a_col, b_col = 7, 5, 20, 3, 11
    proj = (3 * rng.standard_normal((T, ld))).astype(np.float32)
    proj[0, a_col] = 30.0                                    # softplus' linear branch
    A_log, dt_bias = rng.standard_normal(Hv).astype(np.float32), rng.standard_normal(Hv).astype(np.float32)
    n = T * Hv
    outs = run("gdn_gates", (1,), {"proj": proj, "A_log": A_log, "dt_bias": dt_bias},
               lambda d: (d["proj"], np.int64(ld), np.int32(a_col), np.int32(b_col), d["A_log"], d["dt_bias"],
                          d["out"][:, :n], d["out"][:, n:], np.int32(T), np.int32(Hv)), 2 * n)
    for out in outs:
        close(out[:n].reshape(T, Hv), decay_log(proj[:, a_col:a_col + Hv], A_log, dt_bias), 1e-6)
        close(out[n:].reshape(T, Hv), sigmoid(proj[:, b_col:b_col + Hv]), 1e-6)


@pytest.mark.parametrize("C,K", [(37, 4), (130, 3), (9, 1)])
def test_causal_conv1d(C, K):
    rng = np.random.default_rng(C + K)
    T, ldx = int(CU[-1]), C + 5
    x = rng.standard_normal((T, ldx)).astype(np.float32)
    w = rng.standard_normal((C, K)).astype(np.float32)
    pool = rng.standard_normal((3, K - 1, C)).astype(np.float32)
    n_out, n_state = T * C, pool.size
    outs = run("causal_conv1d_silu", (-(-C // GDN_THREADS), 3),
               {"x": x, "w": w, "pool": pool, "slots": SLOTS, "cu": CU},
               lambda d: (d["x"], np.int64(ldx), d["w"], d["pool"], d["out"][:, n_out:], d["slots"], d["cu"],
                          d["out"][:, :n_out], np.int32(C), np.int32(K)), n_out + n_state)
    want_out, want_pool = np.empty((T, C), np.float32), np.empty_like(pool)
    for s, slot in enumerate(SLOTS):
        a, b = CU[s], CU[s + 1]
        want_out[a:b], want_pool[slot] = causal_conv1d_ref(x[a:b, :C], w, pool[slot])
    for out in outs:
        close(out[:n_out].reshape(T, C), want_out, 1e-6)
        if n_state:
            np.testing.assert_array_equal(out[n_out:].reshape(pool.shape), want_pool)


HEADS = [(2, 6, 8, 10), (1, 1, 128, 128), (3, 3, 20, 7)]


@pytest.mark.parametrize("kernel", ["gated_delta_recurrent", "gated_delta_chunked"])
@pytest.mark.parametrize("heads", HEADS, ids=["-".join(map(str, h)) for h in HEADS])
def test_gated_delta(kernel, heads):
    Hk, Hv, Dk, Dv = heads
    rng = np.random.default_rng(Dk + Dv + Hv)
    T = int(CU[-1])
    ld = 2 * Hk * Dk + Hv * Dv + 3
    qkv = rng.standard_normal((T, ld)).astype(np.float32)
    g = decay_log(rng.standard_normal((T, Hv)).astype(np.float32), rng.uniform(-3, 1, Hv).astype(np.float32),
                  rng.standard_normal(Hv).astype(np.float32))
    beta = sigmoid(rng.standard_normal((T, Hv)).astype(np.float32))
    pool = (0.5 * rng.standard_normal((3, Hv, Dk, Dv))).astype(np.float32)
    n_out = T * Hv * Dv
    outs = run(kernel, (Hv, 3), {"qkv": qkv, "g": g, "beta": beta, "pool": pool, "slots": SLOTS, "cu": CU},
               lambda d: (d["qkv"], np.int64(ld), d["g"], d["beta"], d["pool"], d["out"][:, n_out:], d["slots"],
                          d["cu"], d["out"][:, :n_out], np.int32(Hk), np.int32(Hv), np.int32(Dk), np.int32(Dv)),
               n_out + pool.size)
    q = qkv[:, :Hk * Dk].reshape(T, Hk, Dk)
    k = qkv[:, Hk * Dk:2 * Hk * Dk].reshape(T, Hk, Dk)
    v = qkv[:, 2 * Hk * Dk:2 * Hk * Dk + Hv * Dv].reshape(T, Hv, Dv)
    want_out, want_pool = np.empty((T, Hv, Dv), np.float32), np.empty_like(pool)
    for s, slot in enumerate(SLOTS):
        a, b = CU[s], CU[s + 1]
        want_out[a:b], want_pool[slot] = gated_delta_recurrent_ref(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b],
                                                                   pool[slot])
    for out in outs:
        close(out[:n_out].reshape(T, Hv, Dv), want_out)
        close(out[n_out:].reshape(pool.shape), want_pool)


@pytest.mark.parametrize("Hv,Dv", [(3, 10), (2, 40)])
def test_gated_rmsnorm_silu(Hv, Dv):
    """The mixer's output gate per (token, head), z a strided column slice; bf16 out."""
    rng = np.random.default_rng(Hv * Dv)
    T, ldz, z_col = 5, Hv * Dv + 7, 4
    o = (3 * rng.standard_normal((T, Hv * Dv))).astype(np.float32)
    z = rng.standard_normal((T, ldz)).astype(np.float32)
    w = (1 + 0.3 * rng.standard_normal(Dv)).astype(np.float32)
    n = T * Hv * Dv
    outs = run("gated_rmsnorm_silu", (2,), {"o": o, "z": z[:, z_col:].copy(), "w": w},
               lambda d: (d["o"], d["z"], np.int64(ldz - z_col), d["w"], d["out"], np.int32(T), np.int32(Hv),
                          np.int32(Dv), np.float32(1e-6)), n, out_dtype="bf16")
    want = gated_rmsnorm_ref(o.reshape(T, Hv, Dv), z[:, z_col:z_col + Hv * Dv].reshape(T, Hv, Dv), w, 1e-6)
    for out in outs:
        close(out.reshape(T, Hv, Dv), want, 8e-3)


def test_attention_output_gate():
    rng = np.random.default_rng(5)
    T, n, ldg = 6, 70, 81
    attn = f32_to_bf16(rng.standard_normal((T, n)).astype(np.float32))
    gate = (4 * rng.standard_normal((T, ldg))).astype(np.float32)
    outs = run("attention_output_gate", (2,), {"attn": attn, "gate": gate},
               lambda d: (d["attn"], d["gate"], np.int64(ldg), d["out"], np.int32(T), np.int32(n)), T * n,
               out_dtype="bf16")
    for out in outs:
        close(out.reshape(T, n), bf16_to_f32(attn) * sigmoid(gate[:, :n]), 8e-3)


@pytest.mark.parametrize("preset", ["tiny-qwen3.5", "tiny-qwen3.5-mqa-untied"])
def test_partial_rotary_qk_norm(preset):
    """kernels_cu/rope.cu's rope_qkv_bias_norm with R < D (Qwen3.5's full-attention heads: q/k norm, the
    first R dims rotated, the rest passed through; input rows hold the gate after v) vs the host path."""
    cfg = config_from_dict(PRESETS[preset])
    rng = np.random.default_rng(len(preset))
    T, D = 5, cfg.head_dim
    qkvg = (3 * rng.standard_normal((T, 2 * cfg.q_dim + 2 * cfg.kv_dim))).astype(np.float32)
    pos = rng.integers(0, 100, T).astype(np.int32)
    cos, sin = rope_tables(cfg, 128)
    qn, kn = (1 + 0.2 * rng.standard_normal((2, D))).astype(np.float32)
    n = T * (cfg.q_dim + 2 * cfg.kv_dim)
    outs = run("rope_qkv_bias_norm", (T,), {"qkvg": qkvg, "pos": pos, "cos": cos, "sin": sin, "qn": qn, "kn": kn},
               lambda d: (d["qkvg"], d["cos"], d["qn"], d["kn"], d["pos"], d["cos"], d["sin"], d["out"],
                          np.int32(cfg.num_attention_heads), np.int32(cfg.num_key_value_heads), np.int32(D),
                          np.int32(cfg.rotary_dim), np.int64(qkvg.shape[1]), np.float32(cfg.rms_norm_eps),
                          np.int32(0), np.int32(1)), n, out_dtype="bf16", source=KERNELS_DIR / "rope.cu")
    want = rope_qk_norm_partial(qkvg, pos, cos, sin, cfg, qn, kn)
    for out in outs:
        close(out.reshape(T, -1), want, 8e-3)
