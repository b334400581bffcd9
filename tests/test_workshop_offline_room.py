"""The offline room (README, notes/workshop.md): after `python -m engine.prefetch`, nothing touches
the network. The test blocks every socket and every subprocess (pip) and runs the prefetch command,
the model and a generation from the cache."""
import socket
import subprocess

import pytest

import engine
from engine import prefetch
from engine.model.default_model import is_converted


class NetworkUsed(OSError):
    """What an offline machine answers (an OSError, like a refused connection or a missing pip)."""


@pytest.fixture
def no_network(monkeypatch):
    """Every socket connection and subprocess fails; returns the list of attempts."""
    attempts = []

    def refuse(*args, **kwargs):
        attempts.append(args[:2])
        raise NetworkUsed(f"network or subprocess used offline: {args[:2]}")
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(subprocess, "run", refuse)
    monkeypatch.setattr(subprocess, "Popen", refuse)
    return attempts


@pytest.fixture
def cached_model(default_model_dir, monkeypatch):
    if not is_converted(default_model_dir):
        pytest.skip("the default model comes from ENGINE_MODEL_DIR, not from the cache")
    monkeypatch.delenv("ENGINE_MODEL_DIR", raising=False)
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(default_model_dir.parent))
    return default_model_dir


def test_blocker_really_blocks(no_network):
    with pytest.raises(NetworkUsed):
        socket.create_connection(("127.0.0.1", 9))
    with pytest.raises(NetworkUsed):
        subprocess.run(["pip", "--version"])


@pytest.mark.slow
def test_prefetch_then_offline(cached_model, no_network, capsys):
    assert prefetch.main(["--backend", "numpy"]) == 0
    assert no_network == []
    out = capsys.readouterr().out
    assert f"[OK] default model     {cached_model}" in out
    assert "Paris" in out                          # the warm-up answered from the cached model
    assert engine.ensure_default_model() == cached_model


def test_model_dir_override_needs_no_cache(cached_model, no_network, monkeypatch, tmp_path):
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path / "empty"))     # nothing cached there
    monkeypatch.setenv("ENGINE_MODEL_DIR", str(cached_model))
    assert engine.ensure_default_model() == cached_model
    assert not (tmp_path / "empty").exists() and no_network == []


def test_prefetch_reports_offline_failure(no_network, monkeypatch, tmp_path, capsys):
    """Without the cache and without network the command fails in one line that says what to do."""
    monkeypatch.delenv("ENGINE_MODEL_DIR", raising=False)
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path))
    assert prefetch.main(["--backend", "numpy"]) == 1
    assert no_network, "it should have tried to download"
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("prefetch: ")]
    assert len(errors) == 1 and "ENGINE_MODEL_DIR" in errors[0]
