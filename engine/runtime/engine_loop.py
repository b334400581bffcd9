"""The engine loop (chapter 12): one thread owns the model runner, the KV cache and the scheduler.

Requests arrive from any thread (or asyncio coroutine) at any time through `EngineLoop.submit`,
which checks them at once (a ValueError before anything runs) and queues them. One background
thread runs the loop while there is work and sleeps on a condition variable when there is none
(no busy-spinning):

    take the queued submissions and cancellations -> schedule -> launch (forward + sample)
    -> wait -> complete (a StepOutput) -> hand every request its new token (and text) -> repeat

The step itself comes in two compositions of the model runner's calls (engine/runtime/model_runner.py),
written side by side below: `synchronous_step` (schedule, launch, wait, complete: the CPU, a learner's
scheduler, LLM.step by hand) and `_overlapped_step` (async scheduling, on a GPU: it schedules and
launches step N+1, then waits for step N's tokens and hands them out while the GPU runs step N+1).
The GPU never waits for the host's scheduling and bookkeeping, only the other way round; a request
that ends at step N (eos, a stop string, a cancel) has its row of step N+1 computed and discarded.

Every new request joins the running batch at the next step; a cancelled one leaves at the next step
boundary with its pages freed. Stop strings (SamplingParams.stop) are checked here, on the text the
detokenizer produces: the scheduler sees only token ids, so when a request's text reaches one of its
stop strings the loop ends it (finish_reason "stop", pages freed) and its text ends before the string.
A forward pass that raises fails the requests of that batch with the exception (their handles
re-raise it) and the engine carries on with the others. `LLM.generate`, the chat and the HTTP server
all go through this loop: nothing else writes the cache.

The loop reads what a step did from `Scheduler.complete()`'s StepOutput and writes the handles only
through their producer methods (engine/runtime/request.py). The thread holds the runner only through
a weak reference while it sleeps, so dropping the last reference to an LLM frees its model and cache
(and ends the thread).
"""
from __future__ import annotations

import threading
import time
import weakref
from collections import deque

from engine.runtime.engine_config import EngineConfig
from engine.runtime.model_runner import LaunchedStep, ModelRunner
from engine.runtime.request import HandleHub, RequestHandle, RequestOutput
from engine.runtime.sampling_params import resolve_seed
from engine.runtime.scheduler import Scheduler, StepOutput
from engine.runtime.step_log import StepRecord
from engine.text.stop_strings import StopStringMatcher
from engine.text.tokenizer import IncrementalDetokenizer

RECENT_REQUESTS = 256     # finished requests kept for stats() (a dashboard's timeline)
RECENT_STEPS = 512        # steps kept for stats()' throughput figure


class BatchFailed(Exception):
    """A forward pass raised (the scheduler has already undone the step); __cause__ is the error."""

    def __init__(self, request_ids: list[int]):
        super().__init__(f"the step of requests {request_ids} failed")
        self.request_ids = request_ids


