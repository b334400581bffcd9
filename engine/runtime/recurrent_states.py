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
"""
from __future__ import annotations

from collections.abc import Callable

from engine.formats.config import HybridConfig
from engine.model.hybrid_forward import RecurrentState


class RecurrentStates:
    """request id -> RecurrentState, for the requests the engine is serving."""

    def __init__(self, config: HybridConfig):
        self.config = config
        self._states: dict[int, RecurrentState] = {}

    def for_rows(self, rows) -> list[RecurrentState]:
        """The state each row of a batch continues (a fresh one for a row at position 0)."""
        out = []
        for row in rows:
            if row.start_pos == 0:
                self._states[row.request_id] = RecurrentState.empty(self.config)
            state = self._states.get(row.request_id)
            if state is None or state.tokens != row.start_pos:
                seen = None if state is None else state.tokens
                raise RuntimeError(f"request {row.request_id}: its row starts at position {row.start_pos}, "
                                   f"its recurrent state has taken in {seen} tokens")
            out.append(state)
        return out

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
