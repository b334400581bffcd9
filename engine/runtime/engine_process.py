"""The engine in a process of its own, for the HTTP server (chapter 12).

One Python process holds one GIL. In `python -m engine.serve` the engine loop thread shares it with
the asyncio thread that parses requests, detokenizes and writes server-sent events, and with a few
hundred streams that thread is busy all the time: the engine loop waits for the GIL between the
kernels of every step, and the GPU idles. vLLM answers this with an engine-core process; so do we:

    HTTP process (this module's RemoteLLM)              engine process (_engine_main)
    --------------------------------------              -----------------------------
    asyncio: HTTP, JSON, SSE                             LLM: model, KV cache, engine loop thread
    RequestHandles (the same class as in-process)  <--   forwarder thread: after each step, one
      detokenize, stream, cancel                          message with every request's new tokens
    submit / cancel / stats  ------------------------->  command thread: llm.submit, cancel, stats

The pipe carries token ids, never text (a request with stop strings is the exception: its text is
cut at the stop in the engine process, so that text travels too). The HTTP process loads only the
tokenizer, so the GPU is touched by one process. RemoteLLM offers what the server uses of an LLM:
submit() returning a RequestHandle, stats(), tokenizer, close(). A handle's
request_id numbers this process's requests; stats() (the dashboard) shows the engine's own ids.
The child ignores Ctrl-C: the server stops it (close(), or its pipe closing when the server exits).
"""
from __future__ import annotations

import itertools
import multiprocessing
import signal
import threading
from pathlib import Path

from engine.formats.config import load_config
from engine.runtime.request import HandleHub, RequestHandle, RequestOutput, prepare_prompt, warn_sessions_gone
from engine.runtime.sampling_params import SamplingParams
from engine.text.tokenizer import load_tokenizer

START_TIMEOUT_S = 900          # loading a model and compiling its kernels on first use
FORWARD_POLL_S = 0.05          # the forwarder's longest sleep when no step notifies it


class EngineProcessError(RuntimeError):
    """The engine process failed to start, or died."""


