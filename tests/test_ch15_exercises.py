"""Chapter 15 checkers: the page-key chain, the longest cached prefix (alone, then inside the scheduler and
engine.LLM), the reference-counted pool. The worked answers pass; each classic mistake gets its named
verdict; unfinished work is reported as not attempted."""
from __future__ import annotations

import pytest
from helpers.exercises import accepts, not_attempted, rejects

from engine.exercises import ch15
from engine.runtime.prefix_cache import cached_prefix, page_key

# ---- learner-style answers, right and wrong -------------------------------------------------------


def key_right(parent, tokens):
    return (parent, tuple(tokens))


def key_without_parent(parent, tokens):
    return tuple(tokens)


def key_python_hash(parent, tokens):
    return hash((parent, tuple(tokens)))


def key_sum(parent, tokens):
    return (parent, sum(tokens))


def key_list(parent, tokens):
    return [parent, tuple(tokens)]


def lookup_right(allocator, tokens, root, page_key):
    size, pages, parent = allocator.page_size, [], root
    for start in range(0, len(tokens) - size + 1, size):
        page = allocator.lookup(page_key(parent, tuple(tokens[start:start + size])))
        if page is None:
            break
        pages.append(page)
        parent = allocator.serial(page)
    return pages


def lookup_partial_page(allocator, tokens, root, page_key):
    size, pages, parent = allocator.page_size, [], root
    for start in range(0, len(tokens), size):              # the last, partial page is looked up too
        page = allocator.lookup(page_key(parent, tuple(tokens[start:start + size])))
        if page is None:
            break
        pages.append(page)
        parent = allocator.serial(page)
    return pages


def lookup_no_stop(allocator, tokens, root, page_key):
    size, pages, parent = allocator.page_size, [], root
    for start in range(0, len(tokens) - size + 1, size):
        page = allocator.lookup(page_key(parent, tuple(tokens[start:start + size])))
        if page is not None:                                # a miss is skipped, the walk goes on
            pages.append(page)
            parent = allocator.serial(page)
    return pages


def lookup_root_parent(allocator, tokens, root, page_key):
    size, pages = allocator.page_size, []
    for start in range(0, len(tokens) - size + 1, size):
        page = allocator.lookup(page_key(root, tuple(tokens[start:start + size])))
        if page is None:
            break
        pages.append(page)
    return pages


def lookup_one_short(allocator, tokens, root, page_key):
    size, pages, parent = allocator.page_size, [], root
    for start in range(0, len(tokens) - size, size):        # misses the last page of a page-aligned prompt
        page = allocator.lookup(page_key(parent, tuple(tokens[start:start + size])))
        if page is None:
            break
        pages.append(page)
        parent = allocator.serial(page)
    return pages


class PoolRight(ch15.RefCountedPool):
    def share(self, seq_id, pages):
        for page in pages:
            if self.refs[page] == 0:
                self.free_list.remove(page)
            self.refs[page] += 1
        self.tables[seq_id] = list(pages)

    def free(self, seq_id):
        for page in reversed(self.tables.pop(seq_id)):
            self.refs[page] -= 1
            if self.refs[page] == 0:
                self.free_list.append(page)


class PoolFreesSharedPages(PoolRight):
    def free(self, seq_id):
        for page in reversed(self.tables.pop(seq_id)):
            self.refs[page] = 0
            self.free_list.append(page)


class PoolFreesHeadFirst(PoolRight):
    def free(self, seq_id):
        for page in self.tables.pop(seq_id):
            self.refs[page] -= 1
            if self.refs[page] == 0:
                self.free_list.append(page)


class PoolForgetsKeys(PoolRight):
    def free(self, seq_id):
        for page in reversed(self.tables.pop(seq_id)):
            self.refs[page] -= 1
            if self.refs[page] == 0:
                self.free_list.append(page)
                key = self.key_of.pop(page, None)
                if key is not None:
                    del self.page_of[key]


class PoolSharesFromTheFreeList(PoolRight):
    def share(self, seq_id, pages):
        for page in pages:
            self.refs[page] += 1
        self.tables[seq_id] = list(pages)


# ---- exercise 1: page_key ---------------------------------------------------------------------------


def test_page_key_accepts_the_chain_and_the_engine_key(capsys):
    accepts(ch15.check_page_key, key_right, capsys)
    accepts(ch15.check_page_key, page_key, capsys)


@pytest.mark.parametrize("fn, hint", [
    (key_without_parent, "hashed without its parent"),
    (key_python_hash, "Python's hash() (or any 64-bit hash) collides"),
    (key_sum, "forgets the order of the tokens"),
    (key_list, "cannot be a dict key"),
])
def test_page_key_names_the_mistake(fn, hint, capsys):
    rejects(ch15.check_page_key, fn, capsys, hint)