class EngineLoop:
    """The loop behind one LLM. See the module docstring."""

    def __init__(self, runner: ModelRunner, engine_config: EngineConfig, tokenizer, eos_token_ids: set[int]):
        # the thread holds the runner only weakly while it sleeps: dropping the LLM frees the model
        # and the cache, and closes the loop
        self._runner_ref = weakref.ref(runner, lambda _ref: self.close())
        self.engine_config, self._eos, self._num_pages = engine_config, eos_token_ids, runner.cache.num_pages
        self._vocab_size = runner.config.vocab_size
        self.lock = threading.Lock()          # held for each loop iteration and by hand-driven steps
        self._cv = threading.Condition()      # guards the queues below and the thread's sleep
        self.hub = HandleHub()                # what every RequestHandle waits on; the loop writes them through it
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
        self._tokenizer = tokenizer
        self.scheduler = self.new_scheduler(async_scheduling=engine_config.async_scheduling)
        self._in_flight: LaunchedStep | None = None   # async scheduling: the step not yet completed
        self.manual: weakref.ref[Scheduler] | None = None   # a scheduler driven by hand (LLM.step)
        # Owned by the loop thread:
        self._handles: dict[int, RequestHandle] = {}
        self._seeds: dict[int, int] = {}
        self._detok: dict[int, IncrementalDetokenizer] = {}   # requests with stop strings: their text
        self._stops: dict[int, StopStringMatcher] = {}     # is read here, to find the stop
        self._logprobs: dict[int, list] = {}   # requests asking for logprobs: one entry per token so far
        self._collectors: list[list[StepRecord]] = []
        self._recent: deque[RequestHandle] = deque(maxlen=RECENT_REQUESTS)
        self._steps: deque[tuple[float, float, int, str]] = deque(maxlen=RECENT_STEPS)  # (t0, t1, sampled, kind)
        self._ttft: deque[float] = deque(maxlen=RECENT_REQUESTS)
        self.tokens_generated = 0
        self.num_steps = 0

    def new_scheduler(self, first_request_id: int = 0, *, async_scheduling: bool = False) -> Scheduler:
        """A scheduler over this engine's KV pool (the loop's own, or one that chapters 10-11 drive by
        hand through LLM.step)."""
        runner = self._runner_ref()
        return self.engine_config.new_scheduler(self._num_pages, self._eos, first_request_id,
                                                async_scheduling=async_scheduling,
                                                proposer=None if runner is None else runner.proposer)

    # ---- any thread ----------------------------------------------------------------------------
    def validate(self, prompt_ids: list[int], params) -> list[int]:
        """The prompt as a list of ints if the request can be served, else ValueError (thread-safe)."""
        prompt, _, _ = self.scheduler.validate(prompt_ids, params)   # constants only
        if getattr(params, "stop", ()) and self._tokenizer is None:
            raise ValueError("stop strings need text: this model directory has no tokenizer.json")
        bias = getattr(params, "logit_bias", ())
        if bias and bias[-1][0] >= self._vocab_size:          # (sorted by token id)
            raise ValueError(f"logit_bias names token id {bias[-1][0]}; the model has {self._vocab_size}")
        runner = self._runner_ref()
        if getattr(params, "structured", None) is not None and runner is not None:
            runner.structured.compile(params.structured)     # a bad constraint: StructuredError (a ValueError)
        return prompt

    def submit(self, prompt_ids: list[int], params, client=None) -> RequestHandle:
        return self.submit_many([(prompt_ids, params)], client)[0]

    def submit_many(self, requests, client=None) -> list[RequestHandle]:
        """Queue (prompt_ids, params) requests together: the loop sees all of them or none at its next
        step, so one generate() call's step log does not depend on thread timing. `client`: who sent
        them (the scheduler shares seats fairly among clients)."""
        prompts = [self.validate(prompt_ids, params) for prompt_ids, params in requests]
        manual = self.manual() if self.manual is not None else None
        if manual is not None and manual.has_unfinished():
            raise RuntimeError("this LLM is being stepped by hand (LLM.step) and still holds requests there")
        with self._cv:
            if self._closed:
                raise RuntimeError("this LLM was closed")
            handles = []
            for prompt, (_, params) in zip(prompts, requests, strict=True):
                handles.append(RequestHandle(self.hub, self._next_id, prompt, params,
                                             cancel=self.cancel, tokenizer=self._tokenizer, client=client))
                self._next_id += 1
            self._pending.extend(handles)
            self._start_thread()
            self._cv.notify_all()
        return handles

    def cancel(self, request_id: int) -> None:
        with self._cv:
            self._cancels.add(request_id)
            self._cv.notify_all()

    def reset_prefix_cache(self) -> None:
        with self.lock:                      # between two iterations: the scheduler is at rest
            if self.scheduler.has_unfinished() or self._in_flight is not None:
                raise RuntimeError("reset_prefix_cache() while requests run: wait for them first")
            self.scheduler.clear_prefix_cache()

    def collect_steps(self) -> list[StepRecord]:
        """A list that receives every step's log entry until stop_collecting() (LLM.last_step_log)."""
        log: list[StepRecord] = []
        with self._cv:
            self._collectors.append(log)
        return log

    def stop_collecting(self, log: list[StepRecord]) -> None:
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
            if self._stats_served >= ticket and self._stats is not None:
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
            runner = self._runner_ref()
            with self.lock:
                for handle in pending:
                    self._handles[handle.request_id] = handle
                if closed or runner is None:
                    self._fail_all(RuntimeError("the LLM was closed"))
                    with self._cv:
                        self._busy = False
                        self._cv.notify_all()
                    return
                try:
                    self._iteration(runner, pending, cancels)
                except BaseException as exc:     # a bug, not a model error: fail everything, start afresh
                    self._fail_all(exc)
                    with self._cv:               # the next submission's id is the new scheduler's first
                        first = min([h.request_id for h in self._pending], default=self._next_id)
                    self._in_flight = None
                    self.scheduler = self.new_scheduler(first, async_scheduling=self.engine_config.async_scheduling)
                    if not isinstance(exc, Exception):
                        raise
                finally:
                    self._has_work = self.scheduler.has_unfinished() or self._in_flight is not None
                    self._serve_stats()
            del runner

    def _iteration(self, runner: ModelRunner, pending: list[RequestHandle], cancels: set[int]) -> None:
        sched = self.scheduler
        for handle in pending:
            # (a learner's scheduler of chapters 10-11 need not know clients)
            named = {"client": handle.client} if handle.client is not None else {}
            request_id = sched.submit(handle.prompt_token_ids, handle.params, **named)
            if request_id != handle.request_id:
                raise RuntimeError(f"engine and scheduler request ids diverged ({handle.request_id} != {request_id})")
            self._seeds[request_id] = resolve_seed(handle.params)
            if getattr(handle.params, "logprobs", None) is not None:
                self._logprobs[request_id] = []
            if handle.params.stop:      # validate() made sure there is a tokenizer
                self._detok[request_id] = self._tokenizer.detokenizer(skip_special_tokens=True)
                self._stops[request_id] = StopStringMatcher(handle.params.stop)
        self._finish(sched.pop_finished())         # max_new_tokens == 0: finished by submit()
        for request_id in cancels:
            if request_id in self._handles:
                self._finish([sched.cancel(request_id)])
        if sched.async_scheduling:
            self._overlapped_step(runner, sched)
        elif sched.has_unfinished():
            t0 = time.monotonic()
            try:
                out = self.synchronous_step(runner, sched, self._seeds)
            except BatchFailed as failed:
                for request_id in failed.request_ids:   # (the pages it wrote were never registered)
                    sched.cancel(request_id)
                    self._fail(self._handles[request_id], failed.__cause__ or failed)
                return
            if out is None:
                raise RuntimeError("the scheduler has unfinished requests but scheduled nothing")
            self._account(out, t0, time.monotonic())

    # ---- the two ways to run a step, side by side ----------------------------------------------
    @staticmethod
    def synchronous_step(runner: ModelRunner, sched: Scheduler, seeds: dict[int, int]) -> StepOutput | None:
        """schedule -> launch -> wait -> complete. None when there was nothing to run; a failed step is
        undone (sched.fail: the scheduler is as before schedule()) and raised as BatchFailed."""
        runner.claim_cache(sched)
        batch = sched.schedule()
        if batch is None:
            return None
        try:
            launched = runner.launch(batch, seeds)
            tokens = launched.tokens()
        except BaseException as exc:
            sched.fail(batch.batch_id)
            raise BatchFailed([row.request_id for row in batch.rows]) from exc
        return runner.complete(sched, launched, tokens)

    def _overlapped_step(self, runner: ModelRunner, sched: Scheduler) -> None:
        """Async scheduling: launch step N+1 (if anything can run), then wait for and complete step N.

        A launch that raises fails the requests of its batch; a step whose samples cannot be read
        (non-finite logits) fails the requests of its batch, whose rows in the step just launched
        are then discarded. When step N+1's draw needs step N's tokens (penalties, structured outputs),
        it is queued right after step N completes (ModelRunner.finish), while the device still runs
        step N+1's forward pass; the handles are written after that."""
        previous, self._in_flight = self._in_flight, None
        launched = None
        runner.claim_cache(sched)
        batch = sched.schedule() if sched.has_unfinished() else None
        if batch is not None:
            try:
                launched = runner.launch(batch, self._seeds, previous)
            except Exception as exc:
                self._abort(sched, batch.batch_id, exc)
        out = tokens = None
        if previous is not None:
            try:
                tokens = previous.tokens(is_live=sched.is_live)
            except Exception as exc:
                self._abort(sched, previous.batch.batch_id, exc)
            else:
                out = runner.complete(sched, previous, tokens)
        elif batch is None and sched.has_unfinished():
            raise RuntimeError("the scheduler has unfinished requests but scheduled nothing")
        if launched is not None and launched.waiting is not None:
            try:
                runner.finish(launched, previous, tokens, sched.is_live)
            except Exception as exc:
                self._abort(sched, launched.batch.batch_id, exc)
                launched = None
        if out is not None and previous is not None:
            self._account(out, previous.launched_at, time.monotonic())
        self._in_flight = launched

    def step_by_hand(self, runner: ModelRunner, sched: Scheduler, seeds: dict[int, int]) -> StepOutput | None:
        """LLM.step: one synchronous step of a scheduler that chapters 10-11 drive themselves, while the
        loop serves nothing (both would write the same cache). None when there was nothing to run."""
        busy = RuntimeError("the engine loop is serving requests: wait for them before stepping by hand")
        if sched is not self.scheduler and self._has_work:   # refused at once, not after the loop's step
            raise busy
        with self.lock:
            if sched is not self.scheduler:
                if self.scheduler.has_unfinished():
                    raise busy
                self.manual = weakref.ref(sched)       # (the runner makes each forget the other's pages)
            try:
                return self.synchronous_step(runner, sched, seeds)
            except BatchFailed as failed:
                raise (failed.__cause__ or failed) from None

    def _abort(self, sched: Scheduler, batch_id: int, error: BaseException) -> None:
        for result in sched.abort(batch_id):
            self._fail(self._handles[result.request_id], error)

    # ---- handing results to the requests ----------------------------------------------------------
    def _account(self, out: StepOutput, t0: float, t1: float) -> None:
        """Move each row's request to its state; hand each sampled token to its request; finish the
        ones the step finished. (A chunk that stops short of its prompt's end sampled nothing.)

        The common row (a decode step of a request already decoding, no stop strings) costs a few
        attribute updates and one list append; events and text are made when someone reads them.
        """
        self.num_steps += 1
        self._steps.append((t0, t1, len(out.sampled), out.kind))
        for log in self._collectors:
            log.append(out.record)
        self.scheduler.step_log.clear()       # the collectors hold the records a caller asked for
        for request_id in out.preempted:
            handle = self._handles[request_id]
            handle.num_preemptions += 1
            handle.prefilled_tokens = 0
            if not handle.num_generated:      # its prompt is computed again from position 0
                handle.reused_tokens = 0
            handle.enter("preempted", t0)
        finished = {r.request_id: r for r in out.finished}
        final_text: dict[int, str] = {}
        for row in out.rows:
            handle = self._handles[row.request_id]
            if handle.state == "decode" and not row.prefill:
                continue                      # decoding on: its state and prompt progress stay as they are
            handle.enter("prefill" if row.prefill else "decode", t0)
            if row.admitted:                  # a first row starts after the prefix reused from the session
                handle.reused_tokens = row.start_pos
            prompt_len = len(handle.prompt_token_ids)
            handle.prefilled_tokens = prompt_len if row.samples else min(row.end_pos, prompt_len)
        delivered: list[tuple[RequestHandle, int, str | None]] = []   # (handle, token, text: stop strings only)
        count: dict[int, int] = {}            # tokens per request this step (a verify row yields several)
        for request_id, _ in out.sampled:
            count[request_id] = count.get(request_id, 0) + 1
        final_new = {rid: count.get(rid, 0) for rid in finished}   # this step's tokens of its final event
        seen: dict[int, int] = {}
        for request_id, token in out.sampled:
            handle = self._handles[request_id]
            seen[request_id] = seen.get(request_id, 0) + 1
            if handle.first_token_at is None:
                handle.first_token_at = t1
                self._ttft.append(t1 - handle.submitted_at)
            if request_id in finished:        # (the scheduler finished it, or a stop string did just now)
                continue
            handle.num_generated += 1
            text = None
            if request_id in self._stops:
                text = self._stop_text(request_id, [token], final=False)
                if self._stops[request_id].stopped:     # its text reached a stop string: it ends here
                    handle.num_generated -= 1           # (counted again below, with the final event's token)
                    result = self.scheduler.cancel(request_id)
                    result.finish_reason = "stop"
                    later = count[request_id] - seen[request_id]
                    if later:                           # a verify row's later tokens come after the stop
                        del result.token_ids[-later:]
                    finished[request_id], final_text[request_id] = result, text
                    final_new[request_id] = 1
                    continue
            handle.enter("decode", t1)
            delivered.append((handle, token, text))
        for request_id, n in final_new.items():
            self._handles[request_id].num_generated += n
        self.tokens_generated += len(out.sampled)
        for request_id, entry in out.logprobs.items():    # one per step: such a request gets no verify row
            if request_id in self._logprobs:
                self._logprobs[request_id].append(entry)
        with self.hub.publish():
            for handle, token, text in delivered:
                lp = self._logprobs.get(handle.request_id)
                handle.deliver([token], None if text is None else [text], None if lp is None else lp[-1:])
        self._finish(list(finished.values()), sampled_now=final_new, at=t1, final_text=final_text)

    def _stop_text(self, request_id: int, tokens: list[int], final: bool) -> str:
        """New text of a request with stop strings: UTF-8 safe, and never past (or into) a stop string."""
        detok = self._detok[request_id]
        piece = "".join(detok.push(t) for t in tokens) + (detok.flush() if final else "")
        stop = self._stops[request_id]
        shown = stop.push(piece)
        return shown + stop.flush() if final else shown

    def _finish(self, results, sampled_now: dict[int, int] | None = None, at: float | None = None,
                final_text: dict[int, str] | None = None) -> None:
        """Deliver final events and outputs; sampled_now[request id]: how many of its last tokens came
        this step (they go into the final event: one, or several from a verify row); `final_text` holds
        that event's text where it is known already (a stop string ended the request)."""
        if not results:
            return
        at = time.monotonic() if at is None else at
        ended = []
        for result in results:
            request_id = result.request_id
            handle = self._handles.pop(request_id)
            self._seeds.pop(request_id, None)
            n = (sampled_now or {}).get(request_id, 0)
            new = result.token_ids[len(result.token_ids) - n:] if n else []
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
            handle.enter("finished", at)
            self._recent.append(handle)
            lp = self._logprobs.pop(request_id, None)
            ended.append((handle, (new, text, result.finish_reason),
                          RequestOutput(result.prompt_ids, result.token_ids, full, result.finish_reason,
                                        None if lp is None else lp[:len(result.token_ids)])))
        with self.hub.publish():
            for handle, end, output in ended:
                handle.finish(end, output)

    def _fail(self, handle: RequestHandle, error: BaseException) -> None:
        self._handles.pop(handle.request_id, None)
        self._logprobs.pop(handle.request_id, None)
        self._detok.pop(handle.request_id, None)
        self._stops.pop(handle.request_id, None)
        self._seeds.pop(handle.request_id, None)
        handle.finished_at = time.monotonic()
        handle.enter("finished", handle.finished_at)
        self._recent.append(handle)
        with self.hub.publish():
            handle.fail(error)

    def _fail_all(self, error: BaseException) -> None:
        for handle in list(self._handles.values()):
            self._fail(handle, error)

    def _serve_stats(self) -> None:
        with self._cv:
            if self._stats_wanted > self._stats_served:
                self._stats = self._build_stats()
                self._stats_served = self._stats_wanted
                self._cv.notify_all()

    def _speculative_stats(self, snap: dict) -> dict:
        """Proposed and accepted guesses; mean tokens a verify row yields (accepted + the model's own)."""
        spec = self.engine_config.speculative
        drafted, accepted, rows = snap.get("draft_tokens", 0), snap.get("accepted_tokens", 0), snap.get("verify_rows", 0)
        return {"enabled": spec is not None, "method": spec.describe() if spec else None,
                "draft_tokens": drafted, "accepted_tokens": accepted, "verify_rows": rows,
                "acceptance_rate": accepted / drafted if drafted else 0.0,
                "mean_accepted_length": (accepted + rows) / rows if rows else 0.0}

    def _build_stats(self) -> dict:
        """Plain data: counts, the page map, per-request timelines, time to first token, throughput."""
        snap = self.scheduler.snapshot()
        # -1 free, -2 free but holding a cached prefix, else a request id (of a shared page: the
        # oldest request that holds it)
        owners = [-1] * snap["num_pages"]
        for page in snap["cached_pages"]:
            owners[page] = -2
        for request_id, table in sorted(snap["page_tables"].items(), reverse=True):
            for page in table:
                owners[page] = request_id
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
            "pages_cached": len(snap["cached_pages"]),
            "pages_shared": snap["shared_pages"],
            "speculative": self._speculative_stats(snap),
            "prefix_cache": {"enabled": snap["prefix_caching"], "lookup_tokens": snap["lookup_tokens"],
                             "hit_tokens": snap["hit_tokens"],
                             "hit_rate": snap["hit_tokens"] / snap["lookup_tokens"] if snap["lookup_tokens"] else 0.0},
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
