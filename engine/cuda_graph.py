"""Chapter 12: one decode step of one sequence, captured once as a CUDA graph and replayed.

A decode step of a 1B model launches ~190 small kernels and cuBLAS calls. Launched one by one from
Python, their launch overhead (~20 us each) costs more than the GPU work itself (~0.6 ms of weight
reads at full bandwidth). A CUDA graph records the whole sequence of launches once; a replay
submits all of them with one call. What makes that possible:

  * every input lives in a fixed device buffer (token, position, slot), updated before each replay;
  * Model.run does no host<->device traffic, and the attention kernel's context split is fixed
    (sized for max_context; slices past a sequence's length are simply empty);
  * every intermediate array comes from a private memory pool that nothing else allocates from,
    so the addresses baked into the graph stay valid for as long as the graph lives;
  * no learner's stage is plugged in (engine/plugins.py): while one is, steps run eagerly.
"""
from __future__ import annotations

import numpy as np

from engine.model.forward_pass import Model
from engine.model.kv_cache import KVCache
from engine.plugins import any_active


class DecodeGraph:
    """Replays the decode step of one sequence whose cache pages are `page_table`.

    A contiguous cache (chapter 08's ChatSession) passes nothing: its one sequence owns page 0. A
    paged cache (the engine loop decoding a single sequence) passes the sequence's page table, which
    may change from call to call; the captured table buffer is as wide as max_context needs.
    Built on the first real decode step: the warm-up run that sizes the memory pool IS that step
    (it writes the right K/V at the right position), then the capture records it without running.
    While a learner's stage is plugged in (engine/plugins.py) nothing is captured or replayed: the
    step runs eagerly, so their code runs for real on every token (a graph would replay the engine's
    kernels, or bake in theirs). The graph is captured at the first step without an override.
    """

    def __init__(self, model: Model, cache: KVCache, token: int, position: int, page_table=(0,)):
        import cupy as cp
        self.cp, self.model, self.cache = cp, model, cache
        width = -(-model.max_context // cache.page_size)       # pages that cover max_context
        self.host = np.zeros(3 + width, dtype=np.int32)         # [token, position, slot, table...]
        self.inputs = cp.zeros(3 + width, dtype=cp.int32)
        self.tables = self.inputs[3:].reshape(1, width)         # [1, width] page table (a view)
        self.seq_idx = cp.zeros(1, dtype=cp.int32)
        self.pool = cp.cuda.MemoryPool()
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.graph = self.logits = None
        self._set_inputs(token, position, page_table)
        if not any_active():
            self._capture()

    def _capture(self) -> None:
        cp = self.cp
        with cp.cuda.using_allocator(self.pool.malloc), self.stream:
            self._step()                                       # warm-up: compiles, sizes the pool
            self.stream.synchronize()
            self.stream.begin_capture()
            self.logits = self._step()                         # [1, V] fp32, rewritten by each replay
            self.graph = self.stream.end_capture()

    def _set_inputs(self, token: int, position: int, page_table) -> None:
        size = self.cache.page_size
        if len(page_table) > self.tables.shape[1] or position // size >= len(page_table):
            raise ValueError(f"page table of {len(page_table)} pages does not cover position {position}")
        self.host[3:] = 0                                      # past the context: never read
        self.host[3:3 + len(page_table)] = page_table
        self.host[:3] = (token, position, page_table[position // size] * size + position % size)
        self.inputs.set(self.host, stream=self.stream)

    def _step(self):
        ids, pos, slots = self.inputs[0:1], self.inputs[1:2], self.inputs[2:3]
        return self.model.run(ids, pos, None, self.cache, slots=slots, tables=self.tables,
                              seq_idx=self.seq_idx, longest=self.model.max_context)

    def __call__(self, token: int, position: int, page_table=(0,)):
        """Logits [1, V] of `token` fed at `position` (its K/V written into the cache)."""
        self._set_inputs(token, position, page_table)
        if any_active():                                       # a learner's stage: eager, unfused
            with self.stream:
                logits = self._step()
            self.stream.synchronize()
            return logits
        if self.graph is None:
            self._capture()                                    # its warm-up runs this very step
        self.graph.launch(self.stream)
        self.stream.synchronize()
        return self.logits
