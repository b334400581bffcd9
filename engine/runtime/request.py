"""Requests in and out (chapter 12): the handle a caller holds, and what it produces.

    prepare_prompt(prompt, params, tokenizer, vocab_size)   text or ids -> checked ids (LLM and RemoteLLM)
    RequestHandle     stream() / astream() / result() / cancel() for the caller (any thread)
    HandleHub         the one condition every handle of an engine waits on, and the only way to
                      write a handle: `with hub.publish(): handle.deliver(...)` hands over tokens,
                      finishes or fails requests, then wakes every waiting reader once
    RequestOutput     what a finished request returns

Two producers use the same handles: the engine loop (engine/runtime/engine_loop.py) in this process,
and RemoteLLM's receiver (engine/runtime/engine_process.py), which applies what an engine process
sent. Neither touches a handle's private fields: they call its producer methods inside publish().
"""
from __future__ import annotations

import asyncio
import threading
import time
import warnings
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from engine.model.forward_pass import check_token_ids
from engine.runtime.sampling_params import SamplingParams
from engine.text.tokenizer import IncrementalDetokenizer


@dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]       # generated tokens (a stopping eos included)
    text: str                  # decoded generated text (special tokens skipped); "" without a tokenizer
    finish_reason: str         # "stop" | "length" | "cancelled"
    # SamplingParams.logprobs: (logprob, [(id, logprob), ...] alternatives) for each generated token
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None


def prepare_prompt(prompt, params, tokenizer, vocab_size: int) -> tuple[list[int], SamplingParams]:
    """(token ids, params) of one request, checked where it enters the engine; ValueError otherwise.

    prompt: text (encoded with the model's tokenizer, special tokens added) or token ids, each an
    integer in [0, vocab_size); params: an engine.SamplingParams, or None for the defaults. Whether
    the request fits the context and the KV pool is the scheduler's check (Scheduler.validate)."""
    params = params if params is not None else SamplingParams()
    if not isinstance(params, SamplingParams):
        raise ValueError("params must be an engine.SamplingParams")
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("this model directory has no tokenizer.json: pass token ids")
        prompt = tokenizer.encode(prompt, add_special_tokens=True)
    if not isinstance(prompt, np.ndarray):
        prompt = list(prompt)        # a generator is read once
    return check_token_ids(prompt, vocab_size).tolist(), params


@dataclass(frozen=True)
class StreamEvent:
    """What one step did for one request. The texts of all events concatenate to the full decode."""
    request_id: int
    token_ids: list[int]          # new token ids (one per step; none in a "cancelled" event)
    text: str                     # new text; a UTF-8 character split over tokens comes out whole
    finished: bool
    finish_reason: str | None     # "stop" | "length" | "cancelled" | None while running
    logprobs: list | None = None  # SamplingParams.logprobs: one (logprob, alternatives) per token id


def wake_all(listeners: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]]) -> None:
    """Wake the astream() readers of one step: one call into each event loop, not one per request.

    call_soon_threadsafe writes to the loop's wake-up pipe; with hundreds of streaming requests, one
    write per request per step would cost the engine thread more than the step's own bookkeeping."""
    by_loop: dict[asyncio.AbstractEventLoop, list[asyncio.Event]] = {}
    for loop, event in listeners:
        by_loop.setdefault(loop, []).append(event)
    for loop, events in by_loop.items():
        try:
            loop.call_soon_threadsafe(_set_all, events)
        except RuntimeError:      # the event loop is closed: nobody is listening any more
            pass


def _set_all(events: list[asyncio.Event]) -> None:
    for event in events:
        event.set()


class HandleHub:
    """The condition shared by every handle of one engine, and the only writer of handles.

    One notify per step wakes every reader (thread or asyncio) instead of one per request: the loop
    delivers a step's tokens to hundreds of handles inside one publish(), then wakes them all."""

    def __init__(self):
        self.cond = threading.Condition()
        self._wake: list | None = None          # listeners to wake when the current publish() ends

    @contextmanager
    def publish(self):
        """Hold the condition while handles are written; then notify waiting threads and wake the
        asyncio readers (one call into each event loop)."""
        with self.cond:
            self._wake = []
            try:
                yield self
            finally:
                listeners, self._wake = self._wake, None
                self.cond.notify_all()
        wake_all(listeners)

    def wake_later(self, listeners: list) -> None:
        """Wake these readers when the current publish() ends (a producer method's last step)."""
        if self._wake is None:
            raise RuntimeError("a request handle is written only inside HandleHub.publish()")
        self._wake += listeners


