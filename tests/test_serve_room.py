"""A server a room shares: API keys, a bounded queue with per-client limits (429 + Retry-After), the
client named to the engine's fair seats, slow and vanishing clients, refused requests leaving nothing
behind, and a supervised engine process that is killed and comes back.

CPU, loopback only; each case bounded in time."""
from __future__ import annotations

import asyncio
import gc
import json
import os
import signal
import socket
import threading
import time

import httpx
import pytest
from helpers.serve import MODEL_NAME
from test_ch12_engine_loop import hold_the_loop

pytest.importorskip("starlette")

import engine.serve.server as server_module  # noqa: E402
from engine.runtime.engine_process import RemoteLLM  # noqa: E402
from engine.runtime.llm import LLM  # noqa: E402
from engine.serve.server import OpenAIServer, ServerThread  # noqa: E402

OPTIONS = {"kv_cache_mib": 0.5, "max_context": 256, "max_seqs": 1}
KEY_A, KEY_B, WATCH = "key-aaaaaaaa", "key-bbbbbbbb", "watch-only-key"


@pytest.fixture(scope="module")
def llm(tiny_chat_dir):
    return LLM(tiny_chat_dir, backend="numpy", **OPTIONS)


@pytest.fixture(scope="module")
def server(llm):
    with ServerThread(llm, MODEL_NAME, max_queue=2, max_queue_per_client=1, api_keys=[KEY_A, KEY_B],
                      metrics_keys=[WATCH], body_timeout=1.0) as running:
        yield running


def complete(server, key: str | None, max_tokens: int = 2, **extra) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server.url + "/v1/completions", headers=headers, timeout=60,
                      json={"model": MODEL_NAME, "prompt": "hello", "max_tokens": max_tokens,
                            "temperature": 0, **extra})


def wait_until(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


# ---- keys ----------------------------------------------------------------------------------------
def test_v1_needs_a_key_and_names_the_problem(server):
    for key in (None, "wrong-key-123"):
        r = complete(server, key)
        assert r.status_code == 401
        assert r.json()["error"]["type"] == "authentication_error" and "API key" in r.json()["error"]["message"]
    assert httpx.get(server.url + "/v1/models", timeout=10).status_code == 401
    assert complete(server, KEY_A).status_code == 200
    ok = httpx.get(server.url + "/v1/models", headers={"authorization": f"Bearer {KEY_B}"}, timeout=10)
    assert ok.status_code == 200 and ok.json()["data"][0]["id"] == MODEL_NAME


def test_the_metrics_key_watches_but_cannot_generate(server):
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200      # open: load balancers
    assert httpx.get(server.url + "/metrics", timeout=10).status_code == 401
    assert httpx.get(server.url + "/", timeout=10).status_code == 401
    watch = {"authorization": f"Bearer {WATCH}"}
    metrics = httpx.get(server.url + "/metrics", headers=watch, timeout=10)
    assert metrics.status_code == 200 and "engine_up 1" in metrics.text
    assert httpx.get(server.url + f"/?key={WATCH}", timeout=10).status_code == 200
    assert httpx.get(server.url + f"/metrics?key={KEY_A}", timeout=10).status_code == 200
    assert complete(server, WATCH).status_code == 401


def test_keys_that_are_too_short_are_refused_at_start(llm):
    with pytest.raises(ValueError, match="at least 8 characters"):
        OpenAIServer(llm, MODEL_NAME, api_keys=["short"])


# ---- the bounded queue ---------------------------------------------------------------------------
def test_a_full_queue_and_a_full_client_share_get_429_with_retry_after(server, llm, monkeypatch):
    """One seat, a queue of 2, one queued request per client: A holds its seat + 1 queued, B 1 more,
    then both limits answer 429 at once; everything held finishes once the engine moves again."""
    admission = server.openai.admission
    gate = hold_the_loop(llm, monkeypatch, after_calls=0)
    results: dict[str, httpx.Response] = {}

    def send(name, key):
        results[name] = complete(server, key, max_tokens=3)
    threads = [threading.Thread(target=send, args=(f"a{i}", KEY_A)) for i in range(2)]
    for t in threads:
        t.start()
    wait_until(lambda: admission.total == 2)
    started = time.monotonic()
    third = complete(server, KEY_A)
    assert third.status_code == 429 and time.monotonic() - started < 5
    assert third.json()["error"]["type"] == "rate_limit_error" and "this client already has 2" in \
        third.json()["error"]["message"]
    assert 1 <= int(third.headers["retry-after"]) <= 60
    threads.append(threading.Thread(target=send, args=("b0", KEY_B)))
    threads[-1].start()
    wait_until(lambda: admission.total == 3)
    full = complete(server, KEY_B)
    assert full.status_code == 429 and "the server is full" in full.json()["error"]["message"]
    gate.set()
    for t in threads:
        t.join(timeout=60)
    assert sorted(results) == ["a0", "a1", "b0"] and all(r.status_code == 200 for r in results.values())
    wait_until(lambda: admission.total == 0)
    assert admission.refused >= 2
    assert complete(server, KEY_A).status_code == 200


def test_each_request_names_its_client_to_the_engine(server, llm, monkeypatch):
    seen = []
    submit = llm.submit

    def spy(prompt, params=None, **kwargs):
        seen.append(kwargs.get("client"))
        return submit(prompt, params, **kwargs)
    monkeypatch.setattr(llm, "submit", spy)
    assert complete(server, KEY_B).status_code == 200
    assert complete(server, KEY_A).status_code == 200
    assert seen == ["key#1", "key#0"]            # never the key itself


# ---- slow, vanishing and hostile clients ---------------------------------------------------------
def raw(server, data: bytes, read: bool = True) -> str:
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as conn:
        conn.sendall(data)
        return conn.recv(65536).decode("latin-1") if read else ""


def test_a_body_that_never_arrives_times_out_and_frees_its_place(server):
    started = time.monotonic()
    reply = raw(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                        b"Authorization: Bearer " + KEY_A.encode() + b"\r\nContent-Length: 100\r\n\r\n{")
    assert reply.startswith("HTTP/1.1 408") and time.monotonic() - started < 10
    wait_until(lambda: server.openai.admission.total == 0)


def test_a_web_page_cannot_post_a_form_to_the_server(server):
    body = json.dumps({"model": MODEL_NAME, "prompt": "hi", "max_tokens": 1})
    for kind in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        r = httpx.post(server.url + "/v1/completions", content=body, timeout=10,
                       headers={"content-type": kind, "authorization": f"Bearer {KEY_A}"})
        assert r.status_code == 415 and "application/json" in r.json()["error"]["message"]


def test_a_storm_of_clients_leaving_mid_stream_leaves_no_request_behind(server, llm):
    body = json.dumps({"model": MODEL_NAME, "prompt": "hello", "max_tokens": 40, "stream": True,
                       "ignore_eos": True}).encode()
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Authorization: Bearer " + KEY_A.encode() + b"\r\nContent-Length: " +
               str(len(body)).encode() + b"\r\n\r\n" + body)
    for _ in range(12):        # (each one in turn: the client's share of the queue is 2)
        raw(server, request, read=False)
    wait_until(lambda: server.openai.admission.total == 0)
    wait_until(lambda: llm.stats()["running"] == llm.stats()["waiting"] == 0)
    assert complete(server, KEY_A).status_code == 200


