"""The online engine loop: requests from many threads and coroutines share one model, one KV cache and
one scheduler, join the running batch at the next step, stream, cancel, survive model errors, and
reuse the cached pages of a chat's earlier turns (prefix caching). Greedy outputs are compared with a serial run (and the no-cache
oracle), on the NumPy backend with a tiny random model.
"""
import asyncio
import gc
import threading
import weakref

import numpy as np
import pytest
from helpers.oracle import ForwardCounter, gen_model_dir, greedy_no_cache

from engine.runtime.llm import LLM
from engine.runtime.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("both_schedulings")
MAX_CONTEXT = 64
GREEDY = SamplingParams(max_new_tokens=12, ignore_eos=True)


def make_llm(**kw):
    return LLM(gen_model_dir(), backend="numpy", max_context=MAX_CONTEXT, **kw)


def random_prompts(n, seed=0, vocab=331, longest=20):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=int(rng.integers(1, longest))).tolist() for _ in range(n)]


@pytest.fixture(scope="module")
def llm(both_schedulings):
    return make_llm(max_seqs=6)


@pytest.fixture(scope="module")
def serial(llm):
    """Each prompt generated alone: the reference every concurrent run must reproduce."""
    prompts = random_prompts(24)
    return prompts, [llm.generate([p], GREEDY)[0].token_ids for p in prompts]


def hold_the_loop(llm, monkeypatch, after_calls: int = 2) -> threading.Event:
    """The model's forward passes after the first `after_calls` wait until the returned gate opens: the
    loop is then inside a step (its earlier tokens handed out, with async scheduling too), whatever the
    speed of the machine, until the test has done what it wants done while requests run."""
    gate, forward, calls = threading.Event(), llm.model.forward, []

    def held_forward(*args, **kwargs):
        calls.append(1)
        if len(calls) > after_calls:
            assert gate.wait(timeout=60)
        return forward(*args, **kwargs)
    monkeypatch.setattr(llm.model, "forward", held_forward)
    return gate


def assert_pool_clean(llm):
    sched = llm._engine.scheduler
    sched.allocator.check_invariants()
    stats = llm.stats()
    assert stats["running"] == stats["waiting"] == 0
    assert stats["pages_used"] == 0          # (cached pages are free: the pool may evict them)


def test_serial_reference_is_the_oracle(llm, serial):
    prompts, outputs = serial
    for prompt, tokens in list(zip(prompts, outputs, strict=True))[:4]:
        assert tokens == greedy_no_cache(llm.model, prompt, 12, ignore_eos=True)[0]


def test_threads_sharing_one_llm_get_the_serial_tokens(llm, serial):
    """8 threads x 3 prompts, half through generate and half through submit/stream, all at once."""
    prompts, expected = serial
    got, errors = [None] * len(prompts), []
    start = threading.Barrier(8)

    def worker(k):
        try:
            start.wait()
            for i in range(k, len(prompts), 8):
                if i % 2:
                    got[i] = llm.generate([prompts[i]], GREEDY)[0].token_ids
                else:
                    handle = llm.submit(prompts[i], GREEDY)
                    got[i] = [t for event in handle.stream() for t in event.token_ids]
                    assert handle.result().token_ids == got[i]
        except BaseException as exc:   # reported below: a thread's assert would be lost otherwise
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and got == expected
    assert_pool_clean(llm)


def test_submit_while_running_joins_the_batch(llm, serial, monkeypatch):
    prompts, expected = serial
    gate = hold_the_loop(llm, monkeypatch)
    first = llm.submit(prompts[0], SamplingParams(max_new_tokens=30, ignore_eos=True))
    stream = first.stream()
    next(stream)                                  # the first request is decoding now
    late = llm.submit(prompts[1], GREEDY)
    gate.set()
    assert late.result().token_ids == expected[1]
    assert first.result().token_ids[:12] == expected[0]
    joined = [e for e in llm.stats()["requests"] if e["request_id"] == late.request_id][0]
    # the late request decoded while the first was still running (it finished first)
    assert joined["finished"] < [e for e in llm.stats()["requests"]
                                 if e["request_id"] == first.request_id][0]["finished"]
    assert_pool_clean(llm)


