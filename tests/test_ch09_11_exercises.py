"""The chapter 09-11 checkers accept a correct solution, reject the usual mistakes (naming them where
they have a hint) and report an unattempted exercise as such. The solutions are written from the
chapter's rules, like a learner would, not imported from the engine."""
from __future__ import annotations

import math

import numpy as np
import pytest
from helpers.exercises import accepts, not_attempted, rejects, verdict  # noqa: E402

from engine.exercises import ch09, ch10, ch11

# ----------------------------------------------------------------------------- chapter 09

def pad_tokens(lens, batch_size):
    total = 0
    for i in range(0, len(lens), batch_size):
        batch = lens[i:i + batch_size]
        total += sum(max(batch) - n for n in batch)
    return total


def static_decode_cost(max_new, batch_size):
    steps = idle = 0
    for i in range(0, len(max_new), batch_size):
        group = max_new[i:i + batch_size]
        steps += max(group) - 1                      # token 1 comes from the prefill
        idle += sum(max(group) - n for n in group)   # a finished member's seat until the group ends
    return steps, idle


def slot_cache_bytes(config, num_slots, max_context, bytes_per_value):
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * bytes_per_value
    return num_slots * max_context * per_token


def test_ch09_checkers(capsys):
    accepts(ch09.check_pad_tokens, pad_tokens, capsys)
    rejects(ch09.check_pad_tokens, lambda lens, b: len(lens) * max(lens) - sum(lens), capsys, "whole workload")
    rejects(ch09.check_pad_tokens, lambda lens, b: pad_tokens(lens, b) + sum(lens), capsys, "count only the pads")
    accepts(ch09.check_static_decode_cost, static_decode_cost, capsys)
    rejects(ch09.check_static_decode_cost, lambda m, b: (static_decode_cost(m, b)[0] + math.ceil(len(m) / b),
                                                         static_decode_cost(m, b)[1]), capsys, "prefill")
    rejects(ch09.check_static_decode_cost, lambda m, b: (len(m) * max(m), 0), capsys)
    accepts(ch09.check_slot_cache_bytes, slot_cache_bytes, capsys)
    rejects(ch09.check_slot_cache_bytes,
            lambda c, s, t, b: 2 * c.num_hidden_layers * c.num_attention_heads * c.head_dim * b * s * t,
            capsys, "num_key_value_heads")
    rejects(ch09.check_slot_cache_bytes, lambda c, s, t, b: slot_cache_bytes(c, s, t, b) // 2, capsys, "only K")


def test_run_scheduler_arrivals_and_refusals():
    log = ch09.run_scheduler([3, 2], [2, 2], policy="continuous", max_seqs=2, arrivals=[0, 1])
    assert [(e["kind"], e["request_ids"], e["arrived"]) for e in log] == [
        ("prefill", [0], [0]), ("prefill", [1], [1]), ("decode", [0, 1], [])]
    # nothing runs between request 0's end and request 1's arrival: it is submitted at once
    log = ch09.run_scheduler([3, 2], [1, 1], policy="continuous", max_seqs=2, arrivals=[0, 50])
    assert [e["arrived"] for e in log] == [[0], [1]]
    with pytest.raises(ValueError, match="non-decreasing"):
        ch09.run_scheduler([3, 2], [1, 1], policy="static", max_seqs=1, arrivals=[2, 0])


# ----------------------------------------------------------------------------- chapter 10

HAND = {"continuous": [("prefill", [0, 1]), ("prefill", [2, 3]), ("decode", [0, 2, 3]),
                       ("prefill", [4]), ("decode", [0, 4])],
        "static": [("prefill", [0, 1]), ("prefill", [2]), ("decode", [0, 2]), ("decode", [0]),
                   ("prefill", [3, 4]), ("decode", [3, 4])]}


def simulate(max_new, max_seqs, policy):
    """Every request waiting at step 0; only max_seqs limits a batch."""
    waiting = list(range(len(max_new)))
    left = {}                                    # running request -> tokens still to generate
    timeline = []
    while waiting or left:
        seats = max_seqs - len(left) if policy == "continuous" else (0 if left else max_seqs)
        if waiting and seats > 0:                # prefill first
            rows, waiting = waiting[:seats], waiting[seats:]
            timeline.append(("prefill", rows))
            left.update((r, max_new[r] - 1) for r in rows)
        else:
            rows = list(left)
            timeline.append(("decode", rows))
            for r in rows:
                left[r] -= 1
        left = {r: n for r, n in left.items() if n > 0}
    return timeline


def latencies(step_log):
    arrival, first, out = {}, {}, {}
    for s, e in enumerate(step_log):
        arrival.update((r, s) for r in e["arrived"])
        for r in e["request_ids"]:
            first.setdefault(r, s)
        for r in e["finished"]:
            out[r] = (first[r] - arrival[r] + 1, s - arrival[r] + 1)
    return out


def test_ch10_checkers(capsys):
    accepts(ch10.check_hand_timeline, HAND.get, capsys, "continuous")
    accepts(ch10.check_hand_timeline, HAND.get, capsys, "static")
    rejects(ch10.check_hand_timeline, lambda p: HAND["static"], capsys, "step 1", "continuous")
    rejects(ch10.check_hand_timeline, lambda p: HAND[p][:-1], capsys, "you listed 4 steps", "continuous")
    rejects(ch10.check_hand_timeline, lambda p: 42, capsys, "list of (kind", "continuous")
    assert ch10.check_hand_timeline(not_attempted) is False and verdict(capsys).startswith("[ ]")

    accepts(ch10.check_simulate, simulate, capsys)
    # decode first (admitting only when nothing can decode) is a different policy
    rejects(ch10.check_simulate, lambda m, s, p: simulate(m, s, "static"), capsys, "policy='continuous'")
    rejects(ch10.check_simulate, lambda m, s, p: simulate(m, s, "continuous"), capsys, "policy='static'")

    accepts(ch10.check_latencies, latencies, capsys)
    rejects(ch10.check_latencies, lambda log: {k: (a - 1, b - 1) for k, (a, b) in latencies(log).items()},
            capsys, "not counted")
    assert ch10.check_latencies(not_attempted) is False and verdict(capsys).startswith("[ ]")


# ----------------------------------------------------------------------------- chapter 11

def slot_of(page_table, position, page_size):
    return page_table[position // page_size] * page_size + position % page_size


def pages_needed(prompt_len, max_new, page_size, max_context):
    cached = min(prompt_len + max_new, max_context) - 1     # the last sampled token is never cached
    return -(-cached // page_size)


def online_update(m, l, acc, s, v):
    m_new = max(m, s)
    scale = math.exp(m - m_new)
    p = math.exp(s - m_new)
    return m_new, l * scale + p, acc * scale + p * v


def merge(a, b):
    m = max(a[0], b[0])
    if m == -math.inf:
        return a
    wa, wb = math.exp(a[0] - m), math.exp(b[0] - m)
    return m, a[1] * wa + b[1] * wb, a[2] * wa + b[2] * wb


def test_ch11_checkers(capsys):
    accepts(ch11.check_slot_of, slot_of, capsys)
    rejects(ch11.check_slot_of, lambda t, p, bs: p, capsys, "contiguous")
    rejects(ch11.check_slot_of, lambda t, p, bs: t[p // bs] + p % bs, capsys, "multiplied")

    accepts(ch11.check_pages_needed, pages_needed, capsys)
    rejects(ch11.check_pages_needed, lambda p, n, ps, c: -(-min(p + n, c) // ps), capsys, "never written")
    rejects(ch11.check_pages_needed, lambda p, n, ps, c: -(-(p + n - 1) // ps), capsys, "max_context")
    rejects(ch11.check_pages_needed, lambda p, n, ps, c: (min(p + n, c) - 1) // ps, capsys, "rounds down")

    accepts(ch11.check_online_update, online_update, capsys)
    def no_rescale(m, l, acc, s, v):
        return (max(m, s), online_update(m, l, acc, s, v)[1],
                                              acc + math.exp(s - max(m, s)) * v)
    rejects(ch11.check_online_update, no_rescale, capsys, "acc was not rescaled")
    rejects(ch11.check_online_update, lambda m, l, acc, s, v: (max(m, s), l + math.exp(s), acc + math.exp(s) * v),
            capsys, "running max")
    assert ch11.check_online_update(not_attempted) is False and verdict(capsys).startswith("[ ]")

    accepts(ch11.check_merge, merge, capsys)
    rejects(ch11.check_merge, lambda a, b: (max(a[0], b[0]), a[1] + b[1], a[2] + b[2]), capsys, "rescaling")

    def unguarded(a, b):
        m = max(a[0], b[0])
        with np.errstate(invalid="ignore"):
            wa, wb = np.exp(a[0] - m), np.exp(b[0] - m)
        return m, a[1] * wa + b[1] * wb, a[2] * wa + b[2] * wb
    rejects(ch11.check_merge, unguarded, capsys, "both states are empty")
