"""Prefix caching (chapter 15): shared pages, reference counts, copy-on-write, eviction.

Three levels, as for the scheduler of chapters 09-11:
- the allocator alone: random operations keep every count and key right and roll back exactly;
- the scheduler over a fake model and a fake cache (tokens written into slots and read back through
  each row's page table, as tests/test_ch09_11_scheduler.py does), on random workloads whose prompts
  share system prompts and grow turn after turn, in pools small enough to evict and preempt, with
  failed batches, cancellations and (async) aborted batches: every request ends exactly as it does
  running alone, and a write never lands in a page someone else reads or a key names;
- engine.LLM on the NumPy backend: the same greedy tokens with and without the cache.
"""
from __future__ import annotations

import random
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_ch09_11_scheduler import EOS, VOCAB, fake_next_token, params, run_alone

from engine.runtime.kv_allocator import AllocatorError, OutOfPages, PageAllocator
from engine.runtime.prefix_cache import cached_prefix, page_key
from engine.runtime.scheduler import PENDING, Scheduler

# ---- the allocator alone -----------------------------------------------------------------------


def test_a_freed_registered_page_stays_findable_until_a_reservation_evicts_it():
    pool = PageAllocator(num_pages=4, page_size=2)
    pool.reserve(0, 4)                                # pages 0, 1
    pool.register(0, page_key("root", (1, 2)))
    pool.register(1, page_key(pool.serial(0), (3, 4)))
    pool.free(0)
    assert (pool.num_free, pool.num_cached, pool.num_used) == (4, 2, 0)
    assert cached_prefix(pool, [1, 2, 3, 4, 5], "root") == [0, 1]
    assert list(pool.snapshot()["free"]) == [2, 3, 1, 0]   # freed tail first: page 1 is evicted first
    pool.reserve(7, 6)                                # takes 2, 3 and evicts 1 (the chain's end)
    assert cached_prefix(pool, [1, 2, 3, 4, 5], "root") == [0]
    pool.check_invariants()


def test_sharing_counts_references_and_freeing_one_holder_keeps_the_page():
    pool = PageAllocator(num_pages=4, page_size=2)
    pool.reserve(0, 2)
    pool.register(0, "k")
    pool.share(1, [0])
    assert pool.num_shared == 1 and pool.num_used == 1
    pool.free(0)
    assert pool.page_table(1) == [0] and pool.num_used == 1 and pool.num_shared == 0
    pool.reserve(2, 6)                                # every other page: page 0 is not on the queue
    assert 0 not in pool.page_table(2)
    pool.check_invariants()


def test_copy_on_write_gives_a_private_page_and_drops_one_reference():
    pool = PageAllocator(num_pages=3, page_size=2)
    pool.reserve(0, 2)
    pool.register(0, "k")
    pool.share(1, [0])
    assert pool.must_copy(1, 0)
    src, dst = pool.copy_on_write(1, 0)
    assert (src, pool.page_table(1)) == (0, [dst]) and dst != 0
    assert not pool.must_copy(1, 0) and pool.must_copy(0, 0)   # 0 is still named by its key
    pool.check_invariants()


def test_a_duplicate_registration_keeps_the_first_holder():
    pool = PageAllocator(num_pages=4, page_size=2)
    pool.reserve(0, 2)
    pool.reserve(1, 2)
    a, b = pool.page_table(0)[0], pool.page_table(1)[0]
    assert pool.register(a, "k") == a
    assert pool.register(b, "k") == a                 # b stays private
    assert pool.lookup("k") == a and not pool.must_copy(1, 0)


def test_misuse_is_refused():
    pool = PageAllocator(num_pages=2, page_size=2)
    with pytest.raises(AllocatorError):
        pool.register(0, "k")                         # a page in no table holds nothing yet
    pool.reserve(0, 2)
    with pytest.raises(AllocatorError):
        pool.share(0, [0])                            # share() starts a table
    with pytest.raises(AllocatorError):
        pool.share(1, [1])                            # only a registered page can be shared
    pool.reserve(1, 2)
    pool.register(0, "k")
    pool.share(2, [0])
    with pytest.raises(OutOfPages):
        pool.copy_on_write(2, 0)                      # no free page to copy into


allocator_ops = st.lists(st.tuples(
    st.sampled_from(["reserve", "free", "register", "share", "cow", "commit", "rollback", "clear"]),
    st.integers(0, 4), st.integers(1, 24)), max_size=80)