def test_refused_requests_leave_nothing_behind_even_without_the_cycle_collector(tiny_chat_dir):
    """Prompts over the context, as ids and as text: once answered, no list of their ids survives,
    even with gc disabled (a refused request must not live on in a reference cycle)."""
    llm = LLM(tiny_chat_dir, backend="numpy", **OPTIONS)
    ids, text = list(range(1, 200_001)), "word " * 200_000
    with ServerThread(llm, MODEL_NAME) as srv:
        gc.collect()
        def large_lists():     # (the tokenizer's own tables are long lists too: only new ones count)
            return {id(o): o for o in gc.get_objects() if isinstance(o, list) and len(o) >= 100_000}
        before = large_lists()
        gc.disable()
        try:
            for prompt in (ids, text) * 4:
                r = httpx.post(srv.url + "/v1/completions", timeout=60,
                               json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1})
                assert r.status_code == 400
            time.sleep(0.2)
            large = [o for key, o in large_lists().items() if key not in before and o is not ids]
        finally:
            gc.enable()
    assert large == []


# ---- a supervised engine process -----------------------------------------------------------------
def process_state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(line.split()[1] for line in f if line.startswith("State:"))
    except FileNotFoundError:
        return None


@pytest.mark.slow
def test_an_engine_killed_mid_stream_is_reported_reaped_and_restarted(tiny_chat_dir, monkeypatch):
    monkeypatch.setattr(server_module, "SUPERVISE_EVERY_S", 0.05)
    remote = RemoteLLM(tiny_chat_dir, "numpy", **OPTIONS)
    try:
        with ServerThread(remote, MODEL_NAME) as srv:
            pid = remote._process.pid
            body = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 200, "stream": True,
                    "ignore_eos": True, "temperature": 0}
            lines = []
            with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as stream:
                for line in stream.iter_lines():
                    if line.startswith("data: "):
                        lines.append(line[6:])
                        if len(lines) == 2:
                            os.kill(pid, signal.SIGKILL)
            assert lines[-1] != "[DONE]"
            error = json.loads(lines[-1])["error"]
            assert error["type"] == "server_error" and "engine" in error["message"]
            wait_until(lambda: httpx.get(srv.url + "/health", timeout=10).status_code == 503, timeout=10)
            down = httpx.post(srv.url + "/v1/completions", timeout=10,
                              json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 1})
            assert down.status_code in (200, 503)          # 200 if the restart was that quick
            if down.status_code == 503:
                assert down.json()["error"]["code"] == "engine_unavailable" and "retry-after" in down.headers
            wait_until(lambda: process_state(pid) in (None,), timeout=10)      # reaped: no zombie
            wait_until(lambda: httpx.get(srv.url + "/health", timeout=10).status_code == 200, timeout=60)
            assert remote.restarts == 1 and remote._process.pid != pid
            ok = httpx.post(srv.url + "/v1/completions", timeout=60,
                            json={"model": MODEL_NAME, "prompt": "hello", "max_tokens": 3, "temperature": 0})
            assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
            metrics = httpx.get(srv.url + "/metrics", timeout=10).text
            assert "engine_restarts_total 1" in metrics and "engine_up 1" in metrics
    finally:
        remote.close()
    assert process_state(remote._process.pid) is None