def test_cancel_frees_the_pages(llm, serial):
    prompts, _ = serial
    params = SamplingParams(max_new_tokens=50, ignore_eos=True)
    # the whole answer, to compare with: how far the loop gets before it sees the cancel depends on
    # thread timing, what it returns must be a prefix of this
    expected = llm.generate([prompts[2]], params)[0].token_ids
    handle = llm.submit(prompts[2], params)
    events = handle.stream()
    seen = [next(events).token_ids[0] for _ in range(3)]
    assert llm.stats()["pages_used"] > 0
    handle.cancel()
    rest = list(events)
    assert rest[-1].finished and rest[-1].finish_reason == "cancelled"
    out = handle.result()
    assert out.finish_reason == "cancelled" and out.token_ids[:3] == seen
    assert len(out.token_ids) < len(expected) and out.token_ids == expected[:len(out.token_ids)]
    assert_pool_clean(llm)
    handle.cancel()                               # once done: nothing happens


def test_cancel_before_it_runs_and_zero_new_tokens(llm):
    handles = [llm.submit([1, 2, 3], SamplingParams(max_new_tokens=0)),
               llm.submit([4, 5], SamplingParams(max_new_tokens=8, ignore_eos=True))]
    handles[1].cancel()
    assert handles[0].result().token_ids == [] and handles[0].result().finish_reason == "length"
    assert handles[1].result().finish_reason == "cancelled"
    assert_pool_clean(llm)


def test_model_error_fails_those_requests_and_the_engine_carries_on(serial, monkeypatch):
    prompts, expected = serial
    llm = make_llm(max_seqs=6)
    real_forward, armed, fired, decoding_steps = llm.model.forward, threading.Event(), threading.Event(), []

    def flaky(batch, cache=None):
        # The second step in which all three decode waits for the test to have read a token of each
        # (with async scheduling the first one is launched before the previous step's tokens are handed
        # out), then fails: no request can finish before it, however fast the loop runs.
        if not fired.is_set() and len(batch.cu_seqlens) == 4 and batch.num_tokens == 3:
            decoding_steps.append(batch)
            if len(decoding_steps) >= 2:
                assert armed.wait(timeout=60)
        if armed.is_set():
            fired.set()
            raise RuntimeError("simulated device error")
        return real_forward(batch, cache)

    monkeypatch.setattr(llm.model, "forward", flaky)
    handles = [llm.submit(p, GREEDY) for p in prompts[:3]]
    streams = [handle.stream() for handle in handles]
    for stream in streams:
        next(stream)                              # all three are decoding
    armed.set()
    for handle, stream in zip(handles, streams, strict=True):
        with pytest.raises(RuntimeError, match="simulated device error"):
            list(stream)
        with pytest.raises(RuntimeError, match="simulated device error"):
            handle.result()
    armed.clear()
    assert_pool_clean(llm)
    assert [o.token_ids for o in llm.generate(prompts[3:6], GREEDY)] == expected[3:6]
    assert_pool_clean(llm)


def test_invalid_requests_raise_at_submit_and_change_nothing(llm):
    with pytest.raises(ValueError):
        llm.submit(list(range(MAX_CONTEXT)), GREEDY)          # no room for one new token
    with pytest.raises(ValueError):
        llm.submit([1, 2], "not params")
    with pytest.raises(ValueError):
        llm.submit([], GREEDY)
    with pytest.raises(ValueError):
        llm.submit([1, 10**6], GREEDY)                         # past the vocabulary
    assert_pool_clean(llm)


def test_numpy_integer_params_are_served(llm, serial):
    prompts, expected = serial
    params = SamplingParams(max_new_tokens=np.int64(12), ignore_eos=True, seed=np.uint64(2**63 + 5),
                            top_k=np.int32(0))
    assert llm.generate([prompts[4]], params)[0].token_ids == expected[4]


