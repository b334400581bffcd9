"""Decode steps as CUDA graphs, one per batch-size bucket (vLLM style; chapters 12 and 14).

A decode step of a 1B model launches ~190 small kernels and cuBLAS calls; launched one by one from
Python, their launch overhead costs more than the GPU work itself. A CUDA graph records the whole
sequence once and a replay submits it with one call. A server decodes a batch whose size changes
every step, so one graph per *bucket* is captured (1, 2, 4, ..., 256 rows, the last one max_seqs):
a decode batch of R rows replays the graph of the smallest bucket >= R, its R real rows first and
the rest padding. Everything a graph reads sits in fixed device buffers that are refilled before
each replay, in ONE host-to-device copy of one int32 array laid out as

    [ token ids (B) | positions (B) | slot mapping (B) | page tables (B x W) | state slots (B) ]

with B the bucket and W = ceil(max_context / page_size) (1 for a contiguous cache: a slot is one page
of max_context). State slots are a hybrid model's recurrent-state slots (appendix: linear attention;
0 for other models): each row's slot in the device pools, which the graph updates in place.
The host side is double-buffered: with async scheduling the next step's inputs are packed while this
step's copy may still wait its turn on the stream. A row whose token the previous step sampled on
the device (async scheduling's feedback) gets it written into the device buffer before the replay.
A padding row feeds token 0 at position 0 with slot -1 (kv_write writes nothing for a negative
slot) and a page table of page 0 (it reads one key there, harmlessly); its logits are never read. Its
state slot is the pools' spare one, which no request holds.

The model runner replays the bucket of each decode batch; chapter 08's ChatSession replays the
one-row bucket over its contiguous slot. What keeps a captured graph valid:
  * the attention kernel's split count is fixed at capture: `longest` = max_context, so each bucket
    gets the split that suits its row count at the longest context (slices past a row's length are
    empty);
  * the RoPE tables are sized to max_context before the first capture (they never move again);
  * every intermediate comes from one private memory pool shared by all buckets: graphs replay one
    at a time on one stream, so they may share scratch memory; their logits buffers stay alive;
  * while a learner's stage is plugged in (engine/plugins.py) nothing is captured or replayed;
  * the eager warm-up before a capture writes the same K/V again, but a recurrent state would take its
    token in twice: the rows' state slots are saved before the warm-up and restored after it.

A graph is captured lazily, the first time a batch needs its bucket: the step runs once eagerly
(compiling kernels, sizing the pool, letting cuBLAS pick its kernels), then is recorded, then
replayed. Any failure while capturing turns graphs off for this runner with a warning, and that step
and every later one run eagerly. ENGINE_CUDA_GRAPHS=0 (or LLM(..., cuda_graphs=False)) turns them
off from the start.
"""
from __future__ import annotations

import warnings

import numpy as np

from engine.checks import env_switch
from engine.model.hybrid_forward import PooledStates
from engine.ops.embedding import check_ids
from engine.plugins import any_active

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
ENV_SWITCH = "ENGINE_CUDA_GRAPHS"      # "0" turns the graphs off


def graphs_enabled_by_env() -> bool:
    return env_switch(ENV_SWITCH)


def buckets_for(max_rows: int) -> tuple[int, ...]:
    """The bucket sizes for batches of at most max_rows rows: the powers of two below it, then
    max_rows itself (no bucket wider than any batch can be), capped at the largest of BUCKETS."""
    top = min(int(max_rows), BUCKETS[-1])
    return tuple(b for b in BUCKETS if b < top) + (top,)


def bucket_of(rows: int, buckets: tuple[int, ...]) -> int | None:
    """Smallest bucket holding `rows` rows, None when the batch is wider than every bucket."""
    for b in buckets:
        if rows <= b:
            return b
    return None


def is_decode_batch(fb) -> bool:
    """One token per sequence over a cache (what a decode graph computes), logits of every row."""
    if fb.page_tables is None or fb.slot_mapping is None or fb.num_tokens == 0:
        return False
    if fb.num_tokens != len(fb.cu_seqlens) - 1 or fb.fresh:
        return False
    return fb.logits_rows is None or np.array_equal(fb.logits_rows, np.arange(fb.num_tokens))


def input_size(bucket: int, width: int) -> int:
    return bucket * (4 + width)


def input_views(flat, bucket: int, width: int):
    """(ids [B], positions [B], slots [B], tables [B, W]) as views of the flat int32 buffer."""
    b = bucket
    return flat[:b], flat[b:2 * b], flat[2 * b:3 * b], flat[3 * b:(3 + width) * b].reshape(b, width)


def state_slots_view(flat, bucket: int, width: int):
    """[B] the rows' recurrent-state slots: the last segment of the flat buffer."""
    return flat[(3 + width) * bucket:input_size(bucket, width)]


def pack_decode_inputs(fb, bucket: int, width: int, flat: np.ndarray) -> None:
    """Write a decode batch of R <= bucket rows, padded to `bucket`, into flat[:input_size] (host)."""
    R, tw = fb.num_tokens, fb.page_tables.shape[1]
    ids, pos, slots, tables = input_views(flat, bucket, width)
    ids[:R], ids[R:] = fb.token_ids, 0
    pos[:R], pos[R:] = fb.positions, 0
    slots[:R], slots[R:] = fb.slot_mapping, -1          # padding rows write no K/V
    tables[:R, :tw], tables[:R, tw:] = fb.page_tables, -1
    tables[R:] = 0                                      # padding rows read key 0 of page 0
    states = state_slots_view(flat, bucket, width)
    if fb.recurrent is None:
        states[:] = 0
    else:                                               # padding rows update the pools' spare slot
        states[:R], states[R:] = fb.recurrent.slots, fb.recurrent.pools.slots - 1


