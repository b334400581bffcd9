"""The command-line tools explain a missing piece in one line instead of a traceback."""
from __future__ import annotations

import importlib.util

import pytest

from engine import env
from engine.bench import kernels as kernel_bench
from engine.bench import run as bench


def test_bench_hf_without_torch_says_what_to_install(monkeypatch, capsys):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("torch", "transformers") else real_find_spec(name, *a))
    assert bench.main(["--hf"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and ".[oracle]" in err and "torch" in err


@pytest.mark.nogpu
def test_kernel_bench_on_a_cpu_machine_says_it_needs_a_gpu(capsys):
    assert kernel_bench.main([]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "needs a CUDA GPU" in err


@pytest.mark.slow
@pytest.mark.nogpu
def test_env_on_a_cpu_machine_does_not_fail_cupy(capsys):
    assert env.main([]) == 0
    out = capsys.readouterr().out
    assert "[FAIL] CuPy" not in out and "[FAIL] CUDA" not in out
    assert "enable the GPU" in out or "[OK] CuPy" in out
    assert env.main(["--backend", "cupy"]) == 1   # asked for explicitly: then it is a failure
    assert "[FAIL]" in capsys.readouterr().out
