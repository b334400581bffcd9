"""The mixture-of-experts appendix's router checker: it passes the engine's router (in any order of a
token's k pairs), names each likely mistake, and runs the learner's router inside two models."""
import numpy as np
import pytest

from engine.exercises.appendix_moe import _HINTS, check_router, check_router_in_model
from engine.ops.moe import router_ref


def test_the_engine_router_passes(capsys):
    assert check_router(router_ref)
    assert capsys.readouterr().out.startswith("[OK] router: all 7 cases pass")


def test_any_order_of_a_tokens_pairs_passes(capsys):
    def reversed_pairs(logits, k, norm):
        w, e = router_ref(logits, k, norm)
        return w[:, ::-1], e[:, ::-1]
    assert check_router(reversed_pairs)


@pytest.mark.parametrize("hint,mistake", _HINTS, ids=[h.split(":")[0][:40] for h, _ in _HINTS])
def test_each_mistake_is_named(capsys, hint, mistake):
    assert not check_router(mistake)
    out = capsys.readouterr().out
    assert out.startswith("[x] router: ") and hint in out, out


@pytest.mark.parametrize("answer,says", [
    (lambda logits, k, norm: router_ref(logits, k, norm)[0], "returns a pair"),
    (lambda logits, k, norm: (np.ones((len(logits), k)), np.ones((len(logits), k)) * 0.5), "integers"),
    (lambda logits, k, norm: (np.ones((len(logits), k - 1 or 2)), np.zeros((len(logits), k - 1 or 2), int)), "shapes"),
])
def test_malformed_answers_are_explained(capsys, answer, says):
    assert not check_router(answer)
    assert says in capsys.readouterr().out


def test_unattempted_and_crashing_routers(capsys):
    def todo(logits, k, norm):
        raise NotImplementedError
    assert not check_router(todo)
    assert "not attempted" in capsys.readouterr().out

    def crashes(logits, k, norm):
        return np.argpartition(logits, k)[k]
    assert not check_router(crashes)
    assert capsys.readouterr().out.startswith("[x] router: ")


def test_in_the_model(capsys):
    assert check_router_in_model(router_ref)
    assert capsys.readouterr().out.startswith("[OK] your router inside")
    softmax_after_top_k = _HINTS[0][1]                         # right for the model that renormalises only
    assert not check_router_in_model(softmax_after_top_k)
    out = capsys.readouterr().out
    assert "[x] your router inside tiny-qwen3-moe-mqa-untied" in out and "norm_topk_prob=False" in out

    def todo(logits, k, norm):
        raise NotImplementedError
    assert not check_router_in_model(todo)
    assert "not attempted" in capsys.readouterr().out


def test_the_dense_default_model_refuses_to_check_a_router():
    """SmolLM2 has no experts: the whole-model checker would say 'match' for a router it never ran."""
    from engine.exercises.model_check import check_in_model
    with pytest.raises(ValueError, match="check_router_in_model"):
        check_in_model({"moe_router": router_ref})