def test_astream_from_coroutines(llm, serial):
    prompts, expected = serial

    async def one(prompt):
        handle = llm.submit(prompt, GREEDY)
        tokens, last = [], None
        async for event in handle.astream():
            tokens += event.token_ids
            last = event
        assert last.finished and last.finish_reason == "length"
        return tokens

    async def main():
        return await asyncio.gather(*(one(p) for p in prompts[:6]))

    assert asyncio.run(main()) == expected[:6]


def test_stats_tell_the_story(llm, serial):
    prompts, _ = serial
    handle = llm.submit(prompts[5], GREEDY)
    events = handle.stream()
    next(events)
    stats = llm.stats()
    owners = stats["page_owners"]
    assert len(owners) == stats["pages_total"]
    for request_id, table in stats["page_tables"].items():
        assert all(owners[page] == request_id for page in table)
    assert stats["pages_used"] == sum(o >= 0 for o in owners)
    assert stats["pages_cached"] == sum(o == -2 for o in owners)
    list(events)
    info = [r for r in llm.stats()["requests"] if r["request_id"] == handle.request_id][0]
    assert [state for state, _ in info["timeline"]] == ["waiting", "prefill", "decode", "finished"]
    times = [t for _, t in info["timeline"]]
    assert times == sorted(times) and info["first_token"] is not None
    assert info["generated_tokens"] == 12 and info["finish_reason"] == "length"


def test_a_chat_turn_computes_only_what_the_cache_does_not_hold(monkeypatch):
    """Turn 2 repeats turn 1 and its answer: the full pages turn 1 wrote are shared, the rest (the
    partial last page and the new message) is computed; tokens equal a fresh run."""
    llm = make_llm(max_seqs=2, page_size=4)
    assert llm.prefix_caching
    counter = ForwardCounter(llm.model)
    monkeypatch.setattr(llm.model, "forward", counter)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    p1 = random_prompts(1, seed=7)[0]
    a1 = llm.submit(p1, params).result().token_ids
    p2 = p1 + a1 + [5, 77, 300]
    counter.tokens.clear()
    a2 = llm.submit(p2, params).result()
    written = len(p1) + len(a1) - 1                            # the last answer token was never fed
    assert counter.tokens[0] == len(p2) - written // 4 * 4
    assert a2.token_ids == greedy_no_cache(llm.model, p2, 8, ignore_eos=True)[0]
    assert llm.stats()["pages_cached"] > 0
    p3 = p2[:9] + [9, 9, 9]                                   # history edited: two full pages survive
    counter.tokens.clear()
    a3 = llm.submit(p3, params).result()
    assert counter.tokens[0] == len(p3) - 8
    assert a3.token_ids == greedy_no_cache(llm.model, p3, 8, ignore_eos=True)[0]
    stats = llm.stats()
    assert stats["prefix_cache"]["hit_tokens"] == written // 4 * 4 + 8
    assert stats["prefix_cache"]["lookup_tokens"] == len(p1) + len(p2) + len(p3)
    llm._engine.scheduler.allocator.check_invariants()


