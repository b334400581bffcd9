"""`python -m engine.chat` end to end: the one-shot answer, the interactive commands, the errors."""
import subprocess
import sys

import pytest


def chat(*args, stdin=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "engine.chat", *args], input=stdin, capture_output=True,
                          text=True, timeout=timeout)


def test_prompt_answers_once(default_model_dir):
    r = chat("--model", str(default_model_dir), "--backend", "numpy", "--prompt",
             "What is the capital of France?", "--max-new-tokens", "16")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "The capital of France is Paris."


def test_interactive_commands(default_model_dir):
    script = "What is the capital of France?\n/stats\n/system Answer in one word.\nWhat color is the sky?\n/bogus\n/quit\n"
    r = chat("--model", str(default_model_dir), "--backend", "numpy", "--max-new-tokens", "12", stdin=script)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "Paris" in out and "(stats on)" in out and "tok/s)" in out
    assert "(system prompt set; new conversation)" in out and "commands:" in out


def test_bad_model_dir_is_one_line(tmp_path):
    r = chat("--model", str(tmp_path), "--prompt", "hi")
    assert r.returncode == 2
    assert r.stderr.startswith("error: ") and len(r.stderr.strip().splitlines()) == 1
    assert "Traceback" not in r.stderr


def test_cupy_without_gpu_is_one_line(default_model_dir):
    from engine.backend import cupy_unavailable_reason
    if cupy_unavailable_reason() is None:
        pytest.skip("a GPU is usable here")
    r = chat("--model", str(default_model_dir), "--backend", "cupy", "--prompt", "hi")
    assert r.returncode == 2 and r.stderr.startswith("error: backend 'cupy' is not usable")
    assert len(r.stderr.strip().splitlines()) == 1


def test_invalid_sampling_flag_is_one_line(default_model_dir):
    r = chat("--model", str(default_model_dir), "--temperature", "-1", "--prompt", "hi")
    assert r.returncode == 2 and "temperature" in r.stderr and "Traceback" not in r.stderr
