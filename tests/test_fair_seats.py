"""Fair seats: requests name their client, and a client flooding the scheduler holds its share of the
seats, never all of them (engine/runtime/scheduler.py, "Fair seats").

The fake model of the scheduler tests decides every token from the request's own tokens, so every
request must still end exactly as it does alone, whatever preemptions fairness makes.
"""
from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from test_ch09_11_scheduler import EOS, VOCAB, drain, fake_next_token, params, run_alone, setups
from test_ch14_async_scheduling import fresh, simulate_async

from engine.runtime.kv_allocator import PageAllocator
from engine.runtime.scheduler import Scheduler


def scheduler(max_seqs=4, pages=64, chunked=True, **kwargs):
    return Scheduler(PageAllocator(pages, 4), max_seqs=max_seqs, max_batch_tokens=64, max_context=64,
                     eos_token_ids=[EOS], chunked_prefill=chunked, **kwargs)


def seats(sched) -> dict:
    held: dict = {}
    for rid in sched.snapshot()["running"]:
        client = sched._requests[rid].client
        held[client] = held.get(client, 0) + 1
    return held


def step(sched):
    batch = sched.schedule()
    out = sched.complete(batch.batch_id, [fake_next_token(sched._requests[r.request_id].tokens)
                                          for r in batch.rows if r.samples])
    return batch, out


def test_a_newcomer_takes_seats_from_the_flooding_client_in_one_step():
    sched = scheduler(max_seqs=4)
    flood = [sched.submit([1, 2, 3], params(30), client="flood") for _ in range(10)]
    step(sched)
    assert seats(sched) == {"flood": 4}
    late = [sched.submit([4, 5], params(3), client="late") for _ in range(2)]
    batch, out = step(sched)
    # two seats moved at once: flood's two newest running requests were preempted, both late ones run
    assert seats(sched) == {"flood": 2, "late": 2}
    assert out.preempted == [flood[3], flood[2]]
    assert {r.request_id for r in batch.rows} >= set(late)
    assert sched.snapshot()["waiting"][:2] == [flood[2], flood[3]]   # back at the head, oldest first


def test_seats_balance_within_one_and_a_client_alone_is_never_preempted():
    sched = scheduler(max_seqs=5)
    for _ in range(8):
        sched.submit([1, 2], params(20), client="a")
    step(sched)
    step(sched)
    assert sched.num_preemptions == 0 and seats(sched) == {"a": 5}
    sched.submit([3], params(20), client="b")
    sched.submit([3, 3], params(20), client="b")
    sched.submit([3, 4], params(20), client="c")
    step(sched)
    held = seats(sched)
    assert sum(held.values()) == 5 and max(held.values()) - min(held.values()) <= 1
    assert held["a"] == 2 and held["b"] + held["c"] == 3


def test_without_clients_or_with_one_the_schedule_is_plain_fifo():
    def run(client):
        sched = scheduler(max_seqs=3, pages=20)
        rng = random.Random(5)
        for _ in range(9):
            named = {} if client is None else {"client": client}
            sched.submit([rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 9))], params(rng.randint(1, 12)),
                         **named)
        batches, results = drain(sched)
        return [(b.kind, [(r.request_id, r.start_pos) for r in b.rows]) for b in batches], results, \
            sched.num_preemptions
    plain, alone = run(None), run("only")
    assert plain == alone and plain[2] == 0


def test_the_lightest_client_goes_first_among_the_waiting():
    sched = scheduler(max_seqs=2, chunked=False)
    a = [sched.submit([1], params(8), client="a") for _ in range(4)]
    b = sched.submit([2], params(8), client="b")
    batch = sched.schedule()
    # a's first, then b's (b holds no seat), not a's second
    assert [r.request_id for r in batch.rows] == [a[0], b]


def test_static_batching_ignores_clients():
    sched = scheduler(max_seqs=2, chunked=False, policy="static")
    a = [sched.submit([1], params(4), client="a") for _ in range(3)]
    sched.submit([2], params(4), client="b")
    batch = sched.schedule()
    assert [r.request_id for r in batch.rows] == a[:2] and sched.num_preemptions == 0


def simulate_clients(setup, clients: int):
    """A synchronous run where each request names one of `clients`: outputs as alone, every page back,
    and whenever a step ends with every seat taken and a waiting client two seats short of the
    heaviest (a newcomer the step's token budget left out), the next step preempts."""
    pool = setup["allocator"]
    sched = Scheduler(pool, setup["max_seqs"], setup["max_batch_tokens"], setup["max_context"],
                      eos_token_ids=[EOS], policy="continuous", admission=setup["admission"],
                      chunked_prefill=setup["chunked"], prefix_caching=isinstance(pool, PageAllocator))
    rng = random.Random(setup["seed"])
    arrivals = sorted(((t, [rng.randrange(1, VOCAB) for _ in range(n)], params(new, ign))
                       for t, n, new, ign in setup["requests"]), key=lambda a: a[0])
    prompts, results, t, owed = {}, {}, 0, False
    while arrivals or sched.has_unfinished():
        results.update((r.request_id, r) for r in sched.pop_finished())
        t += 1
        if not sched.has_unfinished():
            owed = False
        else:
            _, out = step(sched)
            pool.check_invariants()
            results.update((r.request_id, r) for r in out.finished)
            assert not owed or out.preempted, "a client two seats short was not given a seat"
            snap = sched.snapshot()
            held = seats(sched)
            owed = bool(snap["waiting"]) and len(snap["running"]) == setup["max_seqs"] and \
                any(held.get(sched._requests[rid].client, 0) < max(held.values()) - 1 for rid in snap["waiting"])
        while arrivals and arrivals[0][0] <= t:     # (after the check: a newcomer is owed nothing yet)
            _, prompt, p = arrivals.pop(0)
            try:
                prompts[sched.submit(prompt, p, client=rng.randrange(clients))] = (prompt, p)
            except ValueError:
                pass
        assert t < 10_000, "no progress"
    results.update((r.request_id, r) for r in sched.pop_finished())    # max_new_tokens=0: at submit
    for rid, (prompt, p) in prompts.items():
        assert (results[rid].token_ids, results[rid].finish_reason) == run_alone(prompt, p, setup["max_context"])
    assert pool.num_free == pool.num_pages


@pytest.mark.slow
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(setup=setups())
def test_random_workloads_with_clients_match_running_alone(setup):
    simulate_clients(fresh(setup), clients=3)


@pytest.mark.slow
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(setup=setups())
def test_random_workloads_with_clients_and_a_batch_in_flight_match_running_alone(setup):
    simulate_async(fresh(setup), clients=3)
    simulate_async(fresh(setup), cancel_rate=0.1, abort_rate=0.1, clients=2)
