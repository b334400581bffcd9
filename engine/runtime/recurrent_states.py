"""Per-request recurrent state of a hybrid model (Qwen3.5), kept beside the paged KV cache.

The paged cache holds K/V for the full-attention layers only. Each Gated DeltaNet layer instead
remembers a request in a state of fixed size (its conv inputs and its delta-rule matrix per head,
engine/model/hybrid_forward.py: RecurrentState), whatever the request's length. The model runner
hands each row of a batch its request's state; the forward pass updates it in place.

  * a row that starts at position 0 (a new prompt, or a preempted request recomputed from its prompt
    and the tokens it had generated) starts from an empty state: preemption recomputes the state
    rather than saving it, exactly as it recomputes the request's K/V;
  * any other row (a later chunk of a prompt, a decode token) continues its request's state, which
    must have taken in exactly the tokens before the row: anything else is a bug and raises;
  * the state of a request that finished, failed or was cancelled is dropped after the step that saw it
    end; a preempted request keeps its (stale) state until it comes back at position 0. So with async
    scheduling, where the next batch is launched before this one completes, no state a launched row
    continues is ever dropped under it.
Prefix caching cannot apply: a cached page restores K/V, but no page holds what the linear layers
had accumulated at its end, so hybrid models run without it (engine/runtime/engine_config.py).

On the GPU (RecurrentSlots) the states live in device pools with one slot per seat (max_seqs) and
a spare one that CUDA graphs' padding rows write. A request holds its slot while it runs; the kernels
update it in place, so the bookkeeping differs in three ways:
  * a row at position 0 has its slot emptied on the device, in stream order: after every batch
    already queued, which may still write the slot's previous owner;
  * a preempted request's slot is taken back as soon as a new request needs one (its state would be
    recomputed anyway), so max_seqs slots always suffice;
  * a pass cannot be undone: when one fails, the requests of its batch lose their states (forget), and
    a retried row that continues one raises rather than running from a half-updated state.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from engine.formats.config import HybridConfig
from engine.model.hybrid_forward import PooledStates, RecurrentState, StatePools


def check_continues(row, seen: int | None) -> None:
    """RuntimeError unless the row starts where its request's state has got to (`seen` tokens)."""
    if seen != row.start_pos:
        raise RuntimeError(f"request {row.request_id}: its row starts at position {row.start_pos}, "
                           f"its recurrent state has taken in {seen} tokens")


class RecurrentStates:
    """request id -> RecurrentState, for the requests the engine is serving."""

    def __init__(self, config: HybridConfig):
        self.config = config
        self._states: dict[int, RecurrentState] = {}

    def for_rows(self, rows, is_running: Callable[[int], bool] | None = None) -> list[RecurrentState]:
        """The state each row of a batch continues (a fresh one for a row at position 0). The forward
        pass advances a state only once it has run whole (is_running: unused, host states are not
        rationed)."""
        out = []
        for row in rows:
            if row.start_pos == 0:
                self._states[row.request_id] = RecurrentState.empty(self.config)
            state = self._states.get(row.request_id)
            check_continues(row, None if state is None else state.tokens)
            out.append(self._states[row.request_id])
        return out

    def forget(self, rows) -> None:
        """A failed pass: nothing to undo, the pass commits the host states only once it has run whole."""

    def keep_live(self, is_live: Callable[[int], bool]) -> None:
        """Drop the states of requests that ended (finished, cancelled, failed)."""
        for request_id in [r for r in self._states if not is_live(r)]:
            del self._states[request_id]

    def clear(self) -> None:
        self._states.clear()

    def __len__(self) -> int:
        return len(self._states)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self._states.values())


class RecurrentSlots:
    """GPU: request id -> a slot of the device pools (StatePools, max_seqs + 1 slots: the last one is
    the CUDA graphs' padding rows' scratch), and how many tokens its state will have taken in once the
    passes queued so far have run."""

    def __init__(self, config: HybridConfig, max_seqs: int):
        self.config = config
        self.pools = StatePools.zeros(config, max_seqs + 1)
        self.scratch = max_seqs
        self._free = list(range(max_seqs - 1, -1, -1))     # pop() hands out slot 0 first
        self._slot: dict[int, int] = {}
        self._tokens: dict[int, int] = {}

    def for_rows(self, rows, is_running: Callable[[int], bool] | None = None) -> PooledStates:
        """Each row's slot (an empty one for a row at position 0, taken back from a request that is no
        longer running when none is free); the rows' tokens are counted as taken in."""
        for row in rows:
            check_continues(row, 0 if row.start_pos == 0 else self._tokens.get(row.request_id))
        batch = {row.request_id for row in rows}
        fresh = []
        for row in rows:
            rid = row.request_id
            if row.start_pos == 0:
                if rid not in self._slot:
                    self._slot[rid] = self._take(batch, is_running)
                fresh.append(self._slot[rid])
            self._tokens[rid] = row.start_pos + len(row.token_ids)
        if fresh:
            self.pools.reset(fresh)
        return PooledStates(self.pools, np.array([self._slot[row.request_id] for row in rows], dtype=np.int32))

    def _take(self, batch: set[int], is_running: Callable[[int], bool] | None) -> int:
        if not self._free and is_running is not None:
            idle = next((rid for rid in self._slot if rid not in batch and not is_running(rid)), None)
            if idle is not None:
                self._drop(idle)
        if not self._free:
            raise RuntimeError(f"all {self.scratch} recurrent-state slots are held by running requests")
        return self._free.pop()

    def _drop(self, request_id: int) -> None:
        self._free.append(self._slot.pop(request_id))
        del self._tokens[request_id]

    def forget(self, rows) -> None:
        """A failed pass may have updated some of its rows' slots: those states are lost."""
        for request_id in {row.request_id for row in rows} & self._slot.keys():
            self._drop(request_id)

    def keep_live(self, is_live: Callable[[int], bool]) -> None:
        """Free the slots of requests that ended (finished, cancelled, failed)."""
        for request_id in [r for r in self._slot if not is_live(r)]:
            self._drop(request_id)

    def clear(self) -> None:
        for request_id in list(self._slot):
            self._drop(request_id)

    def __len__(self) -> int:
        return len(self._slot)

    @property
    def nbytes(self) -> int:
        return self.pools.nbytes
