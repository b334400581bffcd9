"""Who owns which piece of the KV cache: the page allocators (metadata only, no device memory).

Every KV cache in this engine stores, per layer, K and V arrays of shape
[num_pages, page_size, n_kv_heads, head_dim]. A sequence owns a *page table*, a list of page
numbers, and the token at absolute position p lives at

    page = page_table[p // page_size],  offset = p % page_size
    slot  = page * page_size + offset          # its row in the flattened [num_pages*page_size] view

Two allocators share that picture and one protocol (`KVAllocator`):

- `SlotAllocator(num_slots, max_context)`: the contiguous cache of chapters 09-10. A page is a whole
  context (page_size = max_context), so a sequence takes exactly one page, its "slot", for life,
  even if it only ever writes 20 tokens into it. That waste is what chapter 11 removes.
- `PageAllocator(num_pages, page_size=16)`: the paged cache of chapter 11. A sequence takes 16-token
  pages one at a time as it grows; any free page will do, so nothing is reserved in advance.

Shared pages (chapter 15, prefix caching). A full page whose K/V the scheduler has *registered* under a
key (engine/runtime/prefix_cache.py: the key names the page's tokens and everything before them) can
sit in several tables at once. Each page has a reference count: the number of tables that hold it.
When the count drops to 0 a registered page keeps its K/V and its key: it is free (any reserve() may
take it) but a later request with the same prefix can still `share()` it back. So there are three
kinds of page:

    in use       ref count >= 1, in that many tables
    free, cached ref count 0, registered: on the free queue, still found by lookup()
    free         ref count 0, not registered

The free queue holds both kinds of free page, least recently freed first; reserve() takes from its
head, and a cached page taken there is *evicted* (its key forgotten) before it is overwritten. A page
is freed tail first (a sequence's last page goes into the queue first), so the end of a prefix is
evicted before its beginning, which other prefixes are more likely to share. A registered page is
never written again: a sequence that must write into one asks for `copy_on_write()` first.

Changes are transactional, because a batch of the scheduler either runs or fails as a whole: every
change is journaled; `commit()` makes everything since the last commit permanent; `rollback()` undoes
it exactly (same tables, same reference counts, same keys, same free queue in the same order), so a
failed batch leaves the pool as it was and a retry takes the very same pages.
"""
from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator


class AllocatorError(RuntimeError):
    """The allocator was used against its protocol (a bug in the caller, not bad user input)."""


class OutOfPages(AllocatorError):
    """reserve() asked for more pages than are free; call can_reserve() first."""


class FreeQueue:
    """The free pages in the order they were freed, oldest first: a doubly linked list over page
    numbers, so that a cached page a request shares again leaves from the middle in O(1)."""

    def __init__(self, num_pages: int):
        self._prev = [p - 1 for p in range(num_pages)]
        self._next = [p + 1 for p in range(num_pages)]
        if num_pages:
            self._next[-1] = -1
        self._inside = [True] * num_pages
        self.head, self.tail = (0, num_pages - 1) if num_pages else (-1, -1)
        self.size = num_pages              # an attribute, not only __len__: read on every reservation

    def __len__(self) -> int:
        return self.size

    def __contains__(self, page: int) -> bool:
        return self._inside[page]

    def __iter__(self) -> Iterator[int]:
        page = self.head
        while page != -1:
            yield page
            page = self._next[page]

    def insert_after(self, prev: int, page: int) -> None:
        """Put `page` right after `prev` (-1: at the head)."""
        nxt = self.head if prev == -1 else self._next[prev]
        self._prev[page], self._next[page] = prev, nxt
        if prev == -1:
            self.head = page
        else:
            self._next[prev] = page
        if nxt == -1:
            self.tail = page
        else:
            self._prev[nxt] = page
        self._inside[page] = True
        self.size += 1

    def append(self, page: int) -> None:
        self.insert_after(self.tail, page)

    def remove(self, page: int) -> int:
        """Take `page` out; return the page it followed (-1: it was the head), to put it back there."""
        prev, nxt = self._prev[page], self._next[page]
        if prev == -1:
            self.head = nxt
        else:
            self._next[prev] = nxt
        if nxt == -1:
            self.tail = prev
        else:
            self._prev[nxt] = prev
        self._inside[page] = False
        self.size -= 1
        return prev


