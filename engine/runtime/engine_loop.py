"""The online engine (chapter 12): one loop owns the model, the KV cache and the scheduler.

Requests arrive from any thread (or asyncio coroutine) at any time through `EngineLoop.submit`,
which checks them at once (a ValueError before anything runs) and queues them. One background
thread runs the loop while there is work and sleeps on a condition variable when there is none
(no busy-spinning):

    take the queued submissions and cancellations -> schedule -> forward -> sample -> complete
    -> hand every request its new token (and text) -> repeat

Every new request joins the running batch at the next step; a cancelled one leaves at the next step
boundary with its pages freed. Stop strings (SamplingParams.stop) are checked here, on the text the
detokenizer produces: the scheduler sees only token ids, so when a request's text reaches one of its
stop strings the loop ends it (finish_reason "stop", pages freed) and its text ends before the string.
A forward pass that raises fails the requests of that batch with the
exception (their handles re-raise it) and the engine carries on with the others.

On a GPU the loop keeps one batch in flight (async scheduling, engine/runtime/scheduler.py): it schedules and
launches step N+1, then waits for step N's tokens and hands them out while the GPU runs step N+1.
The GPU never waits for the host's scheduling and bookkeeping, only the other way round; a request
that ends at step N (eos, a stop string, a cancel) has its row of step N+1 computed and discarded. `LLM.generate`,
the chat and the HTTP server all go through this loop: nothing else writes the cache.

The thread holds the LLM only through a weak reference while it sleeps, so dropping the last
reference to an LLM frees its model and cache (and ends the thread).
"""
from __future__ import annotations

import asyncio
import threading
import time
import weakref
from collections import deque
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

from engine.runtime.sampling_params import resolve_seed
from engine.text.stop_strings import StopStringMatcher

RECENT_REQUESTS = 256     # finished requests kept for stats() (a dashboard's timeline)
RECENT_STEPS = 512        # steps kept for stats()' throughput figure


@dataclass(frozen=True)
class StreamEvent:
    """What one step did for one request. The texts of all events concatenate to the full decode."""
    request_id: int
    token_ids: list[int]          # new token ids (one per step; none in a "cancelled" event)
    text: str                     # new text; a UTF-8 character split over tokens comes out whole
    finished: bool
    finish_reason: str | None     # "stop" | "length" | "cancelled" | None while running


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


class BatchFailed(Exception):
    """A forward pass raised (the scheduler has already undone the step); __cause__ is the error."""

    def __init__(self, request_ids: list[int]):
        super().__init__(f"the step of requests {request_ids} failed")
        self.request_ids = request_ids


class RequestHandle:
    """One submitted request: stream its tokens, wait for its result, or cancel it (any thread).

    The loop hands the handle bare token ids (one append per row and step, under the engine's one
    condition for all handles); StreamEvents, and their text, are made only when a consumer reads
    them (stream/astream). A request nobody streams (generate() waits for results) never pays for
    per-token events or incremental detokenization. A request with stop strings gets its text from
    the loop, which must read it to find the stop.
    """

    def __init__(self, engine: EngineLoop, request_id: int, prompt_token_ids: list[int], params, session):
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.params, self.session = params, session
        self._engine = engine
        self._cond = engine._handles_cv   # shared by every handle: one notify per step wakes all readers
        # Written by the loop under _cond:
        self._tokens: list[int] = []      # token ids handed over so far, one per step
        self._texts: list[str] | None = [] if params.stop else None   # their text (stop strings only)
        self._end: tuple[list[int], str | None, str] | None = None     # final event: tokens, text, reason
        self._output = None               # RequestOutput once finished
        self._error: BaseException | None = None
        self._accepted = True             # False until a remote engine (engine.runtime.engine_process) confirms it
        self._listeners: list = []        # (event loop, asyncio.Event) of each astream() reader
        # Made from the above by consumers, under _events_lock:
        self._events_lock = threading.Lock()
        self._events: list[StreamEvent] = []
        self._detok = None
        # Timeline for stats() and the chat's /stats (time.monotonic() seconds), written by the loop.
        self.submitted_at = time.monotonic()
        self.first_token_at: float | None = None
        self.finished_at: float | None = None
        self.state = "waiting"        # waiting | prefill | decode | preempted | finished
        self.transitions: list[tuple[str, float]] = [("waiting", self.submitted_at)]
        self.num_generated = 0
        self.reused_tokens = 0        # prompt tokens whose K/V came from the session's cached pages
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
            for k in range(len(events), n):
                token = self._tokens[k]
                text = texts[k] if texts is not None else self._push_text([token])
                events.append(StreamEvent(self.request_id, [token], text, False, None))
            if end is not None and len(events) == n:
                tokens, text, reason = end
                if text is None:
                    text = self._push_text(tokens) + (self._detok.flush() if self._detok is not None else "")
                events.append(StreamEvent(self.request_id, tokens, text, True, reason))
            return events[start:], error, done

    def _push_text(self, tokens: list[int]) -> str:
        tokenizer = self._engine._tokenizer
        if tokenizer is None:
            return ""
        if self._detok is None:
            self._detok = tokenizer.detokenizer(skip_special_tokens=True)
        return "".join(self._detok.push(t) for t in tokens)

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
        self._engine.cancel(self.request_id)

    # ---- engine side ---------------------------------------------------------------------------
    def _enter(self, state: str, at: float) -> None:
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


