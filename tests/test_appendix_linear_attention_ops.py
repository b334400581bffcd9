"""The Gated DeltaNet ops (engine/ops/gated_delta.py): the chunked form against the recurrent one, both
against transformers' torch functions (committed fixtures; live when torch is importable), and a state
carried across calls against one call. The recurrent form is also checked against a float64 loop
written from the update rule itself."""
import numpy as np
import pytest
from fixtures.make_gated_delta_fixtures import CASES, case_inputs, conv_inputs
from helpers.oracle import FIXTURES, needs_transformers

from engine.ops.gated_delta import (
    GatedDeltaShapeError,
    causal_conv1d_ref,
    causal_conv1d_step_ref,
    decay_log,
    gated_delta_chunked_ref,
    gated_delta_recurrent_ref,
    gated_rmsnorm_ref,
    sigmoid,
    softplus,
)

TOL = 2e-5       # fp32 sums over a few dozen tokens, relative to the largest value


def close(x, ref, tol=TOL):
    err = float(np.max(np.abs(x.astype(np.float64) - ref)) / max(np.max(np.abs(ref)), 1e-30))
    assert err <= tol, f"relative error {err:.2e} > {tol:g}"


def inputs(T, Hk, Hv, Dk, Dv, seed=0, strong_decay=False):
    rng = np.random.default_rng(seed)
    f = lambda *shape: rng.standard_normal(shape, dtype=np.float32)   # noqa: E731
    A_log = rng.uniform(1.5, 2.8, Hv) if strong_decay else rng.uniform(-3, 1, Hv)
    a = 3 * f(T, Hv) + 6 if strong_decay else f(T, Hv)
    g = decay_log(a.astype(np.float32), A_log.astype(np.float32), f(Hv))
    return f(T, Hk, Dk), f(T, Hk, Dk), f(T, Hv, Dv), g, sigmoid(f(T, Hv)), 0.5 * f(Hv, Dk, Dv)


def delta_rule_float64(q, k, v, g, beta, state):
    """The update written out per head in float64: S <- e^g S; S <- S + beta k (v - S^T k)^T; o = S^T q."""
    T, Hk, Dk = k.shape
    Hv = v.shape[1]
    S = state.astype(np.float64).copy()
    out = np.zeros(v.shape)
    for h in range(Hv):
        kh = h // (Hv // Hk)
        for t in range(T):
            qt = q[t, kh] / np.sqrt(np.sum(q[t, kh].astype(np.float64) ** 2) + 1e-6) / np.sqrt(Dk)
            kt = k[t, kh] / np.sqrt(np.sum(k[t, kh].astype(np.float64) ** 2) + 1e-6)
            S[h] *= np.exp(g[t, h])
            S[h] += beta[t, h] * np.outer(kt, v[t, h] - S[h].T @ kt)
            out[t, h] = S[h].T @ qt
    return out, S


@pytest.mark.parametrize("shape", [(1, 1, 1, 4, 4), (23, 2, 6, 8, 5), (40, 3, 3, 7, 11)])
def test_recurrent_is_the_update_rule(shape):
    q, k, v, g, beta, state = inputs(*shape)
    out, final = gated_delta_recurrent_ref(q, k, v, g, beta, state)
    ref_out, ref_final = delta_rule_float64(q, k, v, g, beta, state)
    close(out, ref_out)
    close(final, ref_final)
    assert out.dtype == final.dtype == np.float32


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 16, 64, 100])
@pytest.mark.parametrize("T", [1, 5, 33, 64, 97])
def test_chunked_equals_recurrent(chunk, T):
    q, k, v, g, beta, state = inputs(T, 2, 4, 6, 5, seed=T)
    out, final = gated_delta_recurrent_ref(q, k, v, g, beta, state)
    c_out, c_final = gated_delta_chunked_ref(q, k, v, g, beta, state, chunk_size=chunk)
    assert c_out.shape == out.shape and c_final.shape == final.shape
    close(c_out, out)
    close(c_final, final)


