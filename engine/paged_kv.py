"""Who owns which piece of the KV cache: the block allocators (metadata only, no device memory).

Every KV cache in this engine stores, per layer, K and V arrays of shape
[num_blocks, block_size, n_kv_heads, head_dim]. A sequence owns a *block table*, a list of block
numbers, and the token at absolute position p lives at

    block = block_table[p // block_size],  offset = p % block_size
    slot  = block * block_size + offset          # its row in the flattened [num_blocks*block_size] view

Two allocators share that picture and one protocol (`BlockAllocator`):

- `SlotAllocator(num_slots, max_context)`: the contiguous cache of chapters 09-10. A block is a whole
  context (block_size = max_context), so a sequence takes exactly one block, its "slot", for life,
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


class OutOfBlocks(AllocatorError):
    """reserve() asked for more blocks than are free; call can_reserve() first."""


class BlockAllocator:
    """A pool of `num_blocks` blocks of `block_size` token positions, a free list and block tables.

    The protocol the scheduler relies on:
        block_size, num_blocks, max_seq_len        sizes (max_seq_len: most positions one table covers)
        num_free, num_used                         blocks on the free list / in some table
        blocks_needed(n_tokens)                    blocks that cover positions [0, n_tokens)
        can_reserve(seq_id, new_len) -> bool       would reserve() succeed right now?
        reserve(seq_id, new_len) -> list[int]      grow seq's table to cover positions < new_len
        free(seq_id)                               give all of seq's blocks back
        adopt(seq_id, from_seq_id, keep_tokens)    move a table to a new owner, cut to keep_tokens
        commit() / rollback() / in_transaction     make permanent / undo everything since last commit
        block_table(seq_id) -> list[int]           a copy of seq's table ([] if it has none)
        has_table(seq_id) -> bool
        check_invariants()                         raise AllocatorError if a block leaked or is shared
        snapshot() -> dict                         free list and tables, plain data (for tests/plots)
    """

    def __init__(self, num_blocks: int, block_size: int, max_seq_len: int):
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size),
                            ("max_seq_len", max_seq_len)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_seq_len = max_seq_len
        # Taken from the left, returned on the right (like nano-vllm), so a freed block rests
        # for a while before it is reused: easier to spot stale reads when debugging a kernel.
        self._free: deque[int] = deque(range(num_blocks))
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
        return self.num_blocks - len(self._free)

    @property
    def in_transaction(self) -> bool:
        return bool(self._journal)

    def blocks_needed(self, n_tokens: int) -> int:
        """Blocks that cover positions [0, n_tokens): ceil(n_tokens / block_size)."""
        return -(-n_tokens // self.block_size)

    # ---- tables --------------------------------------------------------------------------------
    def has_table(self, seq_id: int) -> bool:
        return seq_id in self._tables

    def block_table(self, seq_id: int) -> list[int]:
        return list(self._tables.get(seq_id, ()))

    def can_reserve(self, seq_id: int, new_len: int) -> bool:
        if new_len > self.max_seq_len:
            return False
        held = len(self._tables.get(seq_id, ()))
        return self.blocks_needed(new_len) - held <= len(self._free)

    def reserve(self, seq_id: int, new_len: int) -> list[int]:
        """Make seq's table cover positions < new_len; return the blocks just taken (maybe none).

        Tables only grow here: a new_len the table already covers takes nothing. Raises OutOfBlocks
        (changing nothing) when the free list is too short or new_len exceeds max_seq_len.
        """
        if not isinstance(new_len, int) or new_len < 1:
            raise AllocatorError(f"new_len must be a positive int, got {new_len!r}")
        table = self._tables.get(seq_id)
        if table is not None and new_len <= min(len(table) * self.block_size, self.max_seq_len):
            return []       # already covered (15 decode steps in 16): nothing taken, nothing to undo
        if not self.can_reserve(seq_id, new_len):
            raise OutOfBlocks(
                f"sequence {seq_id} needs {self.blocks_needed(new_len)} blocks for {new_len} tokens "
                f"(holds {len(self._tables.get(seq_id, ()))}, {len(self._free)} free, "
                f"at most {self.max_seq_len} tokens per sequence)")
        table_was_new = seq_id not in self._tables
        table = self._tables.setdefault(seq_id, [])
        taken = [self._free.popleft() for _ in range(self.blocks_needed(new_len) - len(table))]
        table.extend(taken)
        if taken or table_was_new:
            self._journal.append(("reserve", seq_id, len(taken), table_was_new))
        return taken

    def free(self, seq_id: int) -> None:
        """Return every block of seq to the free list and forget its table."""
        if seq_id not in self._tables:
            raise AllocatorError(f"sequence {seq_id} holds no blocks")
        table = self._tables.pop(seq_id)
        self._free.extend(table)
        self._journal.append(("free", seq_id, table))

    def adopt(self, seq_id: int, from_seq_id: int, keep_tokens: int) -> None:
        """Hand from_seq's table to seq (which holds none), keeping the blocks that cover positions
        < keep_tokens and freeing the rest: a new request takes over a finished one's cached prefix."""
        if seq_id in self._tables or from_seq_id not in self._tables:
            raise AllocatorError(f"adopt needs a table for {from_seq_id} and none for {seq_id}")
        keep = self.blocks_needed(keep_tokens)
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
        """Every block is in exactly one place: the free list or one table. Raise if not."""
        seen: dict[int, str] = {}
        places = [("free list", self._free)] + [(f"table of {s}", t) for s, t in self._tables.items()]
        for where, blocks in places:
            for block in blocks:
                if not 0 <= block < self.num_blocks:
                    raise AllocatorError(f"block {block} in the {where} is out of range")
                if block in seen:
                    raise AllocatorError(f"block {block} is in the {seen[block]} and the {where}")
                seen[block] = where
        if len(seen) != self.num_blocks:
            raise AllocatorError(f"{self.num_blocks - len(seen)} blocks leaked (in no table, not free)")
        for seq_id, table in self._tables.items():
            if not table:
                raise AllocatorError(f"sequence {seq_id} has an empty table")
            if len(table) > self.blocks_needed(self.max_seq_len):
                raise AllocatorError(f"sequence {seq_id} holds more blocks than max_seq_len allows")

    def snapshot(self) -> dict:
        return {"free": list(self._free),
                "tables": {seq_id: list(table) for seq_id, table in self._tables.items()}}

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(blocks={self.num_blocks}, block_size={self.block_size}, "
                f"free={self.num_free}, sequences={len(self._tables)})")


class PageAllocator(BlockAllocator):
    """The paged pool of chapter 11: `num_pages` pages of `page_size` positions, any page for anyone.

    One sequence may in principle grow to the whole pool (max_seq_len = num_pages * page_size).
    """

    def __init__(self, num_pages: int, page_size: int = 16):
        if not isinstance(num_pages, int) or not isinstance(page_size, int):
            raise ValueError(f"num_pages and page_size must be ints, got {num_pages!r}, {page_size!r}")
        super().__init__(num_pages, page_size, max_seq_len=num_pages * page_size)


class SlotAllocator(BlockAllocator):
    """The contiguous cache of chapters 09-10: `num_slots` slots of `max_context` positions each.

    A slot is a block as long as the whole context, so a sequence's table is always [slot].
    """

    def __init__(self, num_slots: int, max_context: int):
        super().__init__(num_slots, max_context, max_seq_len=max_context)