@settings(max_examples=300, deadline=None)
@given(num_pages=st.integers(1, 10), page_size=st.integers(1, 4), ops=allocator_ops)
def test_random_operations_keep_counts_and_keys_right_and_roll_back_exactly(num_pages, page_size, ops):
    pool = PageAllocator(num_pages, page_size)
    committed = pool.snapshot()
    for op, seq, n in ops:
        table = pool.page_table(seq)
        if op == "reserve" and pool.can_reserve(seq, n):
            pool.reserve(seq, n)
        elif op == "free" and table:
            pool.free(seq)
        elif op == "register" and table and pool.lookup_page(table[n % len(table)]) is None:
            page = table[n % len(table)]
            holder = pool.register(page, ("key", n % 3))
            assert pool.lookup(("key", n % 3)) == holder and holder in (page, pool.lookup(("key", n % 3)))
        elif op == "share" and not table:
            pages = [p for p in pool.snapshot()["keys"]][: n % 3]
            pool.share(seq, pages) if pages else None
        elif op == "cow" and table and pool.num_free:
            src, dst = pool.copy_on_write(seq, n % len(table))
            assert pool.page_table(seq)[n % len(table)] == dst != src
        elif op == "commit":
            pool.commit()
            committed = pool.snapshot()
        elif op == "rollback":
            pool.rollback()
            assert pool.snapshot() == committed
        elif op == "clear":
            pool.clear_cache()
        pool.check_invariants()
        assert min(pool.snapshot()["refs"]) >= 0
    for seq in list(pool.snapshot()["tables"]):
        pool.free(seq)
    pool.check_invariants()
    assert pool.num_free == pool.num_pages and pool.num_used == 0


# ---- the scheduler over a fake model and a fake cache ------------------------------------------

def chain(previous: int, token: int) -> int:
    """What a fake K/V entry holds beside its token: a fingerprint of the whole prefix up to it, as a
    real K/V depends on every token before it (attention mixed them in)."""
    return zlib.crc32(np.asarray([previous, token], dtype=np.int64).tobytes())


