"""Chapter 10 exercises: predict the scheduler's timeline by hand, write the policies as a tiny
simulator, read latencies off a step log, and write the scheduler's decisions yourself
(SchedulerSkeleton), which then runs engine.LLM. Every expected answer comes from the real Scheduler
(driven by engine.exercises.ch09.run_scheduler), not from a second implementation."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from engine.exercises import call_learner, check_cases
from engine.exercises.ch09 import NoProgress, run_scheduler, timeline_of
from engine.exercises.serving_check import (
    check_llm_with,
    compare_step_logs,
    tiny_model_dir,
)
from engine.runtime.kv_allocator import PageAllocator
from engine.runtime.sampling_params import SamplingParams
from engine.runtime.scheduler import Scheduler
from engine.runtime.step_log import request_latencies

# The workload of the by-hand exercise: request i has prompt_lens[i] prompt tokens, generates
# max_new[i] tokens (eos never stops it) and is submitted after arrivals[i] steps have run.
HAND_WORKLOAD: dict[str, Any] = dict(prompt_lens=[3, 2, 6, 1, 4], max_new=[3, 1, 2, 2, 2], arrivals=[0, 0, 0, 0, 3],
                                     max_seqs=3, max_batch_tokens=8)


def _normalize(timeline) -> list[tuple[str, list[int]]]:
    return [(str(kind), [int(r) for r in ids]) for kind, ids in timeline]


def _first_difference(title: str, got, want, step_log, context: str) -> bool:
    """Print the first step where got and want differ (with the scheduler's state there)."""
    try:
        got = _normalize(got)
    except (TypeError, ValueError):
        print(f"[x] {title}{context}: return a list of (kind, [request ids]) pairs, got {got!r}")
        return False
    for s, (mine, real) in enumerate(zip(got, want, strict=False)):
        if mine != real:
            e = step_log[s]
            print(f"[x] {title}{context}: step {s}: you said {mine[0]} {mine[1]}, the scheduler ran "
                  f"{real[0]} {real[1]} (before it: {e['waiting'] + len(e['admitted'])} waiting, "
                  f"{e['running'] - len(e['admitted'])} running; after it finished: {e['finished']})")
            return False
    if len(got) != len(want):
        print(f"[x] {title}{context}: you listed {len(got)} steps, the scheduler ran {len(want)} "
              f"(its first {min(len(got), len(want))} steps agree with yours)")
        return False
    return True


def check_hand_timeline(fn: Callable[[str], list], policy: str = "continuous") -> bool:
    """fn(policy) -> your timeline of HAND_WORKLOAD under that policy: [(kind, [ids]), ...]."""
    log = run_scheduler(**HAND_WORKLOAD, policy=policy)
    title = f"hand_timeline ({policy})"
    ok, got = call_learner(title, f"{getattr(fn, '__name__', 'fn')}({policy!r})", fn, policy)
    if not ok:
        return False
    if not _first_difference(title, got, timeline_of(log), log, ""):
        return False
    print(f"[OK] {title}: all {len(log)} steps match the scheduler's")
    return True


def _random_workloads(seed: int):
    rng = np.random.default_rng(seed)
    yield [3, 1, 2], 2
    yield [1, 1, 1, 1], 2
    yield [4], 1
    for _ in range(40):
        n = int(rng.integers(1, 10))
        yield rng.integers(1, 9, n).tolist(), int(rng.integers(1, 5))


def check_simulate(fn: Callable[[list, int, str], list]) -> bool:
    """fn(max_new per request, max_seqs, policy) -> the timeline [(kind, [ids]), ...] when every
    request arrives at once and nothing but max_seqs limits a batch (no token budget, memory enough)."""
    title = "simulate"
    count = 0
    for policy in ("continuous", "static"):
        for max_new, max_seqs in _random_workloads(11):
            log = run_scheduler([4] * len(max_new), max_new, policy=policy, max_seqs=max_seqs)
            context = f" (max_new={max_new}, max_seqs={max_seqs}, policy={policy!r})"
            ok, got = call_learner(title, f"{getattr(fn, '__name__', 'fn')}{context}", fn,
                                   list(max_new), max_seqs, policy)
            if not ok:
                return False
            if not _first_difference(title, got, timeline_of(log), log, context):
                return False
            count += 1
    print(f"[OK] {title}: all {count} workloads match the scheduler's timelines")
    return True


def check_latencies(fn: Callable[[list], dict]) -> bool:
    """fn(step_log) -> {request id: (steps to first token, steps to finish)}, counted from the start
    of the step a request arrived before, up to and including the step that produced the token."""
    logs = [run_scheduler(**HAND_WORKLOAD, policy=policy) for policy in ("continuous", "static")]
    rng = np.random.default_rng(12)
    for policy in ("continuous", "static"):
        n = 12
        arrivals = np.sort(rng.integers(0, 30, n)).tolist()
        logs.append(run_scheduler(rng.integers(1, 20, n).tolist(), rng.integers(1, 15, n).tolist(),
                                  policy=policy, max_seqs=3, arrivals=arrivals))

    def as_ints(d):
        return {int(k): tuple(int(x) for x in v) for k, v in d.items()}

    def first_step(log):
        firsts = {}
        for s, e in enumerate(log):
            for rid in e["request_ids"]:
                firsts.setdefault(rid, s)
        return firsts

    def finish_step(log):
        return {rid: s for s, e in enumerate(log) for rid in e["finished"]}

    hints = [("the step that produced the token was not counted (add 1)",
              lambda log: {k: (a - 1, b - 1) for k, (a, b) in as_ints(request_latencies(log)).items()}),
             ("the times were counted from step 0 instead of from each request's arrival",
              lambda log: {k: (first_step(log)[k] + 1, finish_step(log)[k] + 1) for k in finish_step(log)})]
    cases = [((_Log(log),), as_ints(request_latencies(log))) for log in logs]

    def same(got, want):
        try:
            return as_ints(got) == want
        except (TypeError, ValueError, AttributeError):
            return False
    return check_cases("latencies", fn, cases, hints=hints, same=same)


class _Log(list):
    """A step log that prints as one short line in a checker's message."""

    def __repr__(self) -> str:
        return f"<step_log of {len(self)} steps>"


# ----------------------------------------------------------------------------- write schedule() yourself

class SchedulerSkeleton(Scheduler):
    """engine.runtime.scheduler.Scheduler (continuous batching) with its two decisions left to you.

    `schedule()` stays the engine's transaction (it saves the state so that a failed batch can be
    undone, numbers the batch and writes the step log); what goes into the batch is yours:

      admit_waiting() -> list[Row]
          A prefill batch. Take requests from the head of `self.waiting` (FIFO, no overtaking) while
          the head fits: a seat (len(self.running) < self.max_seqs), room in the token budget (the
          batch's tokens + its tokens <= self.max_batch_tokens; the first one always fits), pages for
          its tokens now (self.allocator.can_reserve(rid, n)), and with admission == "conservative"
          its worst case next to everyone's promised ones (self.promised_blocks() + worst_pages <=
          self.allocator.num_pages). Admit with self.admit(rid). Return [] when the head does not fit.
      decode_running() -> (list[Row], list[int])
          One decode row per running sequence, oldest first. Each needs room for one more token
          (self.allocator.can_reserve / reserve(rid, request.num_tokens)). While it does not fit,
          preempt the NEWEST running request not yet scheduled (self.preempt(rid)); if none is left,
          preempt the sequence itself. Return (self.decode_row(rid) for the scheduled ones, the
          preempted ids in preemption order).

    Tools: self.waiting (ids, head first), self.running (ids, oldest first), self.request(rid)
    (.num_tokens: prompt + generated, .worst_pages), self.allocator, self.admission.

    Chapter 10's schedule prefills whole prompts: chunked prefill (chapter 13) schedules differently,
    so the skeleton refuses chunked_prefill=True (engine.LLM(..., chunked_prefill=False)). The prefix
    cache (chapter 15) is not part of it either: every prompt is computed whole (prefix_caching=False).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.policy != "continuous":
            raise ValueError("the scheduler exercise is continuous batching: use policy='continuous'")
        if self.chunked_prefill:
            raise ValueError("the scheduler exercise prefills whole prompts: use chunked_prefill=False "
                             "(engine.LLM(..., chunked_prefill=False))")
        if getattr(self, "prefix_caching", False):
            raise ValueError("the scheduler exercise computes every prompt whole: use prefix_caching=False "
                             "(engine.LLM(..., prefix_caching=False))")

    # ---- yours -----------------------------------------------------------------------------------
    def admit_waiting(self) -> list:
        raise NotImplementedError

    def decode_running(self) -> tuple[list, list[int]]:
        raise NotImplementedError

    # ---- tools -----------------------------------------------------------------------------------
    @property
    def waiting(self):
        return self._waiting

    @property
    def running(self) -> list[int]:
        return self._running

    def request(self, request_id: int):
        return self._requests[request_id]

    def promised_blocks(self) -> int:
        """Pages promised to the running requests' worst cases (conservative admission)."""
        return sum(self._requests[rid].worst_pages for rid in self._running)

    def admit(self, request_id: int):
        """Move the head of the queue into the batch: reserve its pages, mark it running; its prefill Row."""
        if not self._waiting or self._waiting[0] != request_id:
            raise ValueError(f"admit the head of the waiting queue ({list(self._waiting)[:1]}), not {request_id}")
        request = self._requests[request_id]
        return self._start(request, [], None, request.num_tokens)   # no cached prefix: all of it computed

    def preempt(self, request_id: int) -> None:
        """Free its pages and put it back at the head of the queue (to be recomputed later)."""
        self._preempt(request_id)

    def decode_row(self, request_id: int):
        """The decode Row of a running request: its last token at position num_tokens - 1."""
        return self._reserve_row(self._requests[request_id], 1)

    # ---- the engine's schedule() calls these two (without chunked prefill) ---------------------------
    def _prefill_rows(self):
        return self.admit_waiting(), []

    def _decode_rows(self):
        return self.decode_running()


def _scheduler_workloads(seed: int):
    """Stand-in workloads: (prompt_lens, max_new, num_pages, page_size, max_seqs, budget, admission, arrivals)."""
    rng = np.random.default_rng(seed)
    yield [5, 3, 8], [4, 6, 2], 64, 4, 2, 100, "conservative", None
    yield [20, 20, 20], [30, 30, 30], 16, 4, 3, 100, "on_demand", None      # runs out: preemptions
    yield [4, 4, 4, 4], [40, 40, 40, 40], 12, 4, 4, 100, "on_demand", None  # four running when it runs out
    yield [4, 6, 2, 9, 3], [30, 9, 40, 25, 30], 12, 4, 5, 12, "on_demand", [0, 0, 1, 2, 2]
    for i in range(30):
        n = int(rng.integers(2, 8))
        admission = ("conservative", "on_demand")[i % 2]
        lens, news = rng.integers(1, 30, n).tolist(), rng.integers(1, 30, n).tolist()
        page_size = int(rng.choice([2, 4, 16]))
        pages = max(-(-(a + b) // page_size) for a, b in zip(lens, news, strict=True)) + int(rng.integers(0, 12))
        arrivals = np.sort(rng.integers(0, 20, n)).tolist()
        yield lens, news, pages, page_size, int(rng.integers(1, 5)), int(rng.integers(30, 80)), admission, arrivals


def check_scheduler(cls: type, model_dir=None) -> bool:
    """Your SchedulerSkeleton subclass makes the same decisions as the engine's Scheduler: first on ~30
    stand-in workloads (tight page pools, token budgets, late arrivals, preemptions), then inside
    engine.LLM on a tiny random model (chunked_prefill=False), where the tokens of every request must match too."""
    title = "scheduler"
    count = 0
    for lens, news, pages, page_size, max_seqs, budget, admission, arrivals in _scheduler_workloads(5):
        context = (f" (prompts {lens}, max_new {news}, {pages} pages of {page_size}, max_seqs={max_seqs}, "
                   f"budget={budget}, admission={admission!r}, arrivals={arrivals})")
        setup = dict(policy="continuous", max_seqs=max_seqs, max_batch_tokens=budget, arrivals=arrivals,
                     admission=admission)
        runs = [run_scheduler(lens, news, allocator=PageAllocator(pages, page_size), **setup)]
        try:   # yours may take a few more steps than the engine's before the comparison names it, not forever
            runs.append(run_scheduler(lens, news, allocator=PageAllocator(pages, page_size), scheduler_cls=cls,
                                      max_steps=4 * len(runs[0]) + 20, **setup))
        except NotImplementedError:
            print(f"[ ] {title}: not attempted yet (a method still raises NotImplementedError)")
            return False
        except NoProgress as e:
            print(f"[x] {title}{context}: your scheduler makes no progress: {e}. The engine's finished in "
                  f"{len(runs[0])} steps; its first steps: {_first_steps(runs[0])}")
            return False
        except Exception as e:  # the learner's bug, shown rather than raised
            print(f"[x] {title}: your scheduler raised {type(e).__name__}: {e}")
            return False
        if not compare_step_logs(title, runs[1], runs[0], context):
            return False
        count += 1
    print(f"[OK] {title}: the same step logs as the engine on all {count} stand-in workloads")
    return check_llm_with(title, model_dir or tiny_model_dir(), *_tiny_requests(), kv_cache_mib=0.05,
                          chunked_prefill=False, scheduler_cls=cls)


def _first_steps(log, n: int = 6) -> str:
    shown = ", ".join(f"{e['kind']} {list(e['request_ids'])}" + (f" preempting {list(e['preempted'])}" if e["preempted"] else "")
                      for e in log[:n])
    return shown + (", ..." if len(log) > n else "")


def _tiny_requests():
    rng = np.random.default_rng(7)
    prompts = [rng.integers(3, 390, int(n)).tolist() for n in (30, 12, 25, 40, 9)]
    params = [SamplingParams(max_new_tokens=int(n), ignore_eos=True) for n in (40, 30, 35, 20, 45)]
    return prompts, params
