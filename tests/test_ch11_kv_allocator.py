"""The page allocators alone: tables that cover what was asked, exact rollback, no leaks."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.runtime.kv_allocator import AllocatorError, OutOfPages, PageAllocator, SlotAllocator


def test_pages_are_taken_one_at_a_time_as_the_sequence_grows():
    pool = PageAllocator(num_pages=10, page_size=4)
    assert pool.reserve(7, 5) == [0, 1]       # positions 0..4 need ceil(5/4) = 2 pages
    assert pool.reserve(7, 8) == []           # still covered
    assert pool.reserve(7, 9) == [2]
    assert pool.page_table(7) == [0, 1, 2]
    assert (pool.num_free, pool.num_used) == (7, 3)
    pool.check_invariants()


def test_rollback_puts_back_tables_and_free_list_in_the_same_order():
    pool = PageAllocator(num_pages=6, page_size=2)
    pool.reserve(0, 3)
    pool.reserve(1, 2)
    pool.commit()
    before = pool.snapshot()
    pool.reserve(0, 6)          # grows 0
    pool.free(1)                # frees 1 ...
    pool.reserve(1, 1)          # a fresh table for 1
    assert pool.reserve(2, 4) == [5, 2]   # page 2, just freed, is reused at once
    assert pool.in_transaction
    pool.rollback()
    assert pool.snapshot() == before and not pool.in_transaction
    pool.check_invariants()
    # a retry takes the very same pages
    assert pool.reserve(0, 6) == [3]


def test_out_of_blocks_changes_nothing():
    pool = PageAllocator(num_pages=3, page_size=4)
    pool.reserve(0, 8)
    before = pool.snapshot()
    assert not pool.can_reserve(1, 5)
    with pytest.raises(OutOfPages):
        pool.reserve(1, 5)
    assert pool.snapshot() == before


def test_a_slot_is_one_block_for_the_whole_context():
    slots = SlotAllocator(num_slots=3, max_context=100)
    assert slots.reserve(5, 1) == [0]
    assert slots.reserve(5, 100) == []
    assert slots.page_table(5) == [0]
    assert not slots.can_reserve(5, 101)      # a slot never grows into a second page
    with pytest.raises(OutOfPages):
        slots.reserve(5, 101)
    slots.free(5)
    assert slots.num_free == 3 and not slots.has_table(5)


def test_misuse_is_refused():
    pool = PageAllocator(num_pages=2)
    with pytest.raises(AllocatorError):
        pool.free(0)                          # holds nothing
    with pytest.raises(AllocatorError):
        pool.reserve(0, 0)
    with pytest.raises(ValueError):
        PageAllocator(num_pages=0)


def test_check_invariants_catches_an_uncounted_share_and_a_leaked_block():
    pool = PageAllocator(num_pages=4, page_size=2)
    pool.reserve(0, 3)
    pool._tables[1] = [pool._tables[0][0]]    # the same page in two tables, its count still 1
    with pytest.raises(AllocatorError, match="in 2 tables but counted 1"):
        pool.check_invariants()
    del pool._tables[1]
    pool._free.remove(pool._free.tail)        # a page that is nowhere
    with pytest.raises(AllocatorError, match="leaked"):
        pool.check_invariants()


operations = st.lists(st.one_of(
    st.tuples(st.just("reserve"), st.integers(0, 5), st.integers(1, 70)),
    st.tuples(st.just("free"), st.integers(0, 5), st.just(0)),
    st.tuples(st.just("commit"), st.just(0), st.just(0)),
    st.tuples(st.just("rollback"), st.just(0), st.just(0)),
), max_size=60)


@settings(max_examples=200, deadline=None)
@given(kind=st.sampled_from(["pages", "slots"]), num_pages=st.integers(1, 12),
       page_size=st.integers(1, 8), ops=operations)
def test_random_operations_keep_invariants_and_roll_back_exactly(kind, num_pages, page_size, ops):
    pool = (PageAllocator(num_pages, page_size) if kind == "pages"
            else SlotAllocator(num_pages, page_size * 8))
    covered: dict[int, int] = {}             # model: positions each table must cover
    committed = (pool.snapshot(), dict(covered))
    for op, seq, n in ops:
        if op == "reserve":
            need = pool.pages_needed(max(n, covered.get(seq, 0))) - len(pool.page_table(seq))
            ok = n <= pool.max_seq_len and need <= pool.num_free
            assert pool.can_reserve(seq, n) == ok
            if ok:
                taken = pool.reserve(seq, n)
                assert len(taken) == need
                covered[seq] = max(n, covered.get(seq, 0))
            else:
                before = pool.snapshot()
                with pytest.raises(OutOfPages):
                    pool.reserve(seq, n)
                assert pool.snapshot() == before
        elif op == "free" and seq in covered:
            pool.free(seq)
            del covered[seq]
        elif op == "commit":
            pool.commit()
            committed = (pool.snapshot(), dict(covered))
        elif op == "rollback":
            pool.rollback()
            assert pool.snapshot() == committed[0]
            covered = dict(committed[1])
        pool.check_invariants()
        for seq_id, n_tokens in covered.items():
            assert len(pool.page_table(seq_id)) == pool.pages_needed(n_tokens)
        assert pool.num_used == sum(pool.pages_needed(v) for v in covered.values())
    for seq_id in list(covered):
        pool.free(seq_id)
    pool.commit()
    assert pool.num_free == pool.num_pages
