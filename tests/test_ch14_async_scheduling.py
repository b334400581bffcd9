"""Async scheduling (chapter 14): the scheduler forms batch N+1 while batch N is still on the device.

The device is simulated by a fake model over a fake cache: each batch "runs" when it is launched
(right after schedule(), in launch order, as on one CUDA stream), writes its tokens into their slots
and reads every sampling row's context back through its page table. A PENDING token is taken from
the samples of the batch in flight, as the runner does on the GPU. complete() comes one batch late.
Every request must end exactly as it would running alone; cancels and aborted batches end requests
early with a prefix of that.
"""
from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from test_ch09_11_scheduler import EOS, VOCAB, fake_next_token, params, run_alone, setups, tight_pool_setup

from engine.runtime.kv_allocator import PageAllocator, SlotAllocator
from engine.runtime.scheduler import PENDING, Scheduler, SchedulerError


def run_on_device(batch, cache: dict, previous) -> list[int]:
    """The batch's sampled tokens; PENDING inputs come from `previous` = (batch, its samples)."""
    tokens = batch.token_ids.copy()
    if batch.pending_indices.size:
        prev_batch, prev_sampled = previous
        by_request = dict(zip([r.request_id for r in prev_batch.rows if r.samples], prev_sampled, strict=True))
        row_of_token = np.repeat(np.arange(len(batch.rows)), batch.lengths)
        for i in batch.pending_indices:
            tokens[i] = by_request[batch.rows[row_of_token[i]].request_id]
    assert (tokens != PENDING).all()
    for slot, token in zip(batch.slot_mapping.tolist(), tokens.tolist(), strict=True):
        cache[slot] = token
    size = batch.page_size
    return [fake_next_token([cache[row.page_table[p // size] * size + p % size] for p in range(row.context_len)])
            for row in batch.rows if row.samples]


def simulate_async(setup, cancel_rate=0.0, abort_rate=0.0, clients=0):
    """Run a workload with a batch always in flight; `clients` > 0: each request names one of that many
    clients (fair seats may then preempt, whatever the admission)."""
    pool = setup["allocator"]
    sched = Scheduler(pool, setup["max_seqs"], setup["max_batch_tokens"], setup["max_context"],
                      eos_token_ids=[EOS], policy=setup["policy"], admission=setup["admission"],
                      chunked_prefill=setup.get("chunked", False), async_scheduling=True)
    rng = random.Random(setup["seed"])
    arrivals = sorted(((step, [rng.randrange(1, VOCAB) for _ in range(n)], params(new, ign))
                       for step, n, new, ign in setup["requests"]), key=lambda a: a[0])
    prompts, results, cache, log = {}, {}, {}, []
    in_flight, step, lookaheads, declined = None, 0, 0, 0
    group, group_decoded, admitted_once = set(), False, set()     # static batching's current group
    while arrivals or sched.has_unfinished() or in_flight:
        while arrivals and arrivals[0][0] <= step:
            _, prompt, p = arrivals.pop(0)
            try:
                named = {"client": rng.randrange(clients)} if clients else {}
                prompts[sched.submit(prompt, p, **named)] = (prompt, p)
            except ValueError:
                pass
        live = sched.snapshot()["waiting"] + sched.snapshot()["running"]
        if live and rng.random() < cancel_rate:          # allowed while a batch is in flight
            victim = rng.choice(live)
            results[victim] = sched.cancel(victim)
            assert results[victim].finish_reason == "cancelled"
        step += 1
        batch = sched.schedule()
        if batch is not None and setup["policy"] == "static":
            if not any(sched.is_live(m) for m in group):
                group, group_decoded = set(), False
            new = {r.request_id for r in batch.rows if r.kind == "prefill" and r.start_pos == 0} - admitted_once
            assert not (new and group_decoded), "static admitted a newcomer while its group was decoding"
            group, admitted_once = group | new, admitted_once | new
            group_decoded |= any(r.kind == "decode" for r in batch.rows)
        if batch is not None:
            lookaheads += in_flight is not None
            sampled = run_on_device(batch, cache, in_flight)
            if rng.random() < abort_rate:                # e.g. its launch raised: its requests end
                for result in sched.abort(batch.batch_id):
                    results[result.request_id] = result
                batch = None
        elif in_flight is not None and sched.has_unfinished():
            declined += 1
        finished = sched.pop_finished()              # max_new_tokens == 0: at submit
        if in_flight is not None:
            finished += sched.complete(in_flight[0].batch_id, in_flight[1]).finished
            pool.check_invariants()
        for result in finished:
            results[result.request_id] = result
        in_flight = (batch, sampled) if batch is not None else None
        assert step < 10_000, "no progress"
        log += sched.step_log
        sched.step_log.clear()
    assert sorted(results) == sorted(prompts)
    for rid, (prompt, p) in prompts.items():
        expected = run_alone(prompt, p, setup["max_context"])
        if results[rid].finish_reason == "cancelled":
            assert results[rid].token_ids == expected[0][:len(results[rid].token_ids)]
        else:
            assert (results[rid].token_ids, results[rid].finish_reason) == expected
    assert pool.num_free == pool.num_pages and not sched.has_unfinished()
    # the log hands out exactly the tokens the results hold (discarded rows' tokens are not in it)
    handed = {}
    assert [entry["step"] for entry in log] == list(range(len(log)))
    arrived = [rid for entry in log for rid in entry["arrived"]]
    assert len(arrived) == len(set(arrived))
    for entry in log:
        assert len(entry["sampled_ids"]) == len(entry["sampled_tokens"]) == entry["sampled"]
        assert not set(entry.get("discarded", ())) & set(entry["request_ids"])
        for rid, token in zip(entry["sampled_ids"], entry["sampled_tokens"], strict=True):
            handed.setdefault(rid, []).append(token)
    for rid, result in results.items():
        assert handed.get(rid, []) == result.token_ids
    if setup["admission"] == "conservative" and not clients:
        assert sched.num_preemptions == 0
    return results, log, lookaheads, declined


def fresh(setup):
    pool = setup["allocator"]
    copy = (PageAllocator(pool.num_pages, pool.page_size) if isinstance(pool, PageAllocator)
            else SlotAllocator(pool.num_pages, pool.page_size))
    return dict(setup, allocator=copy)


@pytest.mark.slow
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(setup=setups())
def test_random_workloads_with_a_batch_always_in_flight_match_running_alone(setup):
    simulate_async(setup)


@pytest.mark.slow
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(setup=setups())
def test_cancels_and_aborted_batches_end_requests_with_a_prefix_of_their_output(setup):
    simulate_async(fresh(setup), cancel_rate=0.1, abort_rate=0.1)


def test_tight_pools_decline_the_lookahead_instead_of_preempting():
    """On demand over pools a few requests wide: a lookahead that would preempt returns None, the
    batch in flight completes, and the next schedule() (nothing in flight) preempts as usual."""
    rng = random.Random(7)
    lookaheads = declined = preempted = 0
    for seed in range(30):
        setup = tight_pool_setup(rng, seed)
        _, log, ahead, down = simulate_async(setup, cancel_rate=0.05)
        lookaheads, declined = lookaheads + ahead, declined + down
        preempted += sum(len(entry["preempted"]) for entry in log)
    # 956 lookaheads, 174 declined, 104 preemptions with these seeds
    assert lookaheads > 500 and declined > 50 and preempted > 50


def test_a_decode_batch_feeds_pending_tokens_and_finishes_by_length_without_a_spare_row():
    sched = Scheduler(PageAllocator(8, 4), 4, 16, 32, eos_token_ids=[EOS], async_scheduling=True)
    a, b = sched.submit([1, 2, 3], params(2)), sched.submit([4, 5], params(3))
    first = sched.schedule()                                   # both prompts
    second = sched.schedule()                                  # lookahead: both decode a pending token
    assert [r.token_ids for r in second.rows] == [[PENDING], [PENDING]]
    assert [r.start_pos for r in second.rows] == [3, 2] and second.kind == "decode"
    assert second.pending_indices.tolist() == [0, 1]
    with pytest.raises(SchedulerError):                        # two in flight at most
        sched.schedule()
    sched.complete(first.batch_id, [7, 8])
    third = sched.schedule()                                   # a's second token is its last: no row
    assert [r.request_id for r in third.rows] == [b] and third.rows[0].token_ids == [PENDING]
    with pytest.raises(SchedulerError):                        # batches complete in order
        sched.complete(third.batch_id, [9])
    out = sched.complete(second.batch_id, [9, 10])
    assert [(r.request_id, r.token_ids) for r in out.finished] == [(a, [7, 9])]
    out = sched.complete(third.batch_id, [11])
    assert [(r.request_id, r.token_ids) for r in out.finished] == [(b, [8, 10, 11])]
    assert out.sampled == [(b, 11)] and [(row.request_id, row.start_pos) for row in out.rows] == [(b, 3)]
    assert sched.allocator.num_free == 8 and sched.schedule() is None


def test_eos_discards_the_row_already_in_flight_and_fail_is_refused():
    sched = Scheduler(PageAllocator(8, 4), 4, 16, 32, eos_token_ids=[EOS], async_scheduling=True)
    a = sched.submit([1, 2, 3], params(10, ignore_eos=False))
    first = sched.schedule()
    second = sched.schedule()
    with pytest.raises(SchedulerError):
        sched.fail(second.batch_id)
    out = sched.complete(first.batch_id, [EOS])
    assert [(r.request_id, r.token_ids, r.finish_reason) for r in out.finished] == [(a, [EOS], "stop")]
    out = sched.complete(second.batch_id, [5])                 # its row ran, its token is dropped
    entry = sched.step_log[-1]
    assert entry["discarded"] == [a] and entry["sampled_ids"] == [] and entry["rows"] == 1
    assert out.finished == out.sampled == out.rows == [] and out.record is entry
    assert sched.pop_finished() == [] and sched.allocator.num_free == 8


def test_a_page_whose_last_token_is_pending_is_named_once_it_is_known():
    """Prefix caching names a page as the row that writes it forms, if its tokens are known; a
    lookahead decode row writes a PENDING token, so the page it fills is named when the step that
    sampled that token completes."""
    sched = Scheduler(PageAllocator(8, 4), 4, 16, 32, eos_token_ids=[EOS], async_scheduling=True,
                      prefix_caching=True)
    sched.submit([1, 2, 3], params(10, ignore_eos=False))
    first = sched.schedule()
    second = sched.schedule()                                  # feeds first's pending token at 3
    assert sched.allocator.snapshot()["keys"] == {}            # page 0 is full, its last token unknown
    sched.complete(first.batch_id, [7])
    assert sched.allocator.snapshot()["keys"] == {}            # first's row filled 3 positions only
    sched.complete(second.batch_id, [EOS])                     # page 0 (1 2 3 7) is named now
    assert list(sched.allocator.snapshot()["keys"]) == first.rows[0].page_table[:1]
    nxt = sched.submit([1, 2, 3, 7, 9], params(1))
    batch = sched.schedule()
    assert batch.rows[0].request_id == nxt and batch.rows[0].start_pos == 4   # page 0 only


def test_a_preempted_request_cancelled_before_its_batch_completes_leaves_the_log():
    """The preempting batch is scheduled with nothing in flight but completed one iteration later; a
    victim cancelled in between is no longer named in its record (the engine loop looks each one up)."""
    sched = Scheduler(PageAllocator(6, 4), 4, 64, 64, admission="on_demand", async_scheduling=True)
    ids = [sched.submit(list(range(1, 10)), params(12)) for _ in range(2)]
    previous, victim = None, None
    for _ in range(40):
        batch = sched.schedule()
        if previous is not None:
            sched.complete(previous.batch_id, [5] * sum(r.samples for r in previous.rows))
        if batch is None:
            previous = None
            continue
        preempted = sched._in_flight[batch.batch_id].log_entry["preempted"]
        if preempted:
            victim = preempted[0]
            sched.cancel(victim)
            sched.complete(batch.batch_id, [5] * sum(r.samples for r in batch.rows))
            break
        previous = batch
    assert victim in ids and victim not in sched.step_log[-1]["preempted"]


def test_an_aborted_chunk_leaves_no_key_behind():
    sched = Scheduler(PageAllocator(16, 4), 4, 4, 64, chunked_prefill=True, async_scheduling=True,
                      prefix_caching=True)
    prompt = list(range(1, 14))
    sched.submit(prompt, params(4))
    first = sched.schedule()                     # the first chunk of 4 tokens
    second = sched.schedule()                    # the next chunk, while the first is in flight
    sched.complete(first.batch_id, [])           # page 0 is written and named
    sched.abort(second.batch_id)                 # that chunk failed: page 1 holds garbage
    assert len(sched.allocator.snapshot()["keys"]) == 1 and sched.allocator.num_free == 16
    assert [e["step"] for e in sched.step_log] == [0]
    sched.submit(prompt, params(1))
    again = sched.schedule()
    assert again.rows[0].start_pos == 4          # page 0 is found again, page 1 is computed again


def test_only_the_rows_of_live_requests_must_have_finite_logits():
    """A request whose logits turned non-finite fails when its step completes; its row of the step
    already launched is non-finite too and must not fail the other requests of that step (a newcomer
    admitted there, which the one-step-at-a-time loop would have run without it)."""
    from engine.ops.sampling import NonFiniteLogitsError, SampledTokens
    from engine.runtime.model_runner import LaunchedStep
    from engine.runtime.scheduler import Batch, Row

    rows = [Row(7, [PENDING], 5, [0, 1], None, 3, kind="decode"), Row(9, [4, 5], 0, [2], None, 0)]
    step = LaunchedStep(Batch(1, "mixed", rows, 4), rows,
                        SampledTokens(np.array([0, 42], np.int32), np.array([False, True])), 0.0, 0.0)
    with pytest.raises(NonFiniteLogitsError, match="request 7"):
        step.tokens()
    assert step.tokens(is_live=lambda rid: rid != 7) == [0, 42]
