"""Chapter 10 exercises: predict the scheduler's timeline by hand, write the policies as a tiny
simulator, and read latencies off a step log. Every expected answer comes from the real Scheduler
(driven by engine.exercises.ch09.run_scheduler), not from a second implementation."""
from __future__ import annotations

from typing import Callable

import numpy as np

from engine.exercises import call_learner, check_cases
from engine.exercises.ch09 import run_scheduler
from engine.step_log import request_latencies

# The workload of the by-hand exercise: request i has prompt_lens[i] prompt tokens, generates
# max_new[i] tokens (eos never stops it) and is submitted after arrivals[i] steps have run.
HAND_WORKLOAD = dict(prompt_lens=[3, 2, 6, 1, 4], max_new=[3, 1, 2, 2, 2], arrivals=[0, 0, 0, 0, 3],
                     max_seqs=3, max_batch_tokens=8)


def timeline_of(step_log) -> list[tuple[str, list[int]]]:
    """[(kind, request ids in the batch), ...], one entry per step."""
    return [(e["kind"], list(e["request_ids"])) for e in step_log]


def _normalize(timeline) -> list[tuple[str, list[int]]]:
    return [(str(kind), [int(r) for r in ids]) for kind, ids in timeline]


def _first_difference(title: str, got, want, step_log, context: str) -> bool:
    """Print the first step where got and want differ (with the scheduler's state there)."""
    try:
        got = _normalize(got)
    except (TypeError, ValueError):
        print(f"[x] {title}{context}: return a list of (kind, [request ids]) pairs, got {got!r}")
        return False
    for s, (mine, real) in enumerate(zip(got, want)):
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