# ---- the HTTP side -------------------------------------------------------------------------------
class RemoteLLM:
    """An LLM running in a child process; submit() and stats() as on an LLM.

        llm = RemoteLLM(model_dir, "cupy", max_seqs=256)
        handle = llm.submit(prompt_ids, SamplingParams(max_new_tokens=64))
        async for batch in handle.astream_batches(): ...
    """

    def __init__(self, model_dir, backend: str = "auto", **llm_kwargs):
        model_dir = Path(model_dir)
        # before the child starts: a bad file fails here
        self.vocab_size = load_config(model_dir).vocab_size
        self.tokenizer = load_tokenizer(model_dir) if (model_dir / "tokenizer.json").is_file() else None
        self._start_args = (str(model_dir), backend, llm_kwargs)
        self.hub = HandleHub()                     # what RequestHandles wait on (as in EngineLoop)
        self._handles: dict[int, RequestHandle] = {}
        self._ids = itertools.count()              # numbering goes on across restarts
        self._send_lock = threading.Lock()
        self._stats_cv = threading.Condition()
        self._stats_tickets = itertools.count(1)
        self._stats: dict[int, dict | None] = {}   # ticket -> its answer (None while still awaited)
        self._closed = False                       # close() was called: for good
        self._gone = True                          # no engine process answers (not started, or died)
        self.exit_reason: str | None = None        # how the last engine process ended, once it has
        self.restarts = 0
        self._start()

    def _start(self) -> None:
        """Start an engine process and its receiver thread; returns once the model is loaded."""
        ctx = multiprocessing.get_context("spawn")      # a fresh interpreter: no CUDA state is inherited
        self._conn, child_conn = ctx.Pipe()
        self._process = ctx.Process(target=_engine_main, args=(child_conn, *self._start_args),
                                    name="engine-process", daemon=True)
        self._process.start()
        child_conn.close()
        try:
            info = self._wait_ready()
        except BaseException:
            self._stop_process(timeout=0)
            raise
        self.description, self.max_seqs, self.max_context = info["backend"], info["max_seqs"], info["max_context"]
        with self._send_lock:
            self._gone = False
        self._receiver = threading.Thread(target=self._receive, name="engine-process-receiver", daemon=True)
        self._receiver.start()

    @property
    def alive(self) -> bool:
        """An engine process is up and answering (False once it died, until restart())."""
        return not self._gone and not self._closed

    def restart(self) -> None:
        """Start a new engine process after the last one died (its requests have failed already).
        Blocks while the model loads; EngineProcessError (or the model's ValueError) if it cannot."""
        if self._closed:
            raise RuntimeError("this engine was closed")
        if self.alive:
            return
        self._receiver.join(timeout=10)
        self._stop_process(timeout=0)            # reap it: no zombie
        self._start()
        self.restarts += 1

    def _wait_ready(self) -> dict:
        if not self._conn.poll(START_TIMEOUT_S):
            raise EngineProcessError(f"the engine process did not start within {START_TIMEOUT_S} s")
        try:
            kind, *info = self._conn.recv()
        except EOFError:
            raise EngineProcessError(f"the engine process exited with code {self._process.exitcode} "
                                     "before it was ready") from None
        if kind == "failed":
            error_type, message = info
            raise (ValueError if error_type == "ValueError" else EngineProcessError)(message)
        return info[0]

    def _stop_process(self, timeout: float) -> None:
        self._process.join(timeout=timeout)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(timeout=10)

    def _send(self, message) -> None:
        with self._send_lock:
            if self._closed:
                raise RuntimeError("this engine was closed")
            if self._gone:
                raise EngineProcessError(f"the engine process is not running ({self.exit_reason or 'starting'})")
            try:
                self._conn.send(message)
            except OSError as exc:
                raise EngineProcessError(f"the engine process is gone ({exc})") from None

    def submit(self, prompt, params: SamplingParams | None = None, *, session=None, client=None) -> RequestHandle:
        """Queue a prompt (text or token ids). The engine process checks it: await handle.accepted()
        raises its ValueError (a 400 in the server) when it refuses the request."""
        if session is not None:
            warn_sessions_gone()
        prompt_ids, params = prepare_prompt(prompt, params, self.tokenizer, self.vocab_size)
        handle = RequestHandle(self.hub, next(self._ids), prompt_ids, params, cancel=self.cancel,
                               tokenizer=self.tokenizer, accepted=False, client=client)
        with self.hub.cond:
            self._handles[handle.request_id] = handle
        try:
            self._send(("submit", handle.request_id, prompt_ids, params, client))
        except BaseException:
            with self.hub.cond:
                self._handles.pop(handle.request_id, None)
            raise
        return handle

    def drop_session(self, session) -> None:
        """Does nothing (DeprecationWarning), as LLM.drop_session."""
        warn_sessions_gone()

    def cancel(self, request_id: int) -> None:
        """Stop a request at the engine's next step; a no-op once the engine process is gone."""
        try:
            self._send(("cancel", request_id))
        except (RuntimeError, EngineProcessError):
            pass

    def stats(self, timeout: float = 30.0) -> dict:
        """The engine's stats() snapshot (blocks for at most one step, and the round trip)."""
        ticket = next(self._stats_tickets)
        with self._stats_cv:
            self._stats[ticket] = None
        try:
            self._send(("stats", ticket))
            with self._stats_cv:
                if not self._stats_cv.wait_for(lambda: self._stats[ticket] is not None or self._gone, timeout):
                    raise TimeoutError(f"the engine process did not answer within {timeout} s")
                answer = self._stats[ticket]
                if answer is None:
                    raise EngineProcessError("the engine process is gone")
                return answer
        finally:
            with self._stats_cv:
                del self._stats[ticket]          # an answer arriving after a timeout is dropped

    def close(self) -> None:
        """Stop the engine process; requests still running fail with EngineProcessError."""
        with self._send_lock:
            if not self._closed:
                try:
                    self._conn.send(("close",))
                except OSError:
                    pass
                self._closed = True
        self._stop_process(timeout=30)           # also when the receiver saw the process end first
        self._receiver.join(timeout=10)

    def __enter__(self) -> RemoteLLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- the receiver thread: apply what the engine process sends to the handles --------------
    def _receive(self) -> None:
        try:
            while True:
                kind, *body = self._conn.recv()
                if kind == "stats":
                    ticket, stats = body
                    with self._stats_cv:
                        if ticket in self._stats:        # still awaited
                            self._stats[ticket] = stats
                            self._stats_cv.notify_all()
                    continue
                with self.hub.publish():
                    if kind == "accepted":      # (its events may have come first, even its end)
                        handle = self._handles.get(body[0])
                        if handle is not None:
                            handle.accept()
                    elif kind == "refused":
                        request_id, message = body
                        self._handles.pop(request_id).fail(ValueError(message))
                    elif kind == "events":
                        for request_id, tokens, texts, logprobs, end, output, error in body[0]:
                            handle = self._handles[request_id]
                            handle.deliver(tokens, texts, logprobs)
                            if end is not None:
                                token_ids, text, reason, all_logprobs = output
                                handle.finish(end, RequestOutput(handle.prompt_token_ids, token_ids, text, reason,
                                                                 all_logprobs))
                            if error is not None:
                                handle.fail(EngineProcessError(error))
                            if handle.done:
                                del self._handles[request_id]
        except (EOFError, OSError):
            pass
        finally:                       # the engine process ended: nothing more will come
            with self._send_lock:
                self._gone = True
            self._process.join(timeout=5)        # reap it at once: no zombie
            code = self._process.exitcode
            self.exit_reason = "stopped" if self._closed else \
                f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
            self._fail_all(EngineProcessError(f"the engine process ended ({self.exit_reason})"))

    def _fail_all(self, error: BaseException) -> None:
        with self._stats_cv:
            self._stats_cv.notify_all()
        with self.hub.publish():
            for handle in self._handles.values():
                handle.fail(error)
            self._handles.clear()