class RequestHandle:
    """One submitted request: stream its tokens, wait for its result, or cancel it (any thread).

    The producer (the engine loop, or RemoteLLM's receiver) hands the handle bare token ids (one
    append per row and step, inside its hub's publish()); StreamEvents, and their text, are made only
    when a consumer reads them (stream/astream). A request nobody streams (generate() waits for
    results) never pays for per-token events or incremental detokenization. A request with stop
    strings gets its text from the producer, which must read it to find the stop.
    """

    def __init__(self, hub: HandleHub, request_id: int, prompt_token_ids: list[int], params, *,
                 cancel: Callable[[int], None], tokenizer=None, accepted: bool = True, client=None):
        self.request_id = request_id
        self.client = client              # who sent it (the scheduler shares seats fairly among clients)
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self._hub, self._cond = hub, hub.cond
        self._cancel, self._tokenizer = cancel, tokenizer
        # Written by the producer methods below, under the hub's condition:
        self._tokens: list[int] = []      # token ids handed over so far, one per step
        self._texts: list[str] | None = [] if params.stop else None   # their text (stop strings only)
        self._logprobs: list | None = [] if getattr(params, "logprobs", None) is not None else None
        self._end: tuple[list[int], str | None, str] | None = None     # final event: tokens, text, reason
        self._output: RequestOutput | None = None
        self._error: BaseException | None = None
        self._accepted = accepted         # False until a remote engine (engine_process) confirms it
        self._listeners: list = []        # (event loop, asyncio.Event) of each astream() reader
        # Made from the above by consumers, under _events_lock:
        self._events_lock = threading.Lock()
        self._events: list[StreamEvent] = []
        self._detok: IncrementalDetokenizer | None = None
        # Timeline for stats() and the chat's /stats (time.monotonic() seconds), kept by the engine loop.
        self.submitted_at = time.monotonic()
        self.first_token_at: float | None = None
        self.finished_at: float | None = None
        self.state = "waiting"        # waiting | prefill | decode | preempted | finished
        self.transitions: list[tuple[str, float]] = [("waiting", self.submitted_at)]
        self.num_generated = 0
        self.reused_tokens = 0        # prompt tokens whose K/V came from the prefix cache
        self.prefilled_tokens = 0     # prompt tokens whose K/V are in the cache (chunked prefill's progress)
        self.num_preemptions = 0

    # ---- consumer side -------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self._output is not None or self._error is not None

    def _available(self) -> int:
        """Events the loop has handed over (call under _cond)."""
        return len(self._tokens) + (self._end is not None)

    def _read(self, start: int) -> tuple[list[StreamEvent], BaseException | None, bool]:
        """(events[start:], error, done): the events handed over so far, made into StreamEvents."""
        with self._cond:
            n, end, texts = len(self._tokens), self._end, self._texts
            error, done = self._error, self.done
        with self._events_lock:             # two readers of one handle share one detokenizer
            events = self._events
            lps = self._logprobs
            for k in range(len(events), n):
                token = self._tokens[k]
                piece = texts[k] if texts is not None else self._push_text([token])
                events.append(StreamEvent(self.request_id, [token], piece, False, None,
                                          None if lps is None else lps[k:k + 1]))
            if end is not None and len(events) == n:
                tokens, known, reason = end
                text = known if known is not None else \
                    self._push_text(tokens) + (self._detok.flush() if self._detok is not None else "")
                out = self._output
                last = None if lps is None or out is None or out.logprobs is None else out.logprobs[n:n + len(tokens)]
                events.append(StreamEvent(self.request_id, tokens, text, True, reason, last))
            return events[start:], error, done

    def _push_text(self, tokens: list[int]) -> str:
        tokenizer = self._tokenizer
        if tokenizer is None:
            return ""
        if self._detok is None:
            self._detok = tokenizer.detokenizer(skip_special_tokens=True)
        detok = self._detok
        return "".join(detok.push(t) for t in tokens)

    def stream(self, heartbeat: float | None = None) -> Iterator[StreamEvent | None]:
        """Yield events as they come, the last one with finished=True; re-raises a failure.

        heartbeat: also yield None after that many seconds without an event (progress displays).
        """
        i = 0
        while True:
            with self._cond:          # shared by all handles: wait for one of our own events
                self._cond.wait_for(lambda seen=i: seen < self._available() or self.done, heartbeat)
            new, error, done = self._read(i)
            i += len(new)
            yield from new            # no event is added once done: these were the last ones
            if done:
                if error is not None:
                    raise error
                return
            if not new and heartbeat is not None:
                yield None

    async def astream(self) -> AsyncIterator[StreamEvent]:
        """The same as stream(), for asyncio: waiting never blocks the event loop."""
        async for events in self.astream_batches():
            for event in events:
                yield event

    async def astream_batches(self) -> AsyncIterator[list[StreamEvent]]:
        """astream() in batches: every event handed over since the last batch, at once.

        A consumer that falls behind (an HTTP server writing to many clients) gets several tokens
        per wake-up and can send them as one message, so it catches up instead of lagging further.
        """
        i = 0
        while True:
            await self._until(lambda seen=i: seen < self._available() or self.done)
            new, error, done = self._read(i)
            i += len(new)
            if new:
                yield new
            if done:
                if error is not None:
                    raise error
                return

    async def accepted(self) -> None:
        """Return once the engine has taken the request; ValueError if it refused it. An in-process
        engine checks requests in submit() (this returns at once); an engine in another process
        (engine.runtime.engine_process) checks them there, and answers a moment later."""
        await self._until(lambda: self._accepted or self.done)
        if not self._accepted and isinstance(self._error, ValueError):
            raise self._error

    async def _until(self, ready) -> None:
        """Wait, without blocking the event loop, until ready() holds (checked under the handles' lock)."""
        wake = asyncio.Event()
        listener = (asyncio.get_running_loop(), wake)
        with self._cond:
            if ready():
                return
            self._listeners.append(listener)
        try:
            while True:
                await wake.wait()
                wake.clear()
                with self._cond:
                    if ready():
                        return
        finally:
            with self._cond:
                self._listeners.remove(listener)

    def result(self, timeout: float | None = None):
        """Block until the request ends; its RequestOutput, or the exception that failed it."""
        with self._cond:
            if not self._cond.wait_for(lambda: self.done, timeout):
                raise TimeoutError(f"request {self.request_id} is still running after {timeout} s")
        if self._error is not None:
            raise self._error
        return self._output

    def cancel(self) -> None:
        """Stop the request at the next step boundary (its pages are freed then). No-op once done."""
        self._cancel(self.request_id)

    # ---- producer side: call inside the hub's publish() -------------------------------------------
    def deliver(self, tokens: list[int], texts: list[str] | None = None, logprobs: list | None = None) -> None:
        """Hand over new tokens (and, for a request with stop strings, their text; for one that asks
        for log-probabilities, theirs)."""
        self._tokens += tokens
        if texts and self._texts is not None:
            self._texts += texts
        if logprobs and self._logprobs is not None:
            self._logprobs += logprobs
        self._hub.wake_later(self._listeners)

    def finish(self, end: tuple[list[int], str | None, str], output: RequestOutput) -> None:
        """The last event (its tokens, its text or None to detokenize here, the finish reason) and the output."""
        self._end, self._output = end, output
        self._hub.wake_later(self._listeners)

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._hub.wake_later(self._listeners)

    def accept(self) -> None:
        """A remote engine took the request (accepted() returns)."""
        self._accepted = True
        self._hub.wake_later(self._listeners)

    def handed_over(self, start: int) -> tuple[list[int], list[str] | None, list | None, bool]:
        """(tokens[start:], their texts or None, their logprobs or None, done): what a forwarder relays
        (under the hub's condition)."""
        texts = self._texts[start:] if self._texts is not None else None
        logprobs = self._logprobs[start:] if self._logprobs is not None else None
        return self._tokens[start:], texts, logprobs, self.done

    def ending(self) -> tuple[tuple | None, RequestOutput | None, BaseException | None]:
        """(final event, output, error) of a finished request (under the hub's condition)."""
        return self._end, self._output, self._error

    # ---- the engine loop's bookkeeping (its thread only) ------------------------------------------
    def enter(self, state: str, at: float) -> None:
        if state != self.state:
            self.state = state
            self.transitions.append((state, at))

    def info(self) -> dict:
        """Plain data for stats()."""
        return {"request_id": self.request_id, "state": self.state, "prompt_tokens": len(self.prompt_token_ids),
                "prefilled_tokens": self.prefilled_tokens,
                "generated_tokens": self.num_generated, "reused_tokens": self.reused_tokens,
                "preemptions": self.num_preemptions, "submitted": self.submitted_at,
                "first_token": self.first_token_at, "finished": self.finished_at,
                "finish_reason": self._output.finish_reason if self._output is not None else
                ("error" if self._error is not None else None),
                "timeline": list(self.transitions)}




SESSIONS_GONE = ("session= and drop_session() are no longer needed and do nothing: the prefix cache finds "
                 "a conversation's earlier turns by their tokens (chapter 15)")


def warn_sessions_gone() -> None:
    """Callers of the earlier session API keep working: their session is ignored, with a warning."""
    warnings.warn(SESSIONS_GONE, DeprecationWarning, stacklevel=3)
