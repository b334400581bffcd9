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

Changes are transactional, because a batch of the scheduler either runs or fails as a whole:
`reserve` and `free` are journaled; `commit()` makes everything since the last commit permanent;
`rollback()` undoes it exactly (same tables, same free list in the same order), so a failed batch
leaves the pool as it was and a retry takes the very same pages.
"""
from __future__ import annotations

from collections import deque


class AllocatorError(RuntimeError):
    """The allocator was used against its protocol (a bug in the caller, not bad user input)."""


class OutOfPages(AllocatorError):
    """reserve() asked for more pages than are free; call can_reserve() first."""


class KVAllocator:
    """A pool of `num_pages` pages of `page_size` token positions, a free list and page tables.

    The protocol the scheduler relies on:
        page_size, num_pages, max_seq_len        sizes (max_seq_len: most positions one table covers)
        num_free, num_used                         pages on the free list / in some table
        pages_needed(n_tokens)                    pages that cover positions [0, n_tokens)
        can_reserve(seq_id, new_len) -> bool       would reserve() succeed right now?
        reserve(seq_id, new_len) -> list[int]      grow seq's table to cover positions < new_len
        free(seq_id)                               give all of seq's pages back
        adopt(seq_id, from_seq_id, keep_tokens)    move a table to a new owner, cut to keep_tokens
        commit() / rollback() / in_transaction     make permanent / undo everything since last commit
        page_table(seq_id) -> list[int]           a copy of seq's table ([] if it has none)
        has_table(seq_id) -> bool
        check_invariants()                         raise AllocatorError if a page leaked or is shared
        snapshot() -> dict                         free list and tables, plain data (for tests/plots)
    """

    def __init__(self, num_pages: int, page_size: int, max_seq_len: int):
        for name, value in (("num_pages", num_pages), ("page_size", page_size),
                            ("max_seq_len", max_seq_len)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.max_seq_len = max_seq_len
        # Taken from the left, returned on the right (like nano-vllm), so a freed page rests
        # for a while before it is reused: easier to spot stale reads when debugging a kernel.
        self._free: deque[int] = deque(range(num_pages))
        self._tables: dict[int, list[int]] = {}
        # Undo records since the last commit, newest last:
        #   ("reserve", seq_id, n_taken, table_was_new)   ("free", seq_id, old_table)
        #   ("adopt", seq_id, from_seq_id, from_seq's whole table)
        self._journal: list[tuple] = []

    # ---- sizes ---------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    @property
    def in_transaction(self) -> bool:
        return bool(self._journal)

    def pages_needed(self, n_tokens: int) -> int:
        """Pages that cover positions [0, n_tokens): ceil(n_tokens / page_size)."""
        return -(-n_tokens // self.page_size)

    # ---- tables --------------------------------------------------------------------------------
    def has_table(self, seq_id: int) -> bool:
        return seq_id in self._tables

    def page_table(self, seq_id: int) -> list[int]:
        return list(self._tables.get(seq_id, ()))

    def can_reserve(self, seq_id: int, new_len: int) -> bool:
        if new_len > self.max_seq_len:
            return False
        held = len(self._tables.get(seq_id, ()))
        return self.pages_needed(new_len) - held <= len(self._free)

    def reserve(self, seq_id: int, new_len: int) -> list[int]:
        """Make seq's table cover positions < new_len; return the pages just taken (maybe none).

        Tables only grow here: a new_len the table already covers takes nothing. Raises OutOfPages
        (changing nothing) when the free list is too short or new_len exceeds max_seq_len.
        """
        if not isinstance(new_len, int) or new_len < 1:
            raise AllocatorError(f"new_len must be a positive int, got {new_len!r}")
        table = self._tables.get(seq_id)
        if table is not None and new_len <= min(len(table) * self.page_size, self.max_seq_len):
            return []       # already covered (15 decode steps in 16): nothing taken, nothing to undo
        if not self.can_reserve(seq_id, new_len):
            raise OutOfPages(
                f"sequence {seq_id} needs {self.pages_needed(new_len)} pages for {new_len} tokens "
                f"(holds {len(self._tables.get(seq_id, ()))}, {len(self._free)} free, "
                f"at most {self.max_seq_len} tokens per sequence)")
        table_was_new = seq_id not in self._tables
        table = self._tables.setdefault(seq_id, [])
        taken = [self._free.popleft() for _ in range(self.pages_needed(new_len) - len(table))]
        table.extend(taken)
        if taken or table_was_new:
            self._journal.append(("reserve", seq_id, len(taken), table_was_new))
        return taken

    def free(self, seq_id: int) -> None:
        """Return every page of seq to the free list and forget its table."""
        if seq_id not in self._tables:
            raise AllocatorError(f"sequence {seq_id} holds no pages")
        table = self._tables.pop(seq_id)
        self._free.extend(table)
        self._journal.append(("free", seq_id, table))

    def adopt(self, seq_id: int, from_seq_id: int, keep_tokens: int) -> None:
        """Hand from_seq's table to seq (which holds none), keeping the pages that cover positions
        < keep_tokens and freeing the rest: a new request takes over a finished one's cached prefix."""
        if seq_id in self._tables or from_seq_id not in self._tables:
            raise AllocatorError(f"adopt needs a table for {from_seq_id} and none for {seq_id}")
        keep = self.pages_needed(keep_tokens)
        if keep == 0:
            self.free(from_seq_id)
            return
        old_table = self._tables.pop(from_seq_id)
        self._tables[seq_id] = old_table[:keep]
        self._free.extend(old_table[keep:])
        self._journal.append(("adopt", seq_id, from_seq_id, old_table))

    # ---- transactions --------------------------------------------------------------------------
    def commit(self) -> None:
        self._journal.clear()

    def rollback(self) -> None:
        """Undo every reserve/free since the last commit, newest first: the exact previous state."""
        while self._journal:
            record = self._journal.pop()
            if record[0] == "reserve":
                _, seq_id, n_taken, table_was_new = record
                table = self._tables[seq_id]
                for _ in range(n_taken):
                    self._free.appendleft(table.pop())
                if table_was_new:
                    del self._tables[seq_id]
            elif record[0] == "adopt":
                _, seq_id, from_seq_id, old_table = record
                for _ in old_table[len(self._tables.pop(seq_id)):]:
                    self._free.pop()
                self._tables[from_seq_id] = old_table
            else:
                _, seq_id, old_table = record
                for _ in old_table:
                    self._free.pop()
                self._tables[seq_id] = old_table

    # ---- inspection ----------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Every page is in exactly one place: the free list or one table. Raise if not."""
        seen: dict[int, str] = {}
        places = [("free list", self._free)] + [(f"table of {s}", t) for s, t in self._tables.items()]
        for where, pages in places:
            for page in pages:
                if not 0 <= page < self.num_pages:
                    raise AllocatorError(f"page {page} in the {where} is out of range")
                if page in seen:
                    raise AllocatorError(f"page {page} is in the {seen[page]} and the {where}")
                seen[page] = where
        if len(seen) != self.num_pages:
            raise AllocatorError(f"{self.num_pages - len(seen)} pages leaked (in no table, not free)")
        for seq_id, table in self._tables.items():
            if not table:
                raise AllocatorError(f"sequence {seq_id} has an empty table")
            if len(table) > self.pages_needed(self.max_seq_len):
                raise AllocatorError(f"sequence {seq_id} holds more pages than max_seq_len allows")

    def snapshot(self) -> dict:
        return {"free": list(self._free),
                "tables": {seq_id: list(table) for seq_id, table in self._tables.items()}}

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(pages={self.num_pages}, page_size={self.page_size}, "
                f"free={self.num_free}, sequences={len(self._tables)})")


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