class KVAllocator:
    """A pool of `num_pages` pages of `page_size` token positions, a free queue and page tables.

    The protocol the scheduler relies on:
        page_size, num_pages, max_seq_len        sizes (max_seq_len: most positions one table covers)
        num_free, num_used                         pages reserve() may take / pages in some table
        num_cached, num_shared                     free pages still holding a registered prefix /
                                                   pages in more than one table
        pages_needed(n_tokens)                    pages that cover positions [0, n_tokens)
        can_reserve(seq_id, new_len) -> bool       would reserve() succeed right now?
        reserve(seq_id, new_len) -> list[int]      grow seq's table to cover positions < new_len
        free(seq_id)                               drop seq's table (each page's count goes down by one)
        register(page, key) -> page                page's K/V are what `key` names (the page that holds
                                                   key: this one, or the one that already did)
        lookup(key) -> page | None                 the registered page of key, in use or free
        serial(page) -> int                        the registration's number (keys name parents by it)
        share(seq_id, pages)                       start seq's table with registered pages
        copy_on_write(seq_id, index) -> (src, dst) give seq a private copy of its index-th page
        must_copy(seq_id, index) -> bool           writing seq's index-th page needs copy_on_write first
        clear_cache()                              forget every key (someone else wrote the pool)
        commit() / rollback() / in_transaction     make permanent / undo everything since last commit
        page_table(seq_id) -> list[int]           a copy of seq's table ([] if it has none)
        has_table(seq_id) -> bool
        check_invariants()                         raise AllocatorError if a count or a key is wrong
        snapshot() -> dict                         free queue, tables, keys: plain data (for tests/plots)
    """

    def __init__(self, num_pages: int, page_size: int, max_seq_len: int):
        for name, value in (("num_pages", num_pages), ("page_size", page_size),
                            ("max_seq_len", max_seq_len)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.max_seq_len = max_seq_len
        # Taken from the head, returned at the tail (like nano-vllm and vLLM), so a freed page rests
        # for a while before it is reused: a cached prefix survives longer, and stale reads are
        # easier to spot when debugging a kernel.
        self._free = FreeQueue(num_pages)
        self._refs = [0] * num_pages
        self._tables: dict[int, list[int]] = {}
        self._key_of: dict[int, Hashable] = {}     # registered page -> its key
        self._page_of: dict[Hashable, int] = {}    # key -> registered page
        # registration -> a number never given twice: a child page's key names its parent by it, so a
        # key whose parent was evicted (and its page reused for other tokens) can never match again
        self._serial_of: dict[int, int] = {}
        self._next_serial = 0
        self._num_shared = 0                       # pages with ref count > 1
        self._num_cached = 0                       # registered pages with ref count 0
        self._journal: list[Callable[[], object]] = []   # undo steps since the last commit, newest last

    # ---- sizes ---------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return self._free.size

    @property
    def num_used(self) -> int:
        return self.num_pages - self._free.size

    @property
    def num_cached(self) -> int:
        return self._num_cached

    @property
    def num_shared(self) -> int:
        return self._num_shared

    @property
    def in_transaction(self) -> bool:
        return bool(self._journal)

    def pages_needed(self, n_tokens: int) -> int:
        """Pages that cover positions [0, n_tokens): ceil(n_tokens / page_size)."""
        return -(-n_tokens // self.page_size)

    # ---- the primitive changes, each journaled with its exact inverse ------------------------------
    def _take(self) -> int:
        """The head of the free queue, ref count 1; a cached page there is evicted first."""
        page = self._free.head
        self._free.remove(page)
        self._journal.append(lambda: self._free.insert_after(-1, page))
        key = self._key_of.get(page)
        if key is not None:
            self._unregister(page, key)
        self._ref(page, +1)
        return page

    def _forget(self, page: int, key: Hashable) -> int:
        del self._key_of[page], self._page_of[key]
        self._num_cached -= not self._refs[page]
        return self._serial_of.pop(page)

    def _unregister(self, page: int, key: Hashable) -> None:
        serial = self._forget(page, key)

        def undo():
            self._key_of[page], self._page_of[key], self._serial_of[page] = key, page, serial
            self._num_cached += not self._refs[page]
        self._journal.append(undo)

    def _ref(self, page: int, delta: int) -> None:
        """Change a page's count by +1 (one more table holds it) or -1 (one less)."""
        before = self._refs[page]
        self._refs[page] = before + delta
        shared_change = (before + delta > 1) - (before > 1)
        cached_change = ((before + delta == 0) - (before == 0)) if page in self._key_of else 0
        self._num_shared += shared_change
        self._num_cached += cached_change

        def undo():
            self._refs[page] -= delta
            self._num_shared -= shared_change
            self._num_cached -= cached_change
        self._journal.append(undo)

    def _release(self, page: int) -> None:
        """One table less holds `page`; at 0 it joins the tail of the free queue (cached if registered)."""
        self._ref(page, -1)
        if not self._refs[page]:
            self._free.append(page)
            self._journal.append(lambda: self._free.remove(page))

    def _set_table(self, seq_id: int, table: list[int] | None) -> None:
        old = self._tables.get(seq_id)
        if table is None:
            del self._tables[seq_id]
        else:
            self._tables[seq_id] = table

        def undo():
            if old is None:
                self._tables.pop(seq_id, None)
            else:
                self._tables[seq_id] = old
        self._journal.append(undo)

    # ---- tables --------------------------------------------------------------------------------
    def has_table(self, seq_id: int) -> bool:
        return seq_id in self._tables

    def page_table(self, seq_id: int) -> list[int]:
        return list(self._tables.get(seq_id, ()))

    def page_at(self, seq_id: int, index: int) -> int:
        """seq's index-th page, without copying its table."""
        return self._tables[seq_id][index]

    def table_size(self, seq_id: int) -> int:
        """Pages in seq's table (0 if it has none), without copying the table."""
        return len(self._tables.get(seq_id, ()))

    def can_reserve(self, seq_id: int, new_len: int) -> bool:
        if new_len > self.max_seq_len:
            return False
        held = len(self._tables.get(seq_id, ()))
        return -(-new_len // self.page_size) - held <= self._free.size

    def reserve(self, seq_id: int, new_len: int) -> list[int]:
        """Make seq's table cover positions < new_len; return the pages just taken (maybe none).

        Tables only grow here: a new_len the table already covers takes nothing. Raises OutOfPages
        (changing nothing) when the free queue is too short or new_len exceeds max_seq_len.
        """
        if not isinstance(new_len, int) or new_len < 1:
            raise AllocatorError(f"new_len must be a positive int, got {new_len!r}")
        table = self._tables.get(seq_id)
        if table is not None and new_len <= min(len(table) * self.page_size, self.max_seq_len):
            return []       # already covered (15 decode steps in 16): nothing taken, nothing to undo
        if not self.can_reserve(seq_id, new_len):
            raise OutOfPages(
                f"sequence {seq_id} needs {self.pages_needed(new_len)} pages for {new_len} tokens "
                f"(holds {len(self._tables.get(seq_id, ()))}, {self._free.size} free, "
                f"at most {self.max_seq_len} tokens per sequence)")
        if table is None:
            table = self._tables[seq_id] = []
            self._journal.append(lambda: self._tables.pop(seq_id))
        n = self.pages_needed(new_len) - len(table)
        taken = [self._take() for _ in range(n)]
        table.extend(taken)

        def undo():
            del table[len(table) - n:]
        self._journal.append(undo)
        return taken

    def free(self, seq_id: int) -> None:
        """Drop seq's table: each of its pages is held by one table less, and a page no table holds
        goes to the free queue, the last page first (so it is evicted before the prefix it ends)."""
        if seq_id not in self._tables:
            raise AllocatorError(f"sequence {seq_id} holds no pages")
        table = self._tables[seq_id]
        self._set_table(seq_id, None)
        for page in reversed(table):
            self._release(page)

    # ---- shared pages (prefix caching) ---------------------------------------------------------
    def lookup(self, key: Hashable) -> int | None:
        return self._page_of.get(key)

    def lookup_page(self, page: int) -> Hashable | None:
        """The key a page is registered under (None: it holds nothing anyone can find)."""
        return self._key_of.get(page)

    def serial_or_none(self, page: int) -> int | None:
        return self._serial_of.get(page)

    def serial(self, page: int) -> int:
        """The number of page's registration (unique for the allocator's life): what a key names a
        parent page by."""
        return self._serial_of[page]

    def is_cached_free(self, page: int) -> bool:
        """A free page that still holds a registered prefix (sharing it takes it off the free queue)."""
        return not self._refs[page] and page in self._key_of

    def register(self, page: int, key: Hashable) -> int:
        """Say that `page` (full, written, in some table) holds the K/V that `key` names. If another
        page already holds key, nothing changes and that page is returned: the caller's page stays
        private (a duplicate, computed by two requests at once)."""
        if not self._refs[page]:
            raise AllocatorError(f"page {page} is in no table: only written pages can be registered")
        holder = self._page_of.get(key)
        if holder is not None:
            return holder
        if page in self._key_of:
            raise AllocatorError(f"page {page} is registered already, under another key")
        self._key_of[page], self._page_of[key] = key, page
        self._serial_of[page], self._next_serial = self._next_serial, self._next_serial + 1

        def undo():
            self._forget(page, key)
            self._next_serial -= 1
        self._journal.append(undo)
        return page

    def share(self, seq_id: int, pages: list[int]) -> None:
        """Start seq's table (it holds none) with registered pages: one more table holds each; a
        cached free page leaves the free queue."""
        if seq_id in self._tables:
            raise AllocatorError(f"sequence {seq_id} holds pages already: share() starts a table")
        for page in pages:
            if page not in self._key_of:
                raise AllocatorError(f"page {page} is not registered: only a cached prefix can be shared")
            if not self._refs[page]:
                self._journal.append(self._put_back(page, self._free.remove(page)))
            self._ref(page, +1)
        self._set_table(seq_id, list(pages))

    def _put_back(self, page: int, prev: int) -> Callable[[], None]:
        """The undo of taking `page` out of the free queue from behind `prev`."""
        return lambda: self._free.insert_after(prev, page)

    def must_copy(self, seq_id: int, index: int) -> bool:
        """Would writing into seq's index-th page change K/V that a key names or another table reads?
        (False for a page seq does not hold yet: reserve() will take a fresh one.)"""
        table = self._tables.get(seq_id, ())
        if index >= len(table):
            return False
        page = table[index]
        return self._refs[page] > 1 or page in self._key_of

    def copy_on_write(self, seq_id: int, index: int) -> tuple[int, int]:
        """Give seq a private page in place of its index-th one (a free page; OutOfPages if none) and
        return (src, dst): the caller copies the K/V of src into dst before anything writes dst."""
        if not self._free:
            raise OutOfPages(f"no free page to copy page {index} of sequence {seq_id} into")
        table = list(self._tables[seq_id])
        src = table[index]
        dst = self._take()
        table[index] = dst
        self._set_table(seq_id, table)
        self._release(src)
        return src, dst

    def unregister(self, page: int) -> None:
        """Forget the key of `page` (its K/V turned out not to be what the key names)."""
        key = self._key_of.get(page)
        if key is not None:
            self._unregister(page, key)

    def clear_cache(self) -> None:
        """Forget every key: the pool's K/V no longer match them (another scheduler wrote the pool)."""
        for page, key in list(self._key_of.items()):
            self._unregister(page, key)

    # ---- transactions --------------------------------------------------------------------------
    def commit(self) -> None:
        self._journal.clear()

    def rollback(self) -> None:
        """Undo every change since the last commit, newest first: the exact previous state."""
        while self._journal:
            self._journal.pop()()

    # ---- inspection ----------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Every page is free (count 0, on the queue once) or in use (count = the tables that hold it,
        never twice in one table); keys and pages match one to one. Raise if not."""
        counts = [0] * self.num_pages
        for seq_id, table in self._tables.items():
            if not table:
                raise AllocatorError(f"sequence {seq_id} has an empty table")
            if len(table) > self.pages_needed(self.max_seq_len):
                raise AllocatorError(f"sequence {seq_id} holds more pages than max_seq_len allows")
            if len(set(table)) != len(table):
                raise AllocatorError(f"sequence {seq_id} holds a page twice")
            for page in table:
                if not 0 <= page < self.num_pages:
                    raise AllocatorError(f"page {page} in the table of {seq_id} is out of range")
                if page in self._free:
                    raise AllocatorError(f"page {page} is in the free queue and the table of {seq_id}")
                counts[page] += 1
        queued = list(self._free)
        if len(queued) != len(set(queued)) or len(queued) != len(self._free):
            raise AllocatorError("the free queue holds a page twice or miscounts its length")
        for page in range(self.num_pages):
            if counts[page] != self._refs[page]:
                raise AllocatorError(f"page {page} is in {counts[page]} tables but counted {self._refs[page]}")
            if not counts[page] and page not in self._free:
                raise AllocatorError(f"page {page} leaked (in no table, not free)")
        if self._num_shared != sum(c > 1 for c in counts):
            raise AllocatorError("the count of shared pages is wrong")
        if self._num_cached != sum(1 for page in self._key_of if not counts[page]):
            raise AllocatorError("the count of cached free pages is wrong")
        if len(self._key_of) != len(self._page_of) or set(self._serial_of) != set(self._key_of) or \
                any(self._page_of.get(k) != p for p, k in self._key_of.items()):
            raise AllocatorError("registered pages and keys do not match one to one")

    def cached_free_pages(self) -> list[int]:
        """The free pages that still hold a registered prefix (for the dashboard's page map)."""
        return [page for page in self._key_of if not self._refs[page]]

    def snapshot(self) -> dict:
        return {"free": list(self._free),
                "tables": {seq_id: list(table) for seq_id, table in self._tables.items()},
                "refs": list(self._refs),
                "keys": dict(self._key_of),
                "serials": dict(self._serial_of)}

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(pages={self.num_pages}, page_size={self.page_size}, "
                f"free={self.num_free}, cached={self.num_cached}, sequences={len(self._tables)})")


class PageAllocator(KVAllocator):
    """The paged pool of chapter 11: `num_pages` pages of `page_size` positions, any page for anyone.

    One sequence may in principle grow to the whole pool (max_seq_len = num_pages * page_size).
    """

    def __init__(self, num_pages: int, page_size: int = 16):
        if not isinstance(num_pages, int) or not isinstance(page_size, int):
            raise ValueError(f"num_pages and page_size must be ints, got {num_pages!r}, {page_size!r}")
        super().__init__(num_pages, page_size, max_seq_len=num_pages * page_size)


class SlotAllocator(KVAllocator):
    """The contiguous cache of chapters 09-10: `num_slots` slots of `max_context` positions each.

    A slot is a page as long as the whole context, so a sequence's table is always [slot].
    """

    def __init__(self, num_slots: int, max_context: int):
        super().__init__(num_slots, max_context, max_seq_len=max_context)