def run_padded(model, cache, flat, seq_idx, bucket: int, width: int, pools=None):
    """The decode step over the packed buffers (device or host): logits [bucket, V]. pools: a hybrid
    model's recurrent-state pools, which the rows' state slots index."""
    ids, pos, slots, tables = input_views(flat, bucket, width)
    recurrent = None if pools is None else PooledStates(pools, state_slots_view(flat, bucket, width))
    return model.run(ids, pos, None, cache, slots=slots, tables=tables, seq_idx=seq_idx[:bucket],
                     longest=model.max_context, recurrent=recurrent)


class DecodeGraphs:
    """Per-bucket CUDA graphs of the decode step of `model` over `cache` (batches up to max_rows).

    forward(fb) returns the logits [R, V] of a decode batch by replaying a graph, or None when the
    batch must run eagerly (not a decode batch, wider than every bucket, a plug-in active, graphs
    off, or the CPU backend). The logits live in the graph's output buffer: read them (sample)
    before the next forward() of the same bucket.
    """

    def __init__(self, model, cache, max_rows: int, enabled: bool | None = None, pools=None):
        self.model, self.cache, self.pools = model, cache, pools
        self.buckets = buckets_for(max_rows)
        self.width = -(-model.max_context // cache.page_size)     # pages a table can ever hold
        wanted = graphs_enabled_by_env() if enabled is None else bool(enabled)
        self.enabled = wanted and model.backend.is_gpu
        self.disabled_reason: str | None = None
        self._graphs: dict[int, tuple[object, object]] = {}       # bucket -> (graph, logits [B, V])
        self.replays = 0
        if self.enabled:
            self._allocate()

    @property
    def captured(self) -> list[int]:
        return sorted(self._graphs)

    def _allocate(self) -> None:
        import cupy as cp
        self._cp = cp
        n = input_size(self.buckets[-1], self.width)
        self._pinned = [cp.cuda.alloc_pinned_memory(n * 4) for _ in range(2)]   # async host -> device
        self._host = [np.frombuffer(p, np.int32, n) for p in self._pinned]      # 2 x [n] staging
        self._copied = [cp.cuda.Event(disable_timing=True) for _ in range(2)]   # each one's last copy
        self._turn = 0
        self._inputs = cp.zeros(n, dtype=cp.int32)                # [n] what every graph reads
        self._seq_idx = cp.arange(self.buckets[-1], dtype=cp.int32)   # row r is sequence r
        self._pool = cp.cuda.MemoryPool()
        self._stream = cp.cuda.Stream(non_blocking=True)
        self._ready = cp.cuda.Event(disable_timing=True)
        self._done = cp.cuda.Event(disable_timing=True)

    def forward(self, fb):
        """Logits [R, V] (fp32, device) of a decode batch from a graph replay, or None (run eagerly)."""
        if not self.enabled or any_active() or not is_decode_batch(fb):
            return None
        bucket = bucket_of(fb.num_tokens, self.buckets)
        if bucket is None or fb.page_tables.shape[1] > self.width \
                or int(fb.positions.max()) >= self.model.max_context:   # eager raises the usual error
            return None
        check_ids(fb.known_token_ids, self.model.config.vocab_size)   # host ids: no device traffic
        n = input_size(bucket, self.width)
        self._turn ^= 1                       # the staging buffer not used by the previous step
        host, copied = self._host[self._turn], self._copied[self._turn]
        copied.synchronize()                  # its last copy has left (at once, unless steps overlap)
        pack_decode_inputs(fb, bucket, self.width, host)
        cp, stream = self._cp, self._stream
        caller = cp.cuda.get_current_stream()
        self._ready.record(caller)            # our stream waits for whatever the caller queued
        stream.wait_event(self._ready)
        self._inputs[:n].set(host[:n], stream=stream)
        copied.record(stream)
        with stream:
            fb.with_feedback(input_views(self._inputs, bucket, self.width)[0])
        if bucket not in self._graphs:
            try:
                self._capture(bucket)
            except Exception as exc:          # never let a capture problem stop serving
                self._give_up(f"capturing the {bucket}-row decode graph failed ({type(exc).__name__}: {exc})")
                stream.synchronize()
                return None
        graph, logits = self._graphs[bucket]
        graph.launch(stream)
        self._done.record(stream)
        caller.wait_event(self._done)         # the caller's sampler reads the logits after the replay
        self.replays += 1
        return logits[:fb.num_tokens]

    def _capture(self, bucket: int) -> None:
        cp, stream = self._cp, self._stream
        self.model._grow_rope(self.model.max_context)     # the tables must never move after a capture
        states = state_slots_view(self._inputs, bucket, self.width)
        with cp.cuda.using_allocator(self._pool.malloc), stream:
            saved = None if self.pools is None else self.pools.save(states)
            self._run(bucket)                 # warm-up: this very step, eagerly (idempotent K/V writes)
            if saved is not None:             # the replay below takes the step's tokens in, not the warm-up
                self.pools.restore(states, saved)
            stream.synchronize()
            stream.begin_capture()
            try:
                logits = self._run(bucket)    # [B, V] fp32, rewritten by every replay
            finally:
                graph = stream.end_capture()
        self._graphs[bucket] = (graph, logits)

    def _run(self, bucket: int):
        return run_padded(self.model, self.cache, self._inputs, self._seq_idx, bucket, self.width, self.pools)

    def _give_up(self, reason: str) -> None:
        self.enabled, self.disabled_reason = False, reason
        self._graphs.clear()
        warnings.warn(f"CUDA graphs turned off, decode steps run eagerly: {reason}", RuntimeWarning, stacklevel=3)