def test_chunked_survives_strong_decay():
    """g down to about -100 per token: the chunked form's exponents stay <= 0 (no overflow, no NaN)."""
    q, k, v, g, beta, state = inputs(90, 1, 2, 8, 8, seed=3, strong_decay=True)
    assert g.min() < -30
    out, final = gated_delta_recurrent_ref(q, k, v, g, beta, state)
    c_out, c_final = gated_delta_chunked_ref(q, k, v, g, beta, state, chunk_size=32)
    assert np.isfinite(c_out).all() and np.isfinite(c_final).all()
    close(c_out, out)
    close(c_final, final)


@pytest.mark.parametrize("form", ["recurrent", "chunked"])
@pytest.mark.parametrize("split", [1, 17, 40])
def test_state_carried_across_calls_equals_one_call(form, split):
    """Prefill in two pieces (chunked prefill, or prefill then decode) with the state in between."""
    run = gated_delta_recurrent_ref if form == "recurrent" else (
        lambda *a: gated_delta_chunked_ref(*a, chunk_size=16))
    q, k, v, g, beta, state = inputs(41, 2, 6, 5, 7, seed=split)
    whole, whole_state = run(q, k, v, g, beta, None)
    first, mid = run(q[:split], k[:split], v[:split], g[:split], beta[:split], None)
    second, last = run(q[split:], k[split:], v[split:], g[split:], beta[split:], mid)
    close(np.concatenate([first, second]), whole)
    close(last, whole_state)


def test_initial_state_is_not_modified():
    q, k, v, g, beta, state = inputs(9, 1, 1, 4, 4)
    before = state.copy()
    gated_delta_recurrent_ref(q, k, v, g, beta, state)
    gated_delta_chunked_ref(q, k, v, g, beta, state, chunk_size=4)
    np.testing.assert_array_equal(state, before)


def test_bad_shapes_are_refused():
    q, k, v, g, beta, state = inputs(6, 2, 4, 3, 5)
    bad = {"v heads not a multiple": (q, k, v[:, :3], g[:, :3], beta[:, :3], None),
           "state shape": (q, k, v, g, beta, state[:, :2]),
           "q and k differ": (q[:, :1], k, v, g, beta, None),
           "g length": (q, k, v, g[:5], beta, None)}
    for args in bad.values():
        for fn in (gated_delta_recurrent_ref, gated_delta_chunked_ref):
            with pytest.raises(GatedDeltaShapeError, match="do not fit"):
                fn(*args)
    with pytest.raises(GatedDeltaShapeError, match="chunk_size"):
        gated_delta_chunked_ref(q, k, v, g, beta, None, chunk_size=0)
    with pytest.raises(GatedDeltaShapeError):
        causal_conv1d_ref(np.zeros((3, 4), np.float32), np.zeros((5, 4), np.float32))


# ---- the convolution --------------------------------------------------------------------------

