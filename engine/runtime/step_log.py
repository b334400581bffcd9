"""The step log: one record per forward pass, written by the scheduler, read for telemetry.

`Scheduler.complete()` appends one `StepRecord` per step to `sched.step_log` (`llm.last_step_log`
after `LLM.generate`); a failed step leaves no record. The model runner adds `seconds` (wall time
of the step). The engine loop serves requests from complete()'s typed StepOutput, never from
these records: they are what plots, stats, benchmarks and exercise checkers read. Records are
plain dicts with the keys below, so a log can be saved as JSON and plotted later; the functions here
turn a log into the numbers that chapters, plots, benchmarks and exercise
checkers show. Nothing here needs matplotlib (engine/exercises/plots.py draws from these).

    summarize(log)             steps, tokens, idle slots, preemptions, seconds: one dict per run
    request_timelines(log)     request id -> its state at every step (the data behind a Gantt chart)
    request_latencies(log)     request id -> (time to first token, time to its last token)

Step states (request_timelines):
    waiting   arrived (or preempted) and not admitted yet
    prefill   in this step's batch, a prefill row (its prompt or a chunk of it, or prompt + generated
              after preemption)
    decode    in this step's batch, a decode row (one token)
    stalled   admitted, but this step's batch does not include it (a prefill batch of newcomers)
    idle      static batching: finished, but its seat stays taken until the whole group ends
The log does not record cancel(): pass `cancelled={request_id: len(sched.step_log) at the cancel}`
to end a cancelled request's timeline there.
"""
from __future__ import annotations

from typing import TypedDict

import numpy as np

STATES = ("waiting", "prefill", "decode", "stalled", "idle")


class _StepRecordRequired(TypedDict):
    step: int                   # index of this record in the log
    batch_id: int               # the scheduler's batch id (failed batches leave gaps)
    kind: str                   # "prefill" | "decode" | "mixed" (chunked prefill: both kinds of rows)
    request_ids: list[int]      # one per row, in row order
    start_positions: list[int]  # one per row: the position of its first token
    prefill_ids: list[int]      # the prefill rows' requests (a prompt, a chunk of one, or a recompute)
    chunks: list[list]          # [request id, start position, tokens, samples] of each prefill row that
                                # holds only part of its sequence (a chunk, or what follows a reused prefix)
    rows: int                   # sequences in the batch
    sampled: int                # rows that sampled a token (all but chunks that stop short of the prompt)
    sampled_ids: list[int]      # their requests, in row order, one entry per token (a verify row: several)
    sampled_tokens: list[int]   # the tokens they yielded, in the same order
    tokens: int                 # tokens fed this step (prompt tokens of prefill rows, 1 per decode row)
    prefill_tokens: int         # of which fed by prefill rows
    context_tokens: int         # tokens attended to after this step, summed over rows
    arrived: list[int]          # requests submitted since the previous record
    admitted: list[int]         # first admissions in this step (a request's first row, not after a preemption)
    recomputed_tokens: int      # tokens fed again because a preemption threw their K/V away
    lookup_tokens: int          # prefix caching: tokens of the requests admitted this step, looked up
    reused_tokens: int          # of which found in the prefix cache: not fed (0 without prefix caching)
    preempted: list[int]        # requests preempted while this batch was formed
    running: int                # running requests after admission
    waiting: int                # requests still waiting
    idle_slots: int             # static batching: finished members still holding a seat
    used_pages: int             # KV pages in some page table after this step's reservations
    free_pages: int             # KV pages on the free queue (cached ones included)
    cached_pages: int           # free pages still holding a cached prefix (evicted when taken)
    shared_pages: int           # pages in more than one page table
    cached_tokens: int          # tokens whose K/V sit in the cache after this step
    finished: list[int]         # requests that finished with this step's token


class StepRecord(_StepRecordRequired, total=False):
    seconds: float              # wall time of the step, added by the model runner
    draft_tokens: int           # speculative decoding: guesses fed by verify rows (chapter 16)
    accepted_tokens: int        # of which accepted
    discarded: list[int]        # async scheduling: requests that ended while the batch was in flight
                                # (their rows ran; the per-request lists above leave them out)


