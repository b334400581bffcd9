"""The linear-attention appendix's checkers accept the right answers, name each likely mistake, and the
learner's chunked function runs inside the Qwen3.5 model as the "gated_delta" stage."""
import numpy as np
import pytest

import engine
from engine.exercises.appendix_linear import (
    CHUNKED_HINTS,
    STEP_HINTS,
    _chunked_cases,
    _step_mistake,
    as_stage,
    check_chunked,
    check_delta_step,
    chunked_variant,
    reference_recurrence,
    reference_step,
)
from engine.model.forward_pass import load_model
from engine.model.random_model import write_random_model
from engine.plugins import PluginError


def right_chunked(q, k, v, g, beta, S0, chunk_size):
    return chunked_variant(q, k, v, g, beta, S0, chunk_size)


def test_the_right_answers_pass(capsys):
    assert check_delta_step(reference_step)
    assert check_chunked(right_chunked)
    assert check_chunked(right_chunked, step=reference_step)
    assert "your chunked form == your recurrent step" in capsys.readouterr().out


def test_the_chunked_variant_is_the_recurrence():
    for q, k, v, g, beta, S0, chunk in _chunked_cases():
        o, S = chunked_variant(q, k, v, g, beta, S0, chunk)
        want_o, want_S = reference_recurrence(q, k, v, g, beta, S0)
        np.testing.assert_allclose(o, want_o, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(S, want_S, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("hint,kind", STEP_HINTS, ids=[k for _, k in STEP_HINTS])
def test_each_step_mistake_is_named(capsys, hint, kind):
    assert not check_delta_step(_step_mistake(kind))
    assert hint in capsys.readouterr().out


@pytest.mark.parametrize("hint,kind", CHUNKED_HINTS, ids=[k for _, k in CHUNKED_HINTS])
def test_each_chunked_mistake_is_named(capsys, hint, kind):
    assert not check_chunked(lambda *a: chunked_variant(*a, mistake=kind))
    assert hint in capsys.readouterr().out


def test_unattempted_and_malformed_answers(capsys):
    def todo(*args):
        raise NotImplementedError
    assert not check_delta_step(todo) and not check_chunked(todo)
    assert "not attempted" in capsys.readouterr().out
    assert not check_delta_step(lambda S, q, k, v, g, beta: S.T @ q)         # not a pair
    assert not check_chunked(lambda *a: chunked_variant(*a)[0])


def test_a_chunked_form_that_disagrees_with_your_step_is_caught(capsys):
    wrong_step = _step_mistake("no beta")
    assert not check_chunked(right_chunked, step=wrong_step)
    assert "your chunked form == your recurrent step" in capsys.readouterr().out


def test_your_chunked_form_runs_in_the_model(tmp_path):
    from engine.model.random_model import PRESETS
    model = load_model(write_random_model(tmp_path, PRESETS["tiny-qwen3.5"]), backend="numpy")
    ids = list(range(3, 80))
    want = model.logits(ids)
    calls = []

    def counted(*args):
        calls.append(args[0].shape[0])
        return right_chunked(*args)
    with engine.use_stage("gated_delta", as_stage(counted, chunk_size=16)):
        got = model.logits(ids)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    linear_layers = len(model.config.layer_types) - len(model.config.full_attention_layers)
    assert len(calls) == linear_layers * model.config.linear_num_value_heads
    with engine.use_stage("gated_delta", lambda *a: a[2]), pytest.raises(PluginError, match="pair"):
        model.logits(ids)
    with engine.use_stage("gated_delta", lambda q, k, v, g, beta, s: (v[:, :1], s)), \
            pytest.raises(PluginError, match="shape"):
        model.logits(ids)
