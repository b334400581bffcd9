"""The mixture-of-experts references (engine/ops/moe.py) against transformers' own router and sparse
block, their order of operations and ties, and the "moe_router" stage inside the real model."""
import numpy as np
import pytest
from helpers.oracle import needs_transformers

import engine
from engine.model.random_model import write_random_model
from engine.ops.moe import experts_ref, moe_ref, router_ref, softmax_ref, tile_bound
from engine.plugins import PluginError


def random_case(seed, T=9, E=7, H=12, I=10, scale=2.0):
    rng = np.random.default_rng(seed)
    h = rng.standard_normal((T, H)).astype(np.float32)
    router = (scale * rng.standard_normal((E, H)) / np.sqrt(H)).astype(np.float32)
    gate_up = (rng.standard_normal((E, 2 * I, H)) / np.sqrt(H)).astype(np.float32)
    down = (rng.standard_normal((E, H, I)) / np.sqrt(I)).astype(np.float32)
    return h, router, gate_up, down


def test_router_picks_the_largest_probabilities_best_first():
    logits = np.array([[0.1, 2.0, -1.0, 1.5, 0.3]], dtype=np.float32)
    w, e = router_ref(logits, 2, norm_topk_prob=False)
    p = softmax_ref(logits)[0]
    assert e.tolist() == [[1, 3]] and e.dtype == np.int32 and w.dtype == np.float32
    np.testing.assert_allclose(w[0], p[[1, 3]], rtol=1e-6)          # raw probabilities: sum < 1
    w, _ = router_ref(logits, 2, norm_topk_prob=True)
    np.testing.assert_allclose(w[0], p[[1, 3]] / p[[1, 3]].sum(), rtol=1e-6)
    np.testing.assert_allclose(w.sum(-1), 1.0, rtol=1e-6)


def test_router_ties_go_to_the_lower_expert():
    logits = np.array([[1.0, 3.0, 3.0, 0.0, 3.0], [2.0, 2.0, 2.0, 2.0, 2.0]], dtype=np.float32)
    _, e = router_ref(logits, 2, norm_topk_prob=True)
    assert e.tolist() == [[1, 2], [0, 1]]


def test_softmax_before_top_k_is_not_softmax_after():
    """Without renormalisation the two orders differ (the raw weights do not sum to 1); with it they
    agree. The checker of the appendix's exercise names the first mistake."""
    logits = np.random.default_rng(0).standard_normal((6, 8)).astype(np.float32)
    w, e = router_ref(logits, 3, norm_topk_prob=False)
    after = softmax_ref(np.take_along_axis(logits, e, -1))
    assert not np.allclose(w, after)
    np.testing.assert_allclose(router_ref(logits, 3, norm_topk_prob=True)[0], after, rtol=1e-5)


def test_every_expert_per_token_is_the_dense_mixture():
    """k = E with renormalisation: every expert, weighted by the full softmax."""
    h, router, gate_up, down = random_case(1)
    from engine.ops.swiglu import swiglu_ref
    p = softmax_ref(h @ router.T)                                                       # [T, E]
    dense = sum(p[:, e, None] * (swiglu_ref(h @ gate_up[e].T) @ down[e].T) for e in range(router.shape[0]))
    np.testing.assert_allclose(moe_ref(h, router, gate_up, down, 7, True), dense, rtol=1e-5, atol=1e-6)


def test_experts_nobody_chose_are_never_read():
    h, router, gate_up, down = random_case(2, T=2)         # 2 tokens x 2 experts: at most 4 of 7 chosen
    w, e = router_ref(h @ router.T, 2, True)
    unused = sorted(set(range(7)) - set(e.ravel().tolist()))
    gate_up[unused], down[unused] = np.nan, np.nan
    assert np.isfinite(experts_ref(h, w, e, gate_up, down)).all()