class DeadEngine:
    """An engine process that dies at once, every time it is started."""
    max_context, max_seqs, tokenizer, alive, exit_reason, restarts = 256, 1, None, False, "exit code 1", 0

    def __init__(self):
        self.starts = 0

    def stats(self):
        raise RuntimeError("down")

    def restart(self):
        self.starts += 1


def test_the_supervisor_gives_up_after_repeated_deaths(monkeypatch):
    monkeypatch.setattr(server_module, "SUPERVISE_EVERY_S", 0.001)
    monkeypatch.setattr(server_module.asyncio, "sleep", fast_sleep)
    monkeypatch.setattr(server_module, "Monitor", lambda llm, name, state: None)
    engine = DeadEngine()
    api = OpenAIServer(engine, MODEL_NAME)
    asyncio.run(asyncio.wait_for(api._supervise(), timeout=10))
    assert api.engine_state == "failed" and engine.starts == server_module.MAX_RESTARTS


_real_sleep = asyncio.sleep


async def fast_sleep(seconds):
    await _real_sleep(0)


@pytest.mark.slow
def test_the_fair_flood_bench_runs_on_the_cpu(capsys):
    """The bench scenario end to end (a server with keys, a room, a flood over its client limit)."""
    from engine.bench import run as bench
    bench.main(["--preset", "tiny", "--backend", "numpy", "--scenario", "fair-flood", "--requests", "8",
                "--room-clients", "2", "--flood-requests", "120", "--min-len", "8", "--max-len", "24",
                "--max-seqs", "8", "--flood-lead", "0.5"])
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["scenario"] == "fair-flood" and record["room_requests"] == 8
    # the server holds at most max_seqs + a quarter of its 256-request queue for the flooding key at once
    # (more get in over the run as earlier ones finish)
    assert record["flood_accepted"] + record["flood_refused"] == 120
    assert record["flood_accepted"] >= 8 + 64 and record["flood_refused"] > 0
    assert record["room_ttft_p99_ms_alone"] > 0 and record["room_ttft_p99_ms_flooded"] > 0


def test_the_chat_client_talks_to_a_keyed_server(server):
    import io

    from engine.chat.remote import RemoteChat, ServerError
    from engine.runtime.sampling_params import SamplingParams
    with pytest.raises(ServerError, match="API key") as refused:
        RemoteChat(server.url, SamplingParams(max_new_tokens=3), None)
    assert refused.value.status == 401
    chat = RemoteChat(server.url, SamplingParams(max_new_tokens=3, temperature=0.0), None, api_key=KEY_B)
    turn = chat.answer("hi", out=io.StringIO())
    assert turn.finish_reason in ("stop", "length") and len(chat.conversation.messages) == 2


def test_a_request_head_that_never_completes_is_closed(llm, monkeypatch):
    """A slowloris: a connection that sends part of its headers and waits, and one that sends nothing."""
    import engine.serve.connections as connections
    monkeypatch.setattr(connections, "HEAD_TIMEOUT_S", 0.5)
    with ServerThread(llm, MODEL_NAME) as srv:
        host, port = srv.url.removeprefix("http://").split(":")
        for first in (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n", b""):
            with socket.create_connection((host, int(port)), timeout=10) as conn:
                conn.sendall(first)
                started = time.monotonic()
                assert conn.recv(100) == b""          # closed by the server, not by the 10 s timeout
                assert time.monotonic() - started < 5
        # an answer that takes longer than the head timeout is not cut
        gate, answers = hold_the_loop(llm, monkeypatch, after_calls=1), []
        asker = threading.Thread(target=lambda: answers.append(httpx.post(
            srv.url + "/v1/completions", timeout=60,
            json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 5, "ignore_eos": True})))
        asker.start()
        time.sleep(1.5)
        gate.set()
        asker.join(timeout=60)
        assert answers[0].status_code == 200 and answers[0].json()["usage"]["completion_tokens"] == 5