def test_page_key_not_attempted(capsys):
    assert ch15.check_page_key(not_attempted) is False
    assert "not attempted yet" in capsys.readouterr().out


# ---- exercise 2: the lookup -------------------------------------------------------------------------


def test_lookup_accepts_the_walk_and_the_engine_function(capsys):
    accepts(ch15.check_longest_cached_prefix, lookup_right, capsys)
    accepts(ch15.check_longest_cached_prefix, cached_prefix, capsys)


@pytest.mark.parametrize("fn, hint", [
    (lookup_partial_page, "it looked up a partial page"),
    (lookup_no_stop, "kept looking after the first miss"),
    (lookup_root_parent, "looked up without their parent"),
    (lookup_one_short, "stopped one page short"),
])
def test_lookup_names_the_mistake(fn, hint, capsys):
    rejects(ch15.check_longest_cached_prefix, fn, capsys, hint)


def test_lookup_not_attempted(capsys):
    assert ch15.check_longest_cached_prefix(not_attempted) is False
    assert "not attempted yet" in capsys.readouterr().out


# ---- both inside the scheduler and engine.LLM -------------------------------------------------------


def test_the_learner_cache_runs_inside_the_engine(capsys):
    assert ch15.check_prefix_cache_in_llm(key_right, lookup_right) is True
    out = capsys.readouterr().out
    assert out.count("[OK]") == 2 and "engine.LLM" in out and "[x]" not in out


@pytest.mark.parametrize("key, lookup, words", [
    # the same tokens at another position: the fingerprints of the device catch the wrong read
    (key_without_parent, lookup_right, ["belong to another prefix", "without its parent"]),
    (key_right, lookup_root_parent, ["belong to another prefix", "looked up without their parent"]),
    (key_right, lookup_no_stop, ["belong to another prefix", "kept looking after the first miss"]),
    # right but short: fewer tokens reused than the engine's cache holds
    (key_right, lookup_one_short, ["tokens were reused where the engine's cache finds", "one page short"]),
])
def test_the_engine_stage_names_a_wrong_hit_or_a_missed_one(key, lookup, words, capsys):
    assert ch15.check_prefix_cache_in_llm(key, lookup) is False
    out = capsys.readouterr().out
    assert "[x]" in out and "[OK]" not in out, out
    for word in words:
        assert word in out, out


def test_the_engine_stage_not_attempted(capsys):
    assert ch15.check_prefix_cache_in_llm(not_attempted, not_attempted) is False
    assert "not attempted yet" in capsys.readouterr().out


# ---- exercise 3: the reference-counted pool ---------------------------------------------------------


def test_pool_accepts_the_reference_counts(capsys):
    accepts(ch15.check_ref_pool, PoolRight, capsys)


@pytest.mark.parametrize("cls, hint", [
    (PoolFreesSharedPages, "went back to the free list while sequence"),
    (PoolFreesHeadFirst, "the LAST page must go first"),
    (PoolForgetsKeys, "a freed page lost its key"),
    (PoolSharesFromTheFreeList, "a shared page stayed on the free list"),
])
def test_pool_names_the_mistake(cls, hint, capsys):
    assert ch15.check_ref_pool(cls) is False
    out = capsys.readouterr().out
    assert out.startswith("[x]") and hint in out, out


def test_pool_not_attempted(capsys):
    assert ch15.check_ref_pool(ch15.RefCountedPool) is False
    assert "not attempted yet" in capsys.readouterr().out


# ---- the teaching device and the simulation ---------------------------------------------------------


def test_the_device_catches_a_page_of_another_prefix():
    from engine.runtime.kv_allocator import PageAllocator
    from engine.runtime.sampling_params import SamplingParams
    from engine.runtime.scheduler import Scheduler
    sched = Scheduler(PageAllocator(16, 2), 2, 16, 32, prefix_caching=True, page_key=key_without_parent)
    params = SamplingParams(max_new_tokens=3, ignore_eos=True)
    with pytest.raises(ch15.WrongKV, match="another prefix at position 0"):
        ch15.serve_fake(sched, [([1, 2, 3, 4, 9], params), ([3, 4, 1, 2, 9], params)])


def test_hit_rate_grows_with_the_pool_and_tail_first_freeing_keeps_more_prefixes():
    requests = ch15.shared_prompt_workload(n_requests=60)
    small, large = ch15.hit_rate(16, requests), ch15.hit_rate(128, requests)
    head_first = ch15.hit_rate(16, requests, allocator_cls=ch15.HeadFirstFreeing)
    off = ch15.hit_rate(128, requests, prefix_caching=False)
    assert 0 < small["hit_rate"] < large["hit_rate"] < 1 and off["hit_rate"] == 0
    assert large["computed"] < off["computed"] / 2
    assert head_first["hit_rate"] < small["hit_rate"]
