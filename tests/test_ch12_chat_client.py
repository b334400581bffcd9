"""`python -m engine.chat --server URL` against a stub OpenAI-compatible server (standard library only):
the streamed reply, the history sent with each turn, errors as one line, a context error that drops
the oldest turn. (tests/test_ch12_serve.py runs the chat against the engine's own server.)"""
import io
import json
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from engine.chat.remote import RemoteChat, ServerError
from engine.runtime.sampling_params import SamplingParams

PIECES = ["Hel", "lo, ", "wor", "ld ", "\u00e9t\u00e9", "!"]


class StubOpenAI(BaseHTTPRequestHandler):
    bodies: list[dict] = []

    def log_message(self, *args):       # keep the test output quiet
        pass

    def _json(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": "stub-model", "object": "model"}]})
        else:
            self._json(404, {"error": {"message": "not found", "type": "invalid_request_error"}})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.bodies.append(body)
        if self.path != "/v1/chat/completions" or body.get("model") != "stub-model":
            return self._json(404, {"error": {"message": f"model {body.get('model')!r} not found"}})
        if sum(len(m["content"]) for m in body["messages"]) > 200:
            return self._json(400, {"error": {"message": "the prompt does not fit the context of 64 tokens",
                                              "type": "invalid_request_error", "param": "messages",
                                              "code": "context_length_exceeded"}})
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for i, piece in enumerate(PIECES):
            chunk = {"object": "chat.completion.chunk", "model": "stub-model",
                     "choices": [{"index": 0, "delta": {"content": piece},
                                  "finish_reason": "stop" if i == len(PIECES) - 1 else None}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()
        self.wfile.write(b"data: [DONE]\n\n")


@pytest.fixture
def server():
    StubOpenAI.bodies = []
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), StubOpenAI)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_streamed_turns_carry_the_history(server):
    chat = RemoteChat(server + "/v1", SamplingParams(max_new_tokens=20, seed=3), "Be kind.")
    out = io.StringIO()
    turn = chat.answer("hi", out=out)
    assert out.getvalue() == "".join(PIECES) + "\n" and turn.finish_reason == "stop"
    chat.answer("again", out=io.StringIO())
    first, second = StubOpenAI.bodies
    assert first["stream"] is True and first["max_tokens"] == 20 and first["seed"] == 3
    assert first["messages"] == [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "hi"}]
    assert second["messages"][1:] == [{"role": "user", "content": "hi"},
                                      {"role": "assistant", "content": "".join(PIECES)},
                                      {"role": "user", "content": "again"}]
    assert "first token after" in turn.line()


def test_a_context_error_drops_the_oldest_turn(server):
    chat = RemoteChat(server, SamplingParams(), None)
    for text in ("a" * 60, "b" * 60, "c" * 60):
        chat.answer(text, out=io.StringIO(), notices=io.StringIO())
    notices = io.StringIO()
    chat.answer("d" * 60, out=io.StringIO(), notices=notices)
    assert "dropped the oldest turn" in notices.getvalue()
    assert [m["content"][0] for m in chat.messages if m["role"] == "user"][-1] == "d"
    with pytest.raises(ServerError, match="does not fit"):
        chat.answer("e" * 300, out=io.StringIO(), notices=io.StringIO())


def test_unknown_model_and_bad_urls_are_typed_errors(server):
    with pytest.raises(ServerError, match="not found"):
        RemoteChat(server, SamplingParams(), None, model="nope").answer("hi", out=io.StringIO())
    with pytest.raises(ServerError, match="http"):
        RemoteChat("ftp://example.com", SamplingParams(), None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_cli_one_shot_and_unreachable_server(server):
    r = subprocess.run([sys.executable, "-m", "engine.chat", "--server", server, "--prompt", "hi"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "".join(PIECES)
    r = subprocess.run([sys.executable, "-m", "engine.chat", "--server", f"http://127.0.0.1:{free_port()}",
                        "--prompt", "hi"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.startswith("error: cannot reach")
    assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_remote_chat_against_the_engine_server(tiny_chat_dir):
    """The real thing: engine.serve.server on loopback; each turn's text equals LLM.generate on the rendered
    conversation, and a conversation longer than the server's context keeps going."""
    pytest.importorskip("uvicorn")
    from helpers.serve import MODEL_NAME

    from engine.runtime.llm import LLM
    from engine.serve.server import ServerThread
    llm = LLM(tiny_chat_dir, backend="numpy", max_context=160, max_seqs=4)
    params = SamplingParams(max_new_tokens=12)
    with ServerThread(llm, MODEL_NAME) as server:
        chat = RemoteChat(server.url, params, "You are terse.")
        notices = io.StringIO()
        for turn in range(8):
            text = f"Question number {turn}: what do pages hold?"
            sent = chat.conversation.render(text, chat.messages)
            out = io.StringIO()
            chat.answer(text, out=out, notices=notices)
            if "dropped" not in notices.getvalue():   # same messages as sent: the reply must match
                prompt = llm.tokenizer.apply_chat_template(sent, add_generation_prompt=True)
                want = llm.generate([llm.tokenizer.encode(prompt)], params)[0].text
                assert out.getvalue() == want + "\n"
        assert "dropped the oldest turn" in notices.getvalue()