class EngineLoop:
    """The loop behind one LLM. See the module docstring."""

    def __init__(self, llm):
        self._llm_ref = weakref.ref(llm, lambda _ref: self.close())
        self.lock = threading.Lock()          # held for each loop iteration and by hand-driven steps
        self._cv = threading.Condition()      # guards the queues below and the thread's sleep
        self._handles_cv = threading.Condition()   # guards what the loop hands to RequestHandles
        self._pending: list[RequestHandle] = []
        self._cancels: set[int] = set()
        self._next_id = 0
        self._thread: threading.Thread | None = None
        self._closed = False
        self._has_work = False                # the scheduler holds unfinished requests (loop thread)
        self._busy = False                    # the loop thread is inside an iteration
        self._stats_wanted = 0
        self._stats_served = 0
        self._stats: dict | None = None
        self._tokenizer = llm.tokenizer
        self.scheduler = llm.new_scheduler(async_scheduling=llm.async_scheduling)
        self._in_flight = None                # async scheduling: the launched step not yet completed
        self.manual = None                    # weakref to a scheduler driven by hand (LLM.step)
        # Owned by the loop thread:
        self._handles: dict[int, RequestHandle] = {}
        self._seeds: dict[int, int] = {}
        self._detok: dict[int, object] = {}                 # requests with stop strings: their text
        self._stops: dict[int, StopStringMatcher] = {}     # is read here, to find the stop
        self._collectors: list[list[dict]] = []
        self._recent: deque[RequestHandle] = deque(maxlen=RECENT_REQUESTS)
        self._steps: deque[tuple[float, float, int, str]] = deque(maxlen=RECENT_STEPS)  # (t0, t1, sampled, kind)
        self._ttft: deque[float] = deque(maxlen=RECENT_REQUESTS)
        self.tokens_generated = 0
        self.num_steps = 0

    # ---- any thread ----------------------------------------------------------------------------
    def validate(self, prompt_ids: list[int], params) -> list[int]:
        """The prompt as a list of ints if the request can be served, else ValueError (thread-safe)."""
        prompt, _, _ = self.scheduler.validate(prompt_ids, params)   # constants only
        if getattr(params, "stop", ()) and self._tokenizer is None:
            raise ValueError("stop strings need text: this model directory has no tokenizer.json")
        return prompt

    def submit(self, prompt_ids: list[int], params, session=None) -> RequestHandle:
        return self.submit_many([(prompt_ids, params, session)])[0]

    def submit_many(self, requests) -> list[RequestHandle]:
        """Queue (prompt_ids, params, session) requests together: the loop sees all of them or none at
        its next step, so one generate() call's step log does not depend on thread timing."""
        prompts = [self.validate(prompt_ids, params) for prompt_ids, params, _ in requests]
        manual = self.manual() if self.manual is not None else None
        if manual is not None and manual.has_unfinished():
            raise RuntimeError("this LLM is being stepped by hand (LLM.step) and still holds requests there")
        with self._cv:
            if self._closed:
                raise RuntimeError("this LLM was closed")
            handles = []
            for prompt, (_, params, session) in zip(prompts, requests, strict=True):
                handles.append(RequestHandle(self, self._next_id, prompt, params, session))
                self._next_id += 1
            self._pending.extend(handles)
            self._start_thread()
            self._cv.notify_all()
        return handles

    def cancel(self, request_id: int) -> None:
        with self._cv:
            self._cancels.add(request_id)
            self._cv.notify_all()

    def drop_session(self, session) -> None:
        with self.lock:                      # between two iterations: the scheduler is at rest
            self.scheduler.drop_session(session)

    def collect_steps(self) -> list[dict]:
        """A list that receives every step's log entry until stop_collecting() (LLM.last_step_log)."""
        log: list[dict] = []
        with self._cv:
            self._collectors.append(log)
        return log

    def stop_collecting(self, log: list[dict]) -> None:
        with self._cv:
            self._collectors = [c for c in self._collectors if c is not log]

    def stats(self) -> dict:
        """A plain-dict snapshot, taken between two steps (waits for at most one step)."""
        with self._cv:
            if not self._busy:               # the loop sleeps (or never started): nothing moves
                with self.lock:
                    return self._build_stats()
            ticket = self._stats_wanted = self._stats_wanted + 1
            self._cv.notify_all()
            self._cv.wait_for(lambda: self._stats_served >= ticket or not self._busy)
            if self._stats_served >= ticket:
                return self._stats
            with self.lock:
                return self._build_stats()

    def close(self) -> None:
        """Stop the thread; requests still queued or running fail with RuntimeError."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()

    def _start_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
            self._thread.start()

    # ---- the loop thread -----------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cv:
                self._busy = False
                self._cv.notify_all()
                self._cv.wait_for(lambda: self._pending or self._cancels or self._has_work or self._closed)
                self._busy = True
                pending, self._pending = self._pending, []
                cancels, self._cancels = self._cancels, set()
                closed = self._closed
            llm = self._llm_ref()
            with self.lock:
                for handle in pending:
                    self._handles[handle.request_id] = handle
                if closed or llm is None:
                    self._fail_all(RuntimeError("the LLM was closed"))
                    with self._cv:
                        self._busy = False
                        self._cv.notify_all()
                    return
                try:
                    self._iteration(llm, pending, cancels)
                except BaseException as exc:     # a bug, not a model error: fail everything, start afresh
                    self._fail_all(exc)
                    with self._cv:               # the next submission's id is the new scheduler's first
                        first = min([h.request_id for h in self._pending], default=self._next_id)
                    self._in_flight = None
                    self.scheduler = llm.new_scheduler(first_request_id=first,
                                                       async_scheduling=llm.async_scheduling)
                    if not isinstance(exc, Exception):
                        raise
                finally:
                    self._has_work = self.scheduler.has_unfinished() or self._in_flight is not None
                    self._serve_stats()
            del llm

    def _iteration(self, llm, pending: list[RequestHandle], cancels: set[int]) -> None:
        sched = self.scheduler
        for handle in pending:
            request_id = sched.submit(handle.prompt_token_ids, handle.params, session=handle.session)
            if request_id != handle.request_id:
                raise RuntimeError(f"engine and scheduler request ids diverged ({handle.request_id} != {request_id})")
            self._seeds[request_id] = resolve_seed(handle.params)
            if handle.params.stop:      # validate() made sure there is a tokenizer
                self._detok[request_id] = self._tokenizer.detokenizer(skip_special_tokens=True)
                self._stops[request_id] = StopStringMatcher(handle.params.stop)
        self._finish(sched.pop_finished())         # max_new_tokens == 0: finished by submit()
        for request_id in cancels:
            if request_id in self._handles:
                self._finish([sched.cancel(request_id)])
        if sched.async_scheduling:
            self._overlapped_step(llm, sched)
            return
        if not sched.has_unfinished():
            return
        t0 = time.monotonic()
        try:
            ran = llm._step(sched, self._seeds)
        except BatchFailed as failed:
            for request_id in failed.request_ids:
                sched.cancel(request_id)
                sched.drop_session(self._handles[request_id].session)   # its pages may be half-written
                self._fail(self._handles[request_id], failed.__cause__)
            return
        if ran is None:
            raise RuntimeError("the scheduler has unfinished requests but scheduled nothing")
        self._account_log(sched, t0, time.monotonic())

    def _account_log(self, sched, t0: float, t1: float) -> None:
        for entry in sched.step_log:
            self._account(entry, t0, t1)
            for log in self._collectors:
                log.append(entry)
        sched.step_log.clear()

    def _overlapped_step(self, llm, sched) -> None:
        """Async scheduling: launch step N+1 (if anything can run), then complete step N.

        A launch that raises fails the requests of its batch; a step whose samples cannot be read
        (non-finite logits) fails the requests of its batch, whose rows in the step just launched
        are then discarded."""
        previous, self._in_flight = self._in_flight, None
        launched = None
        batch = sched.schedule() if sched.has_unfinished() else None
        if batch is not None:
            try:
                launched = llm._launch(batch, self._seeds, previous)
            except Exception as exc:
                self._abort(sched, batch.batch_id, exc)
        if previous is not None:
            try:
                tokens = previous.tokens(is_live=sched.is_live)
            except Exception as exc:
                self._abort(sched, previous.batch.batch_id, exc)
            else:
                llm._complete(sched, previous, tokens)
                self._account_log(sched, previous.launched_at, time.monotonic())
        elif batch is None and sched.has_unfinished():
            raise RuntimeError("the scheduler has unfinished requests but scheduled nothing")
        self._in_flight = launched

    def _abort(self, sched, batch_id: int, error: BaseException) -> None:
        for result in sched.abort(batch_id):
            self._fail(self._handles[result.request_id], error)

    def _account(self, entry: dict, t0: float, t1: float) -> None:
        """Move each row's request to its state; hand each sampled token to its request; finish the
        ones the scheduler finished. (A chunk that stops short of its prompt's end sampled nothing.)

        The common row (a decode step of a request already decoding, no stop strings) costs a few
        attribute updates and one list append; events and text are made when someone reads them.
        """
        self.num_steps += 1
        self._steps.append((t0, t1, entry["sampled"], entry["kind"]))
        for request_id in entry["preempted"]:
            handle = self._handles[request_id]
            handle.num_preemptions += 1
            handle.prefilled_tokens = 0
            if not handle.num_generated:      # its prompt is computed again from position 0
                handle.reused_tokens = 0
            handle._enter("preempted", t0)
        finished = {r.request_id: r for r in self.scheduler.pop_finished()}
        final_text: dict[int, str] = {}
        admitted, prefilling = set(entry["admitted"]), set(entry["prefill_ids"])
        chunk_ends = {rid: start + n for rid, start, n, samples in entry["chunks"] if not samples}
        for request_id, start in zip(entry["request_ids"], entry["start_positions"], strict=True):
            handle = self._handles[request_id]
            if handle.state == "decode" and request_id not in prefilling:
                continue                      # decoding on: its state and prompt progress stay as they are
            handle._enter("prefill" if request_id in prefilling else "decode", t0)
            if request_id in admitted:        # a first row starts after the prefix reused from the session
                handle.reused_tokens = start
            prompt_len = len(handle.prompt_token_ids)
            handle.prefilled_tokens = min(chunk_ends.get(request_id, prompt_len), prompt_len)
        delivered: list[tuple[RequestHandle, int, str | None]] = []   # (handle, token, text: stop strings only)
        for request_id, token in zip(entry["sampled_ids"], entry["sampled_tokens"], strict=True):
            handle = self._handles[request_id]
            handle.num_generated += 1
            if handle.first_token_at is None:
                handle.first_token_at = t1
                self._ttft.append(t1 - handle.submitted_at)
            if request_id in finished:
                continue
            text = None
            if handle._texts is not None:
                text = self._stop_text(request_id, [token], final=False)
                if self._stops[request_id].stopped:     # its text reached a stop string: it ends here
                    result = self.scheduler.cancel(request_id)
                    result.finish_reason = "stop"
                    finished[request_id], final_text[request_id] = result, text
                    continue
            handle._enter("decode", t1)
            delivered.append((handle, token, text))
        self.tokens_generated += len(entry["sampled_ids"])
        listeners = []
        with self._handles_cv:
            for handle, token, text in delivered:
                handle._tokens.append(token)
                if text is not None:
                    handle._texts.append(text)
                if handle._listeners:
                    listeners += handle._listeners
            self._handles_cv.notify_all()
        wake_all(listeners)
        self._finish(list(finished.values()), sampled_now=set(finished), at=t1, final_text=final_text)

    def _stop_text(self, request_id: int, tokens: list[int], final: bool) -> str:
        """New text of a request with stop strings: UTF-8 safe, and never past (or into) a stop string."""
        detok = self._detok[request_id]
        piece = "".join(detok.push(t) for t in tokens) + (detok.flush() if final else "")
        stop = self._stops[request_id]
        shown = stop.push(piece)
        return shown + stop.flush() if final else shown

    def _finish(self, results, sampled_now: set[int] = frozenset(), at: float | None = None,
                final_text: dict[int, str] | None = None) -> None:
        """Deliver final events and outputs; requests in `sampled_now` got their last token this step
        (it goes into the final event); `final_text` holds that event's text where it is known already
        (a stop string ended the request)."""
        from engine.runtime.llm import RequestOutput
        if not results:
            return
        at = time.monotonic() if at is None else at
        ended = []
        for result in results:
            request_id = result.request_id
            handle = self._handles.pop(request_id)
            self._seeds.pop(request_id, None)
            new = result.token_ids[-1:] if request_id in sampled_now else []
            if request_id in self._stops:    # the matcher saw the whole text, cut at a stop string if one came
                if final_text and request_id in final_text:
                    text = final_text[request_id]
                else:
                    text = self._stop_text(request_id, new, final=True)
                full = self._stops.pop(request_id).text
                self._detok.pop(request_id)
            else:                            # the handle makes the event's text if someone reads it
                text = None
                full = self._tokenizer.decode(result.token_ids, skip_special_tokens=True) if self._tokenizer else ""
            handle.finished_at = at
            handle._enter("finished", at)
            self._recent.append(handle)
            ended.append((handle, (new, text, result.finish_reason),
                          RequestOutput(result.prompt_ids, result.token_ids, full, result.finish_reason)))
        listeners = []
        with self._handles_cv:
            for handle, end, output in ended:
                handle._end, handle._output = end, output
                listeners += handle._listeners
            self._handles_cv.notify_all()
        wake_all(listeners)

    def _fail(self, handle: RequestHandle, error: BaseException) -> None:
        self._handles.pop(handle.request_id, None)
        self._detok.pop(handle.request_id, None)
        self._stops.pop(handle.request_id, None)
        self._seeds.pop(handle.request_id, None)
        handle.finished_at = time.monotonic()
        handle._enter("finished", handle.finished_at)
        self._recent.append(handle)
        with self._handles_cv:
            handle._error = error
            listeners = list(handle._listeners)
            self._handles_cv.notify_all()
        wake_all(listeners)

    def _fail_all(self, error: BaseException) -> None:
        for handle in list(self._handles.values()):
            self._fail(handle, error)

    def _serve_stats(self) -> None:
        with self._cv:
            if self._stats_wanted > self._stats_served:
                self._stats = self._build_stats()
                self._stats_served = self._stats_wanted
                self._cv.notify_all()

    def _build_stats(self) -> dict:
        """Plain data: counts, the page map, per-request timelines, time to first token, throughput."""
        snap = self.scheduler.snapshot()
        owners = [-1] * snap["num_pages"]          # -1 free, -2 cached for a session, else request id
        for request_id, table in snap["page_tables"].items():
            for page in table:
                owners[page] = request_id
        for table in snap["parked_tables"].values():
            for page in table:
                owners[page] = -2
        now = time.monotonic()
        recent = [s for s in self._steps if s[1] >= now - 5.0]
        span = (recent[-1][1] - recent[0][0]) if recent else 0.0
        live = sorted(self._handles.values(), key=lambda h: h.request_id)
        return {
            "now": now,
            "running": len(snap["running"]),
            "waiting": len(snap["waiting"]),
            "pages_total": snap["num_pages"],
            "pages_used": snap["used_pages"],
            "pages_cached": sum(len(t) for t in snap["parked_tables"].values()),
            "page_size": snap["page_size"],
            "page_tables": {int(k): list(v) for k, v in snap["page_tables"].items()},
            "page_owners": owners,
            "steps": self.num_steps,
            "tokens_generated": self.tokens_generated,
            "tokens_per_second": sum(s[2] for s in recent) / span if span > 0 else 0.0,
            "preemptions": snap["total_preemptions"],
            "time_to_first_token": list(self._ttft),
            "requests": [h.info() for h in list(self._recent) + live],
        }