class FakeDevice:
    """Runs batches in launch order, as one CUDA stream does: copies first, then writes each new
    token, with the fingerprint of its prefix, into its slot, then reads each sampling row's whole
    context back through its page table and checks that every entry belongs to this very prefix (a
    page of another prefix, or of the same tokens at other positions, breaks the chain). A write may
    land only in a page no key named before the batch was formed, and in a page several tables hold
    only if it was named while forming this batch (its writer is the row that named it; the others
    read it after the write, in the same layer). PENDING inputs come from the samples of the batch
    launched before (async scheduling)."""

    def __init__(self, pool: PageAllocator):
        self.pool, self.cache, self.copies = pool, {}, 0
        self.last: tuple | None = None     # (batch, its samples): where PENDING tokens come from
        self.named: dict = {}              # page -> registration serial when the last batch ran

    def run(self, batch, named_before: dict | None = None) -> list[int]:
        """named_before: page -> registration serial just before schedule() formed `batch` (default:
        when the previous batch ran). A page evicted while the batch formed may be written (under no
        key, or a new registration)."""
        named_before = self.named if named_before is None else named_before
        size = batch.page_size
        for src, dst in batch.page_copies:
            self.copies += 1
            for offset in range(size):
                self.cache[dst * size + offset] = self.cache.get(src * size + offset, (-1, -1))
        tokens = batch.token_ids.copy()
        if batch.pending_indices.size:
            prev_batch, prev_sampled = self.last
            by_request = dict(zip([r.request_id for r in prev_batch.rows if r.samples], prev_sampled, strict=True))
            row_of_token = np.repeat(np.arange(len(batch.rows)), batch.lengths)
            for i in batch.pending_indices:
                tokens[i] = by_request[batch.rows[row_of_token[i]].request_id]
        assert (tokens != PENDING).all()
        snap = self.pool.snapshot()
        named_now = {page for page, serial in snap["serials"].items() if named_before.get(page) != serial}
        slots, positions = batch.slot_mapping.tolist(), batch.positions.tolist()
        rows = np.repeat(np.arange(len(batch.rows)), batch.lengths).tolist()
        for slot, token, pos, r in zip(slots, tokens.tolist(), positions, rows, strict=True):
            page = slot // size
            assert page not in snap["keys"] or page in named_now, \
                f"a write into page {page}, which a key named before this batch"
            assert snap["refs"][page] == 1 or page in named_now, \
                f"a write into page {page}, which {snap['refs'][page]} tables hold"
            table = batch.rows[r].page_table
            before = self.cache[table[(pos - 1) // size] * size + (pos - 1) % size][1] if pos else 0
            self.cache[slot] = (token, chain(before, token))
        sampled = []
        for row in batch.rows:
            if not row.samples:
                continue
            entries = [self.cache.get(row.page_table[p // size] * size + p % size, (-1, -1))
                       for p in range(row.context_len)]
            fingerprint = 0
            for p, (token, fp) in enumerate(entries):
                fingerprint = chain(fingerprint, token)
                assert fp == fingerprint, f"request {row.request_id} reads K/V of another prefix at position {p}"
            sampled.append(fake_next_token([token for token, _ in entries]))
        self.last = (batch, sampled)
        self.named = dict(snap["serials"])
        return sampled


def shared_prefix_workload(rng: random.Random, max_context: int, n_requests: int):
    """Prompts built the way real traffic repeats itself: one of a few system prompts, then either a
    fresh question or the next turn of an earlier conversation (its prompt and answer, edited now
    and then), sometimes the very same prompt again."""
    systems = [[rng.randrange(1, VOCAB) for _ in range(rng.randrange(0, 14))] for _ in range(3)]
    history: list[list[int]] = []
    for _ in range(n_requests):
        roll = rng.random()
        if history and roll < 0.35:
            base = rng.choice(history)
            if rng.random() < 0.2:
                base = base[:rng.randrange(len(base) + 1)]
        elif history and roll < 0.45:
            base = list(rng.choice(history))          # the same prompt again (maybe page-aligned)
        else:
            base = list(rng.choice(systems))
        prompt = (base + [rng.randrange(1, VOCAB) for _ in range(rng.randrange(0 if base else 1, 6))])
        prompt = prompt[-(max_context - 9):] or [1]
        history.append(prompt)
        yield prompt, params(rng.randrange(1, 8), ignore_eos=rng.random() < 0.7)


def drive(setup, *, async_scheduling: bool, fail_rate=0.0, cancel_rate=0.0, abort_rate=0.0):
    """Run a workload to the end; check every request against running alone; return what happened."""
    rng = random.Random(setup["seed"])
    pool = PageAllocator(setup["num_pages"], setup["page_size"])
    sched = Scheduler(pool, setup["max_seqs"], setup["max_batch_tokens"], setup["max_context"],
                      eos_token_ids=[EOS], policy=setup["policy"], admission=setup["admission"],
                      chunked_prefill=setup["chunked"], async_scheduling=async_scheduling,
                      prefix_caching=setup["prefix_caching"])
    device = FakeDevice(pool)
    arrivals = list(shared_prefix_workload(rng, setup["max_context"], setup["n_requests"]))
    prompts, results, in_flight, steps = {}, {}, None, 0
    while arrivals or sched.has_unfinished() or in_flight:
        for _ in range(rng.randrange(0, 3)):
            if arrivals:
                prompt, p = arrivals.pop(0)
                try:
                    prompts[sched.submit(prompt, p)] = (prompt, p)
                except ValueError:
                    pass
        live = sched.snapshot()["waiting"] + sched.snapshot()["running"]
        if live and rng.random() < cancel_rate and (async_scheduling or in_flight is None):
            victim = rng.choice(live)
            results[victim] = sched.cancel(victim)
        steps += 1
        assert steps < 20_000, "no progress"
        named_before = dict(pool.snapshot()["serials"])
        batch = sched.schedule()
        if batch is not None and not async_scheduling and rng.random() < fail_rate:
            sched.fail(batch.batch_id)
            pool.check_invariants()
            continue
        sampled = device.run(batch, named_before) if batch is not None else None
        if batch is not None and async_scheduling and rng.random() < abort_rate:
            for result in sched.abort(batch.batch_id):
                results[result.request_id] = result
            batch = None
        finished = sched.pop_finished()
        if async_scheduling:
            if in_flight is not None:
                finished += sched.complete(in_flight[0].batch_id, in_flight[1]).finished
            in_flight = (batch, sampled) if batch is not None else None
        elif batch is not None:
            finished += sched.complete(batch.batch_id, sampled).finished
        pool.check_invariants()
        for result in finished:
            results[result.request_id] = result
    assert sorted(results) == sorted(prompts)
    for rid, (prompt, p) in prompts.items():
        expected = run_alone(prompt, p, setup["max_context"])
        if results[rid].finish_reason == "cancelled":
            assert results[rid].token_ids == expected[0][:len(results[rid].token_ids)]
        else:
            assert (results[rid].token_ids, results[rid].finish_reason) == expected, rid
    assert pool.num_free == pool.num_pages and pool.num_used == 0 and pool.num_shared == 0
    assert min(pool.snapshot()["refs"]) == 0 == max(pool.snapshot()["refs"])
    if setup["admission"] == "conservative":
        assert sched.num_preemptions == 0
    return sched, device


@st.composite
def cached_setups(draw):
    page_size = draw(st.sampled_from([1, 2, 4]))
    max_context = draw(st.integers(16, 40))
    return {
        "seed": draw(st.integers(0, 10_000)),
        "page_size": page_size,
        # at least one request at full context fits; often little more (evictions, preemptions)
        "num_pages": draw(st.integers(-(-max_context // page_size) + 1, 3 * max_context // page_size + 2)),
        "max_context": max_context,
        "max_seqs": draw(st.integers(1, 5)),
        "max_batch_tokens": draw(st.integers(8, 48)),
        "policy": draw(st.sampled_from(["continuous", "static"])),
        "admission": draw(st.sampled_from(["conservative", "on_demand"])),
        "chunked": draw(st.booleans()),
        "n_requests": draw(st.integers(1, 18)),
        "prefix_caching": True,
    }


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(setup=cached_setups())
def test_random_shared_prefix_workloads_end_as_running_alone(setup):
    drive(setup, async_scheduling=False, fail_rate=0.15, cancel_rate=0.05)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(setup=cached_setups())
def test_random_shared_prefix_workloads_with_a_batch_in_flight_end_as_running_alone(setup):
    drive(setup, async_scheduling=True, cancel_rate=0.05, abort_rate=0.05)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_cache_is_exercised_hits_copies_evictions_and_preemptions(async_scheduling):
    """The random workloads above are only worth something if they reach every path: count them."""
    hits = copies = preemptions = evictions = 0
    for seed in range(40):
        setup = {"seed": seed, "page_size": 2, "num_pages": 24, "max_context": 32, "max_seqs": 4,
                 "max_batch_tokens": 24, "policy": "continuous", "admission": "on_demand" if seed % 2 else
                 "conservative", "chunked": seed % 3 == 0, "n_requests": 16, "prefix_caching": True}
        sched, device = drive(setup, async_scheduling=async_scheduling)
        hits += sched.hit_tokens
        copies += device.copies
        preemptions += sched.num_preemptions
        evictions += sched.allocator._next_serial - len(sched.allocator.snapshot()["keys"])
    assert hits > 500 and copies > 5 and preemptions > 5 and evictions > 100, (hits, copies, preemptions, evictions)


def test_a_fully_cached_page_aligned_prompt_copies_its_last_page():
    sched = Scheduler(PageAllocator(8, 4), 2, 16, 32, prefix_caching=True)
    device = FakeDevice(sched.allocator)
    prompt = list(range(1, 9))                        # two full pages
    for _ in range(2):
        sched.submit(prompt, params(2))
        while sched.has_unfinished():
            batch = sched.schedule()
            sched.complete(batch.batch_id, device.run(batch))
    first_row = sched.step_log[-2]
    assert first_row["reused_tokens"] == 7 and device.copies == 1
    assert sched.step_log[-2]["lookup_tokens"] == 8


def test_without_prefix_caching_nothing_is_named_or_shared():
    sched = Scheduler(PageAllocator(8, 4), 2, 16, 32)
    device = FakeDevice(sched.allocator)
    for _ in range(2):
        sched.submit(list(range(1, 9)), params(2))
        while sched.has_unfinished():
            batch = sched.schedule()
            sched.complete(batch.batch_id, device.run(batch))
    assert sched.allocator.snapshot()["keys"] == {} and sched.hit_tokens == 0
    assert all(e["reused_tokens"] == 0 == e["lookup_tokens"] for e in sched.step_log)


def test_a_page_key_without_its_parent_serves_wrong_pages():
    """The hash chain matters: a key of the page's tokens alone matches the same tokens at another
    position, after another prefix, and the request reads K/V that are not its own."""
    def tokens_only(parent, tokens):
        return tokens
    sched = Scheduler(PageAllocator(16, 2), 2, 16, 32, prefix_caching=True, page_key=tokens_only)
    device = FakeDevice(sched.allocator)
    with pytest.raises(AssertionError, match="another prefix"):
        for prompt in ([1, 2, 3, 4, 9], [3, 4, 1, 2, 9]):    # the same two pages, swapped
            sched.submit(prompt, params(3))
            while sched.has_unfinished():
                batch = sched.schedule()
                sched.complete(batch.batch_id, device.run(batch))


# ---- engine.LLM on the NumPy backend ---------------------------------------------------------

@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_llm_gives_the_same_tokens_with_and_without_the_cache(family):
    from helpers.oracle import GEN_CONFIGS, gen_model_dir

    from engine.runtime.llm import LLM
    from engine.runtime.sampling_params import SamplingParams
    rng = np.random.default_rng(15)
    vocab = GEN_CONFIGS[family]["vocab_size"]
    system = rng.integers(0, vocab, size=37).tolist()
    prompts = [system + rng.integers(0, vocab, size=int(rng.integers(1, 9))).tolist() for _ in range(10)]
    prompts += [prompts[0], prompts[3][:32]]          # a repeat, and a page-aligned prefix of one
    greedy = SamplingParams(max_new_tokens=6, ignore_eos=True)
    sampled = SamplingParams(max_new_tokens=6, temperature=0.8, top_p=0.9, seed=3)
    outputs = {}
    for caching in (False, True):
        llm = LLM(gen_model_dir(family=family), backend="numpy", max_context=64, max_seqs=3, page_size=4,
                  prefix_caching=caching)
        assert llm.prefix_caching is caching
        first = llm.generate(prompts[:1], greedy)      # the system prompt is cached before the rest
        outputs[caching] = ([o.token_ids for o in first + llm.generate(prompts[1:], greedy)],
                            [o.token_ids for o in llm.generate(prompts, sampled)])
        stats = llm.stats()
        assert (stats["prefix_cache"]["hit_tokens"] > 36 * 10) is caching
        llm._engine.scheduler.allocator.check_invariants()
        llm.close()
    assert outputs[True] == outputs[False]


def test_llm_refuses_prefix_caching_without_pages():
    from helpers.oracle import gen_model_dir

    from engine.runtime.llm import LLM
    with pytest.raises(ValueError, match="kv_cache='paged'"):
        LLM(gen_model_dir(), backend="numpy", kv_cache="contiguous", prefix_caching=True)
    with pytest.raises(ValueError, match="prefix_caching must be"):
        LLM(gen_model_dir(), backend="numpy", prefix_caching="yes")
    assert not LLM(gen_model_dir(), backend="numpy", kv_cache="contiguous", max_context=64).prefix_caching


def test_a_plugged_in_stage_never_reads_pages_the_engine_wrote():
    """K/V computed under a learner's stage differ from the engine's: the cache keeps them apart."""
    from helpers.oracle import gen_model_dir

    import engine
    from engine.ops.rmsnorm import rmsnorm_ref
    from engine.runtime.llm import LLM
    from engine.runtime.sampling_params import SamplingParams
    llm = LLM(gen_model_dir(), backend="numpy", max_context=64, max_seqs=2, page_size=4)
    prompt = list(range(20, 45))
    greedy = SamplingParams(max_new_tokens=4, ignore_eos=True)
    llm.generate([prompt], greedy)

    def louder(x, w, eps):
        return 1.5 * rmsnorm_ref(x, w, eps)
    with engine.use_stage("rmsnorm", louder):
        out = llm.generate([prompt], greedy)[0]
        assert llm.last_step_log[0]["reused_tokens"] == 0
        again = llm.generate([prompt], greedy)[0]
        assert llm.last_step_log[0]["reused_tokens"] == 24 and again.token_ids == out.token_ids
    llm.generate([prompt], greedy)
    assert llm.last_step_log[0]["reused_tokens"] == 24       # the engine's own pages again


def test_a_scheduler_driven_by_hand_makes_the_engine_forget_its_pages():
    """LLM.step runs a learner's scheduler over the engine's pool: the pages it writes overwrite what
    the engine's scheduler had cached, so that one must not find them afterwards."""
    from helpers.oracle import gen_model_dir

    from engine.runtime.llm import LLM
    from engine.runtime.sampling_params import SamplingParams
    llm = LLM(gen_model_dir(), backend="numpy", max_context=64, max_seqs=2, page_size=4, kv_cache_mib=0.05)
    greedy = SamplingParams(max_new_tokens=4, ignore_eos=True)
    prompt = list(range(20, 45))
    want = llm.generate([prompt], greedy)[0].token_ids
    sched = llm.new_scheduler(first_request_id=1000)
    sched.submit(list(range(100, 140)), greedy)
    while sched.has_unfinished():
        llm.step(sched, {1000: 0})
    assert llm.generate([prompt], greedy)[0].token_ids == want
    assert llm.last_step_log[0]["reused_tokens"] == 0


def test_a_request_admitted_in_the_same_step_shares_the_pages_being_written():
    """30 participants send the same system prompt at once: it is computed once, in the first step,
    and everyone else's row starts after it in that same step."""
    sched = Scheduler(PageAllocator(64, 4), 8, 256, 64, prefix_caching=True)
    device = FakeDevice(sched.allocator)
    system = list(range(1, 21))                        # five full pages
    ids = [sched.submit(system + [30 + i, 40 + i], params(2)) for i in range(6)]
    batch = sched.schedule()
    assert [row.start_pos for row in batch.rows] == [0] + [20] * 5
    assert batch.num_tokens == 22 + 5 * 2
    out = sched.complete(batch.batch_id, device.run(batch, {}))
    assert len(out.sampled) == 6 and sched.allocator.num_shared == 5
    assert sched.step_log[-1]["reused_tokens"] == 100 and sched.step_log[-1]["lookup_tokens"] == 132
    while sched.has_unfinished():
        batch = sched.schedule()
        sched.complete(batch.batch_id, device.run(batch))
    assert len(ids) == 6 and sched.allocator.num_used == 0


def test_aborting_a_batch_ends_the_requests_that_share_the_pages_it_was_to_write():
    sched = Scheduler(PageAllocator(32, 4), 4, 10, 64, prefix_caching=True, async_scheduling=True)
    a = sched.submit(list(range(1, 9)), params(3))
    first = sched.schedule()                           # a's prompt: pages 0 and 1 named as it forms
    b = sched.submit(list(range(1, 9)) + [20, 21], params(3))
    second = sched.schedule()                          # b shares both pages, a decodes
    assert [row.start_pos for row in second.rows if row.request_id == b] == [8]
    ended = sched.abort(first.batch_id)                # a's prompt never reached the cache
    assert sorted(r.request_id for r in ended) == [a, b]
    assert not any(page in sched.allocator.snapshot()["keys"] for page in first.rows[0].page_table)
    sched.complete(second.batch_id, [5] * sum(r.samples for r in second.rows))
    assert not sched.has_unfinished() and sched.allocator.num_free == 32
    sched.allocator.check_invariants()


def test_a_page_the_batch_in_flight_writes_is_computed_again_rather_than_copied():
    """A copy of it would be queued after that batch, but if the batch fails the copy holds garbage and
    its reader would not know: the page-aligned repeat one step later computes its last page."""
    sched = Scheduler(PageAllocator(32, 4), 4, 10, 64, prefix_caching=True, async_scheduling=True)
    a = sched.submit([1, 2, 3, 4], params(3))
    first = sched.schedule()                           # writes page 0 and names it as it forms
    b = sched.submit([1, 2, 3, 4], params(3))
    second = sched.schedule()
    row = next(r for r in second.rows if r.request_id == b)
    assert row.copy is None and row.start_pos == 0
    assert [r.request_id for r in sched.abort(first.batch_id)] == [a] and sched.is_live(b)


def test_an_aborted_batch_spares_a_page_taken_and_named_again_since():
    """a is cancelled while its batch is in flight; its page is evicted and named again for e's prompt
    in the next batch; when a's batch fails, e, which never read what it wrote, keeps running."""
    sched = Scheduler(PageAllocator(2, 4), 2, 10, 8, prefix_caching=True, async_scheduling=True)
    a = sched.submit([1, 2, 3, 4], params(1))
    first = sched.schedule()
    sched.cancel(a)
    e = sched.submit([9, 9, 9, 9, 9, 9], params(1))
    sched.schedule()
    assert sched.abort(first.batch_id) == [] and sched.is_live(e)
    sched.allocator.check_invariants()