def x_edges(step_log, x: str) -> np.ndarray:
    """[steps + 1] where each step starts and ends on the x axis: step numbers or wall seconds."""
    if x == "step":
        return np.arange(len(step_log) + 1, dtype=float)
    if x == "seconds":
        if any("seconds" not in e for e in step_log):
            raise ValueError("x='seconds' needs a 'seconds' key in every step (engine.LLM adds it)")
        return np.concatenate([[0.0], np.cumsum([e["seconds"] for e in step_log])])
    raise ValueError(f"x must be 'step' or 'seconds', got {x!r}")


def request_timelines(step_log, cancelled: dict[int, int] | None = None) -> dict[int, list[str]]:
    """request id -> [state at step 0, step 1, ...]; "" before it arrived and after it left."""
    n = len(step_log)
    cancelled = cancelled or {}
    states: dict[int, list[str]] = {}
    status: dict[int, str] = {}      # before the step: "waiting" | "running" | "finished" | "gone"
    for s, entry in enumerate(step_log):
        for rid in entry["arrived"]:
            states[rid], status[rid] = [""] * n, "waiting"
        for rid in entry["preempted"]:      # preempted while this batch was formed
            status[rid] = "waiting"
        in_batch = set(entry["request_ids"])
        for rid in status:
            if cancelled.get(rid, n) <= s:
                status[rid] = "gone"
            if status[rid] == "finished":   # static: the seat is held while the group still runs
                status[rid] = "finished" if entry["idle_slots"] > 0 else "gone"
            if rid in in_batch:
                states[rid][s] = "prefill" if rid in entry["prefill_ids"] else "decode"
            else:
                states[rid][s] = {"waiting": "waiting", "running": "stalled",
                                  "finished": "idle", "gone": ""}[status[rid]]
        for rid in in_batch:
            status[rid] = "running"
        for rid in entry["finished"]:
            status[rid] = "finished"
    return states


def summarize(step_log) -> dict:
    """Totals of one run. Every sampling row samples one token (a chunk that stops short of its
    prompt's end samples none), so output tokens = sum of sampled rows."""
    decode = [e for e in step_log if e["kind"] == "decode"]
    out = {
        "steps": len(step_log),
        "prefill_steps": len(step_log) - len(decode),
        "decode_steps": len(decode),
        "output_tokens": sum(e["sampled"] for e in step_log),
        "prompt_tokens_computed": sum(e["prefill_tokens"] for e in step_log),
        "mean_decode_rows": float(np.mean([e["rows"] for e in decode])) if decode else 0.0,
        "idle_slot_steps": sum(e["idle_slots"] for e in step_log),
        "preemptions": sum(len(e["preempted"]) for e in step_log),
        "recomputed_tokens": sum(e["recomputed_tokens"] for e in step_log),
        "max_running": max((e["running"] for e in step_log), default=0),
    }
    if step_log and all("seconds" in e for e in step_log):
        out["seconds"] = float(sum(e["seconds"] for e in step_log))
        out["tokens_per_second"] = out["output_tokens"] / out["seconds"] if out["seconds"] else 0.0
    return out


def request_latencies(step_log, x: str = "step") -> dict[int, tuple[float, float]]:
    """request id -> (time to first token, time to its last token), both counted from the start of
    the step it arrived before to the end of the step that produced the token: in steps, or in
    wall seconds with x="seconds". Only requests that finished within the log are listed."""
    edges = x_edges(step_log, x)
    arrival: dict[int, int] = {}
    first: dict[int, int] = {}
    out = {}
    for s, entry in enumerate(step_log):
        for rid in entry["arrived"]:
            arrival[rid] = s
        for rid in entry["request_ids"]:
            first.setdefault(rid, s)
        for rid in entry["finished"]:
            a = edges[arrival[rid]]
            out[rid] = (float(edges[first[rid] + 1] - a), float(edges[s + 1] - a))
    return dict(sorted(out.items()))
