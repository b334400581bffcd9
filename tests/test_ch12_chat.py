"""`python -m engine.chat` end to end: the one-shot answer, the interactive commands, the errors."""
import io
import re
import subprocess
import sys

import pytest


def chat(*args, stdin=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "engine.chat", *args], input=stdin, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.slow
def test_prompt_answers_once(default_model_dir):
    r = chat("--model", str(default_model_dir), "--backend", "numpy", "--prompt",
             "What is the capital of France?", "--max-new-tokens", "16")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "The capital of France is Paris."


@pytest.mark.slow
def test_interactive_commands(default_model_dir):
    script = ("What is the capital of France?\n/stats\n/system Answer in one word.\nWhat color is the sky?\n"
              "/bogus\n/quit\n")
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


@pytest.mark.nogpu
def test_cupy_without_gpu_is_one_line(default_model_dir):
    r = chat("--model", str(default_model_dir), "--backend", "cupy", "--prompt", "hi")
    assert r.returncode == 2 and r.stderr.startswith("error: backend 'cupy' is not usable")
    assert len(r.stderr.strip().splitlines()) == 1


def test_invalid_sampling_flag_is_one_line(default_model_dir):
    r = chat("--model", str(default_model_dir), "--temperature", "-1", "--prompt", "hi")
    assert r.returncode == 2 and "temperature" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
def test_chat_survives_three_times_its_context(default_model_dir):
    """A scripted conversation of more than 3x --max-context tokens, a message too long to ever fit and
    invalid UTF-8 on stdin: every turn gets an answer or a one-line notice, the chat never dies."""
    turns = [f"Tell me one short fact about the number {n}, please, in a few words." for n in range(1, 10)]
    too_long = " ".join(["word"] * 150)
    script = "\n".join(turns[:4] + [too_long] + turns[4:7]).encode() + b"\nbad bytes \xff\xfe here\n" + \
        "\n".join(turns[7:] + ["/quit"]).encode() + b"\n"
    r = subprocess.run([sys.executable, "-m", "engine.chat", "--model", str(default_model_dir), "--backend", "numpy",
                        "--max-context", "96", "--max-new-tokens", "8", "--stats"],
                       input=script, capture_output=True, timeout=900)
    out, err = r.stdout.decode(), r.stderr.decode()
    assert r.returncode == 0, err
    assert "Traceback" not in out + err
    lines = re.findall(r"\(prefill (\d+) tokens \((\d+) reused\).*decode (\d+) tokens", out)
    assert len(lines) == 10                                # 9 scripted turns + the bad-bytes one
    assert "this message does not fit the context" in out
    assert "(context full: dropped the" in err
    assert sum(int(computed) + int(decoded) + 1 for computed, _, decoded in lines) > 3 * 96
    assert max(int(reused) for _, reused, _ in lines) > 30  # later turns reuse the cached conversation


@pytest.mark.slow
def test_a_failing_turn_prints_one_line_and_the_chat_goes_on(default_model_dir, monkeypatch, capsys):
    from engine.chat.cli import interactive
    from engine.chat.local import Chat
    from engine.runtime.sampling_params import SamplingParams
    chat = Chat(default_model_dir, "numpy", SamplingParams(max_new_tokens=8), None, 256)
    real, calls = chat.llm.model.forward, []

    def fails_once(batch, cache=None):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("simulated device error\nsecond line")
        return real(batch, cache)

    monkeypatch.setattr(chat.llm.model, "forward", fails_once)
    monkeypatch.setattr(sys, "stdin", io.StringIO("What is the capital of France?\nWhat is the capital of France?\n"))
    interactive(chat, stats=False)
    out = capsys.readouterr().out
    assert "error: RuntimeError: simulated device error\n" in out and "second line" not in out
    assert "Paris" in out


@pytest.mark.slow
def test_the_next_turn_reuses_the_cache_and_answers_like_a_fresh_chat(default_model_dir):
    from engine.chat.local import Chat
    from engine.runtime.sampling_params import SamplingParams
    params = SamplingParams(max_new_tokens=8)
    chat = Chat(default_model_dir, "numpy", params, "You are brief.", 256)
    sink = io.StringIO()
    chat.answer("What is the capital of France?", out=sink)
    second = chat.answer("And the capital of Italy?", out=sink)
    assert second.reused_tokens > 20 and second.prompt_tokens - second.reused_tokens < 20
    fresh = Chat(default_model_dir, "numpy", params, "You are brief.", 256)
    fresh.conversation.messages = list(chat.messages[:2])
    fresh_out = io.StringIO()
    fresh.answer("And the capital of Italy?", out=fresh_out)
    assert fresh.messages[-1] == chat.messages[-1]


def test_prefill_progress_line_on_a_terminal():
    from engine.chat.conversation import Prefilling

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    term, pipe = Terminal(), io.StringIO()
    for out in (term, pipe):
        progress = Prefilling(out, 3000, tokens_per_second=500.0)
        progress.tick()                       # under a second: nothing yet
        progress.t0 -= 3.0
        progress.tick()
        progress.clear()
    assert "(reading 3000 prompt tokens: 3 s, ~50%)" in term.getvalue() and term.getvalue().endswith("\r")
    assert pipe.getvalue() == ""              # not a terminal: no carriage-return noise in logs