@pytest.mark.parametrize("rows,experts", [(1, 128), (8, 128), (64, 128), (37, 5), (3000, 7), (16, 1)])
def test_tile_bound_covers_every_routing(rows, experts):
    """No assignment of `rows` grouped rows to `experts` experts makes more tiles than tile_bound:
    the worst cases put a partial tile on as many experts as possible."""
    from engine.ops.moe import MOE_TILE_M
    rng = np.random.default_rng(rows)
    worst = 0
    for spread in (1, min(rows, experts), experts):
        for _ in range(20):
            counts = np.bincount(rng.integers(0, spread, rows), minlength=experts)
            worst = max(worst, int(np.sum(-(-counts // MOE_TILE_M))))
    singles = min(rows, experts)                       # one row each on as many experts as there are rows
    worst = max(worst, singles + -(-(rows - singles) // MOE_TILE_M))
    assert worst <= tile_bound(rows, experts) <= rows


@needs_transformers
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("k", [1, 3, 7])
def test_router_and_block_match_transformers(norm, k):
    import torch
    import transformers
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    h, router, gate_up, down = random_case(3 + k, T=23, E=7, H=12, I=10)
    config = transformers.Qwen3MoeConfig(hidden_size=12, num_experts=7, num_experts_per_tok=k,
                                         moe_intermediate_size=10, norm_topk_prob=norm)
    config._experts_implementation = "eager"
    block = Qwen3MoeSparseMoeBlock(config)
    with torch.no_grad():
        block.gate.weight.copy_(torch.from_numpy(router))
        block.experts.gate_up_proj.copy_(torch.from_numpy(gate_up))
        block.experts.down_proj.copy_(torch.from_numpy(down))
        _, weights, experts = block.gate(torch.from_numpy(h))
        out = block(torch.from_numpy(h)[None])[0].numpy()
    w, e = router_ref(h @ router.T, k, norm)
    np.testing.assert_array_equal(e, experts.numpy())
    np.testing.assert_allclose(w, weights.numpy(), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(moe_ref(h, router, gate_up, down, k, norm), out, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------- the stage inside the model

@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    return engine.load_model(write_random_model(tmp_path_factory.mktemp("moe"), "tiny-qwen3-moe-mqa-untied"),
                             backend="numpy")


IDS = list(range(3, 40))


def test_the_engine_router_as_a_stage_reproduces_the_model(moe_model):
    calls = []

    def counted(logits, k, norm):
        calls.append(logits.shape)
        return router_ref(logits, k, norm)
    want = moe_model.logits(IDS)
    with engine.use_stage("moe_router", counted):
        got = moe_model.logits(IDS)
    np.testing.assert_array_equal(got, want)
    assert calls == [(len(IDS), 5)] * moe_model.config.num_sparse_layers


def test_a_wrong_router_changes_the_model(moe_model):
    def softmax_after_top_k(logits, k, norm):
        e = np.argsort(-logits, axis=-1, kind="stable")[:, :k]
        return softmax_ref(np.take_along_axis(logits, e, -1)), e
    want = moe_model.logits(IDS)
    with engine.use_stage("moe_router", softmax_after_top_k):     # this preset does not renormalise
        got = moe_model.logits(IDS)
    assert np.abs(got - want).max() > 1e-3 * np.abs(want).max()


@pytest.mark.parametrize("bad,match", [
    (lambda logits, k, norm: router_ref(logits, k, norm)[0], "pair"),
    (lambda logits, k, norm: (np.ones((len(logits), k + 1)), np.zeros((len(logits), k + 1), int)), "shapes"),
    (lambda logits, k, norm: (np.ones((len(logits), k)), np.full((len(logits), k), 5)), r"\[0, 5\)"),
    (lambda logits, k, norm: (np.ones((len(logits), k)), np.full((len(logits), k), 0.5)), "integers"),
])
def test_a_router_that_answers_the_wrong_thing_is_told(moe_model, bad, match):
    with pytest.raises(PluginError, match=match), engine.use_stage("moe_router", bad):
        moe_model.logits(IDS)


def test_a_cuda_router_on_the_numpy_backend_says_so(moe_model):
    from engine import plugins
    plugins.OVERRIDES["moe_router"] = plugins.Override("moe_router", source="...", kernel_name="moe_route")
    try:
        with pytest.raises(PluginError, match="cupy backend"):
            moe_model.logits(IDS)
    finally:
        del plugins.OVERRIDES["moe_router"]