def test_conv_is_causal_and_carries_its_state():
    c = conv_inputs()
    x, w = c["x"], c["weight"]
    whole, final = causal_conv1d_ref(x, w)
    # causal: a later input never changes an earlier output
    changed = x.copy()
    changed[10:] += 1.0
    np.testing.assert_array_equal(causal_conv1d_ref(changed, w)[0][:10], whole[:10])
    # two calls with the state between == one call; the state is the last K-1 inputs
    first, mid = causal_conv1d_ref(x[:12], w)
    second, last = causal_conv1d_ref(x[12:], w, mid)
    np.testing.assert_allclose(np.concatenate([first, second]), whole, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(last, x[-(w.shape[1] - 1):])
    # token by token (decode)
    state = mid.copy()
    steps = np.stack([causal_conv1d_step_ref(x[t], w, state) for t in range(12, len(x))])
    np.testing.assert_allclose(steps, whole[12:], rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(state, final)


def test_conv_tap_order():
    """weight[c, K-1] multiplies the current token, weight[c, 0] the oldest (a flipped kernel is a
    common mistake; PyTorch's conv1d is a cross-correlation)."""
    x = np.zeros((5, 1), np.float32)
    x[0, 0] = 1.0
    w = np.array([[1.0, 2.0, 3.0]], np.float32)
    pre = np.zeros((5, 1), np.float32)
    for t in range(5):
        pre[t, 0] = {0: 3.0, 1: 2.0, 2: 1.0}.get(t, 0.0)
    np.testing.assert_allclose(causal_conv1d_ref(x, w)[0], pre / (1 + np.exp(-pre)), rtol=1e-6)


def test_gates():
    x = np.array([-100.0, -1.0, 0.0, 3.0, 25.0, 200.0], np.float32)
    np.testing.assert_allclose(softplus(x), np.log1p(np.exp(x.astype(np.float64))), rtol=1e-6, atol=1e-30)
    assert np.isfinite(sigmoid(x)).all()
    g = decay_log(x[None, :], np.zeros(6, np.float32), np.zeros(6, np.float32))
    assert (g <= 0).all()
    z = np.zeros((2, 4), np.float32)
    np.testing.assert_array_equal(gated_rmsnorm_ref(np.ones((2, 4), np.float32), z, np.ones(4, np.float32), 1e-6), 0)


# ---- against transformers --------------------------------------------------------------------

@pytest.fixture(scope="module")
def torch_fixture():
    with np.load(FIXTURES / "gated_delta_torch.npz") as f:
        return dict(f)


def _args(x):
    return [x[n] for n in ("q", "k", "v", "g", "beta")] + [x.get("state")]


@pytest.mark.parametrize("name", sorted(CASES))
def test_both_forms_match_transformers_fixture(torch_fixture, name):
    x = case_inputs(name)
    for key, value in x.items():
        # the inputs are rebuilt: bit for bit from the generator, up to an ulp where the gates went
        # through float32 exp/log1p (NumPy's vectorised libm differs by one ulp between CPUs)
        np.testing.assert_allclose(value, torch_fixture[f"{name}.{key}"], rtol=4e-7, atol=0)
        x[key] = torch_fixture[f"{name}.{key}"]      # transformers' outputs belong to exactly these
    out, final = gated_delta_recurrent_ref(*_args(x))
    c_out, c_final = gated_delta_chunked_ref(*_args(x), chunk_size=64)
    for got in (out, c_out):
        close(got, torch_fixture[f"{name}.out"])
        close(got, torch_fixture[f"{name}.chunk_out"])
    for got in (final, c_final):
        close(got, torch_fixture[f"{name}.final"])
        close(got, torch_fixture[f"{name}.chunk_final"])


def test_conv_matches_transformers_fixture(torch_fixture):
    c = conv_inputs()
    close(causal_conv1d_ref(c["x"], c["weight"])[0], torch_fixture["conv.out"], 1e-6)


@needs_transformers
@pytest.mark.parametrize("chunk", [8, 64])
def test_both_forms_match_transformers_live(chunk):
    import torch
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf
    q, k, v, g, beta, state = inputs(77, 2, 4, 9, 6, seed=11)
    t = lambda a: torch.from_numpy(a)[None]   # noqa: E731
    args = [t(a) for a in (q, k, v, g, beta)]
    ref_out, ref_final = hf.torch_chunk_gated_delta_rule(*args, chunk_size=chunk, initial_state=t(state),
                                                         output_final_state=True, use_qk_l2norm_in_kernel=True)
    rec_out, rec_final = hf.torch_recurrent_gated_delta_rule(*args, initial_state=t(state), output_final_state=True,
                                                             use_qk_l2norm_in_kernel=True)
    for out, final in (gated_delta_chunked_ref(q, k, v, g, beta, state, chunk_size=chunk),
                       gated_delta_recurrent_ref(q, k, v, g, beta, state)):
        close(out, ref_out[0].numpy())
        close(final, ref_final[0].numpy())
        close(out, rec_out[0].numpy())
        close(final, rec_final[0].numpy())
    x = np.random.default_rng(2).standard_normal((19, 13), dtype=np.float32)
    w = np.random.default_rng(3).standard_normal((13, 4), dtype=np.float32)
    y = hf.causal_conv1d_fn(torch.from_numpy(x.T.copy())[None], torch.from_numpy(w), None, activation="silu")
    close(causal_conv1d_ref(x, w)[0], y[0].numpy().T, 1e-6)
