"""The server bounds each request's work before doing it: body size, JSON that Python's parser chokes
on, prompts past the context (text or token ids), `max_tokens` over the server's limit, and /metrics
never waits for the engine. Each refusal is OpenAI's JSON error with a 400 or 413, and the server
serves the next request as before."""
from __future__ import annotations

import json
import socket
import threading

import httpx
import pytest
from helpers.serve import MODEL_NAME

pytest.importorskip("starlette")

from engine.runtime.llm import LLM  # noqa: E402
from engine.serve.server import OpenAIServer, ServerThread  # noqa: E402

OPTIONS = {"kv_cache_mib": 0.5, "max_context": 256, "max_seqs": 4}


@pytest.fixture(scope="module")
def llm(tiny_chat_dir):
    return LLM(tiny_chat_dir, backend="numpy", **OPTIONS)


@pytest.fixture(scope="module")
def server(llm):
    with ServerThread(llm, MODEL_NAME, max_body_bytes=64 * 1024, max_tokens=64) as running:
        yield running


def post(server, path: str, content: bytes, **headers) -> httpx.Response:
    return httpx.post(server.url + path, content=content, timeout=60,
                      headers={"content-type": "application/json", **headers})


def error_of(response: httpx.Response) -> dict:
    return response.json()["error"]


def still_serves(server) -> None:
    ok = httpx.post(server.url + "/v1/completions", timeout=60,
                    json={"model": MODEL_NAME, "prompt": "hello", "max_tokens": 2, "temperature": 0})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_a_declared_body_over_the_limit_is_refused_unread(server):
    """A client announcing 100 MB gets its 413 without sending them (a raw socket: httpx keeps its
    Content-Length honest)."""
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100000000\r\n\r\n{")
        reply = conn.recv(65536).decode("latin-1")
    assert reply.startswith("HTTP/1.1 413") and "limit of 65,536 bytes" in reply
    still_serves(server)


def test_a_streamed_body_over_the_limit_is_cut_at_the_limit(server):
    def chunks():                       # no content-length: the server counts what arrives
        yield b'{"model": "' + MODEL_NAME.encode() + b'", "prompt": "'
        for _ in range(200):
            yield b"x" * 1024
        yield b'"}'
    r = httpx.post(server.url + "/v1/completions", content=chunks(), timeout=60,
                   headers={"content-type": "application/json"})
    assert r.status_code == 413
    still_serves(server)


@pytest.mark.parametrize("body, why", [
    (b"[" * 20_000 + b"]" * 20_000, "nested too deeply"),
    (b'{"model": "m", "max_tokens": ' + b"9" * 5000 + b"}", "digits"),
    (b"\xff\xfe not utf-8", "not valid JSON"),
    (b'{"model": ', "not valid JSON"),
])
def test_json_that_breaks_the_parser_is_a_400(server, body, why):
    r = post(server, "/v1/completions", body)
    assert r.status_code == 400 and why in error_of(r)["message"]
    still_serves(server)


def test_a_lone_surrogate_in_a_prompt_is_a_400(server):
    r = post(server, "/v1/completions",
             b'{"model": "' + MODEL_NAME.encode() + b'", "prompt": "a\\ud800b", "max_tokens": 2}')
    assert r.status_code == 400 and error_of(r)["param"] == "prompt"
    still_serves(server)


def test_max_tokens_over_the_servers_limit_is_a_400(server):
    for max_tokens in (65, 10**30):
        r = httpx.post(server.url + "/v1/completions", timeout=60,
                       json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": max_tokens})
        assert r.status_code == 400 and error_of(r)["param"] == "max_tokens", r.text
        assert "at most 64" in error_of(r)["message"]
    still_serves(server)


def test_prompts_past_the_context_are_refused_before_the_engine(server, llm, monkeypatch):
    submitted = []
    monkeypatch.setattr(llm, "submit", lambda *a, **k: submitted.append(a) or pytest.fail("reached the engine"))
    ids = httpx.post(server.url + "/v1/completions", timeout=60,
                     json={"model": MODEL_NAME, "prompt": [5] * 256, "max_tokens": 2})
    assert ids.status_code == 400 and "does not fit the context" in error_of(ids)["message"]
    text = httpx.post(server.url + "/v1/completions", timeout=60,
                      json={"model": MODEL_NAME, "prompt": "word " * 2000, "max_tokens": 2})
    assert text.status_code == 400 and error_of(text)["param"] == "prompt"
    chat = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                      json={"model": MODEL_NAME, "messages": [{"role": "user", "content": "word " * 2000}],
                            "max_tokens": 2})
    assert chat.status_code == 400 and error_of(chat)["param"] == "messages"
    assert submitted == []
    monkeypatch.undo()
    still_serves(server)


def test_metrics_serves_the_last_sample_while_the_engine_is_busy(server, llm, monkeypatch):
    """A step that takes long (a long prefill, kernels compiling) must not hold /metrics."""
    release = threading.Event()
    real = llm.stats

    def slow_stats():
        release.wait(timeout=30)
        return real()
    monkeypatch.setattr(llm, "stats", slow_stats)
    try:
        r = httpx.get(server.url + "/metrics", timeout=10)     # would wait on slow_stats before
        assert r.status_code == 200 and "engine_requests_running" in r.text
    finally:
        release.set()


def test_limits_are_checked():
    class Stub:
        max_context = 16
        tokenizer = None

        def stats(self):
            raise RuntimeError("not needed")
    with pytest.raises(ValueError, match="max_tokens"):
        OpenAIServer(Stub(), "m", max_tokens=0)
    with pytest.raises(ValueError, match="max_body_bytes"):
        OpenAIServer(Stub(), "m", max_body_bytes=-1)


def test_a_request_without_max_tokens_gets_the_default_within_the_limit(server):
    r = httpx.post(server.url + "/v1/completions", timeout=60,
                   json={"model": MODEL_NAME, "prompt": "hello", "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 64   # 256 by default, capped


def test_a_stream_the_engine_fails_ends_with_an_error_event_and_no_done(server, llm, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("simulated device error")
    monkeypatch.setattr(llm.model, "forward", broken)
    body = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 4, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines and "[DONE]" not in lines[-1]
    assert json.loads(lines[-1][len("data: "):])["error"]["type"] == "server_error"
    assert "simulated device error" in lines[-1]
    monkeypatch.undo()
    still_serves(server)