# ---- the engine side -----------------------------------------------------------------------------
def _engine_main(conn, model_dir: str, backend: str, llm_kwargs: dict) -> None:
    """The child process: build the LLM, then serve commands until "close" or the parent goes away."""
    # Ctrl-C in a terminal reaches the whole process group: the server decides when the engine stops
    # (close(), or the pipe closing when it exits), so that its requests end cleanly.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from engine.runtime.llm import LLM
    try:
        llm = LLM(model_dir, backend, **llm_kwargs)
    except Exception as exc:      # the parent re-raises it with the message (a bad model dir, no GPU, ...)
        conn.send(("failed", type(exc).__name__, str(exc)))
        return
    conn.send(("ready", {"backend": llm.backend.describe(), "max_seqs": llm.max_seqs,
                         "max_context": llm.max_context}))
    Forwarder(llm, conn).serve_commands()


class Forwarder:
    """Runs in the engine process: submits and cancels for the parent, and forwards every request's
    new tokens to it, one message per step for all requests."""

    def __init__(self, llm, conn):
        self.llm, self.conn = llm, conn
        self.cv = llm.handle_hub.cond              # notified by the engine loop after every step
        self.live: dict[int, tuple[RequestHandle, list[int]]] = {}   # parent's id -> (handle, [tokens sent])
        self.send_lock = threading.Lock()
        self.stopping = False

    def send(self, message) -> None:
        with self.send_lock:
            self.conn.send(message)

    def serve_commands(self) -> None:
        forwarder = threading.Thread(target=self.forward, name="engine-forwarder", daemon=True)
        forwarder.start()
        try:
            while True:
                kind, *body = self.conn.recv()
                if kind == "submit":
                    self.submit(*body)
                elif kind == "cancel":
                    with self.cv:
                        entry = self.live.get(body[0])
                    if entry is not None:
                        entry[0].cancel()
                elif kind == "stats":      # stats() waits for a step boundary: not on this thread
                    threading.Thread(target=self.answer_stats, args=(body[0],), daemon=True).start()
                elif kind == "close":
                    break
        except (EOFError, OSError):         # the parent is gone
            pass
        finally:
            with self.cv:
                self.stopping = True
                self.cv.notify_all()
            self.llm.close()
            forwarder.join(timeout=10)

    def submit(self, request_id: int, prompt_ids: list[int], params, client) -> None:
        try:
            handle = self.llm.submit(prompt_ids, params, client=client)
        except ValueError as exc:
            self.send(("refused", request_id, str(exc)))
            return
        with self.cv:
            self.live[request_id] = (handle, [0])
            self.cv.notify_all()
        self.send(("accepted", request_id))

    def answer_stats(self, ticket: int) -> None:
        try:
            stats = self.llm.stats()
        except RuntimeError as exc:        # closed meanwhile
            stats = {"error": str(exc)}
        self.send(("stats", ticket, stats))

    def forward(self) -> None:
        """After each step: (id, new tokens, new texts, new logprobs, end, output, error) of every request
        that moved."""
        while True:
            with self.cv:
                self.cv.wait_for(lambda: self.stopping or self._any_news(), FORWARD_POLL_S)
                if self.stopping:
                    return
                updates = []
                for request_id, (handle, sent) in list(self.live.items()):
                    tokens, texts, logprobs, done = handle.handed_over(sent[0])
                    if not tokens and not done:
                        continue
                    sent[0] += len(tokens)
                    end = output = error = None
                    if done:
                        del self.live[request_id]
                        final, out, failure = handle.ending()
                        if failure is not None or out is None:
                            error = f"{type(failure).__name__}: {failure}"
                        else:
                            end, output = final, (out.token_ids, out.text, out.finish_reason, out.logprobs)
                    updates.append((request_id, tokens, texts, logprobs, end, output, error))
            if updates:
                try:
                    self.send(("events", updates))
                except (OSError, ValueError):     # the parent is gone
                    return

    def _any_news(self) -> bool:
        return any(h.done or h.handed_over(sent[0])[0] for h, sent in self.live.values())