def test_cached_prefix_with_chunked_prefill(monkeypatch):
    """Chunked prefill and prefix caching together: turn 2 shares turn 1's full pages and feeds only
    the rest of its prompt, in chunks of the step's token budget; the stats follow the prefill's
    progress, count only sampled tokens, and the tokens equal a fresh run."""
    llm = make_llm(max_seqs=2, max_batch_tokens=4, page_size=4)
    assert llm.chunked_prefill
    counter = ForwardCounter(llm.model)
    monkeypatch.setattr(llm.model, "forward", counter)
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    p1 = random_prompts(1, seed=11, longest=20)[0] + [3] * 10
    first = llm.submit(p1, params)
    a1 = first.result().token_ids
    assert counter.tokens[:-(len(a1) - 1)] == [4] * (len(p1) // 4) + ([len(p1) % 4] if len(p1) % 4 else [])
    p2 = p1 + a1 + list(range(40, 51))
    reused = (len(p1) + len(a1) - 1) // 4 * 4
    counter.tokens.clear()
    handle = llm.submit(p2, params)
    a2 = handle.result()
    prefill_passes = counter.tokens[:-(len(a2.token_ids) - 1)]
    assert sum(prefill_passes) == len(p2) - reused and max(prefill_passes) <= 4 and len(prefill_passes) > 1
    assert a2.token_ids == greedy_no_cache(llm.model, p2, 6, ignore_eos=True)[0]
    stats = llm.stats()
    info = [r for r in stats["requests"] if r["request_id"] == handle.request_id][0]
    assert info["reused_tokens"] == reused and info["prefilled_tokens"] == len(p2)
    assert [state for state, _ in info["timeline"]] == ["waiting", "prefill", "decode", "finished"]
    assert info["generated_tokens"] == 6 and stats["tokens_generated"] == 12
    assert stats["pages_used"] == 0
    llm._engine.scheduler.allocator.check_invariants()


def test_cached_pages_give_way_under_memory_pressure(serial):
    """A pool of 8 pages: cached pages are evicted (never a running request preempted for them)."""
    prompts, expected = serial
    llm = make_llm(max_seqs=4, kv_cache_mib=8 * 16 * llm_kv_bytes_per_token() / 2**20)
    assert llm.cache.num_pages == 8
    for k in range(3):
        llm.submit(prompts[k], GREEDY).result()
    outs = llm.generate(prompts[6:12], GREEDY)
    assert [o.token_ids for o in outs] == expected[6:12]
    assert not any(e["preempted"] for e in llm.last_step_log)
    llm._engine.scheduler.allocator.check_invariants()


def test_the_session_keyword_is_ignored_with_a_warning():
    llm = make_llm(max_seqs=2)
    with pytest.warns(DeprecationWarning, match="prefix cache"):
        handle = llm.submit([1, 2, 3], GREEDY, session="chat")
    assert handle.result().token_ids == greedy_no_cache(llm.model, [1, 2, 3], 12, ignore_eos=True)[0]
    with pytest.warns(DeprecationWarning):
        llm.drop_session("chat")


def llm_kv_bytes_per_token():
    from engine.formats.config import load_config
    return load_config(gen_model_dir()).kv_bytes_per_token(4)


def test_stepping_by_hand_is_refused_while_the_loop_serves(llm, monkeypatch):
    gate = hold_the_loop(llm, monkeypatch)        # the loop stays inside a step until the gate opens
    handle = llm.submit([1, 2, 3], SamplingParams(max_new_tokens=40, ignore_eos=True))
    next(handle.stream())
    sched = llm.new_scheduler()
    sched.submit([4, 5], GREEDY)
    try:
        with pytest.raises(RuntimeError, match="engine loop is serving"):
            llm.step(sched, {0: 0})
    finally:
        gate.set()
    handle.result()
    assert llm.step(sched, {0: 0})                 # idle engine: the lesson's hand-driven loop works


def test_dropping_the_llm_frees_it():
    llm = make_llm()
    llm.generate([[1, 2, 3]], GREEDY)
    ref = weakref.ref(llm)
    del llm
    gc.collect()
    assert ref() is None


def test_a_scheduler_bug_fails_everything_and_the_engine_starts_afresh(serial, monkeypatch):
    prompts, expected = serial
    llm = make_llm()
    gate, forward = threading.Event(), llm.model.forward

    def held_forward(*args, **kwargs):            # the request cannot finish before the bug is in
        assert gate.wait(timeout=60)
        return forward(*args, **kwargs)
    monkeypatch.setattr(llm.model, "forward", held_forward)
    handle = llm.submit(prompts[0], GREEDY)
    monkeypatch.setattr(type(llm._engine.scheduler), "schedule", lambda self: 1 / 0)
    gate.set()
    with pytest.raises(ZeroDivisionError):
        handle.result()
    monkeypatch.undo()
    assert [o.token_ids for o in llm.generate(prompts[1:3], GREEDY)] == expected[1:3]
    assert_pool_clean(llm)
