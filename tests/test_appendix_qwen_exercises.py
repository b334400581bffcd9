"""The appendix's exercise checkers accept the right answers and name the likely mistakes."""
import numpy as np

from engine.exercises.appendix_qwen import _HINTS, check_bias_parameters, check_qk_norm
from engine.model.random_model import PRESETS
from engine.ops.rmsnorm import rmsnorm_ref


def test_qk_norm_checker(capsys):
    assert check_qk_norm(rmsnorm_ref)
    for hint, mistake in _HINTS:
        assert not check_qk_norm(mistake)
        assert hint in capsys.readouterr().out


def test_qk_norm_checker_reports_unattempted(capsys):
    def todo(x, w, eps):
        raise NotImplementedError
    assert not check_qk_norm(todo)
    assert "not attempted" in capsys.readouterr().out


def test_bias_parameter_checker(capsys):
    qwen25 = PRESETS["qwen2.5-0.5b"]
    assert check_bias_parameters(qwen25, 24 * (14 + 2 * 2) * 64)
    assert not check_bias_parameters(qwen25, (14 + 2 * 2) * 64)
    assert "one layer" in capsys.readouterr().out
    assert not check_bias_parameters(qwen25, 24 * (896 + 896))
    assert "num_key_value_heads" in capsys.readouterr().out
    assert not check_bias_parameters(qwen25, None) and not check_bias_parameters(qwen25, np.int64(7))
