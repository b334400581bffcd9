"""`engine.LLM`: serve many prompts at once (chapters 09-12).

The model runner: it owns the model and the KV cache memory, and drives the scheduler (which owns
only metadata) one step at a time:

    schedule() -> Batch  ->  model.forward(ForwardBatch, cache)  ->  sample  ->  complete()

One engine loop (engine/runtime/engine_loop.py) owns the model, the cache and one long-lived scheduler:
`submit()` hands it a request from any thread and returns a handle that streams tokens; `generate()`
is submit() for a list of prompts, then waiting. An LLM is therefore safe to share between threads.
`new_scheduler()` + `step(sched, seeds)` drive the same runner by hand (chapters 10-11), only while
the engine loop serves nothing.

Batching is "continuous" (admit whenever capacity frees up) or "static" (one group at a time);
the cache is "paged" (a shared pool of 16-token pages) or "contiguous" (one max_context slot per
sequence). Every combination returns the same greedy tokens: the tests hold them to it.
"""
from __future__ import annotations

import numbers
import os
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.backend import resolve_backend
from engine.formats.config import check_serving_args, load_config
from engine.model.forward_pass import ForwardBatch, Model, check_vocab_fits, load_model
from engine.model.kv_cache import KVCache, kv_bytes_per_token
from engine.ops.sampling import SampledTokens, start_sampling
from engine.runtime.cuda_graphs import DecodeGraphs
from engine.runtime.engine_loop import BatchFailed, EngineLoop, RequestHandle
from engine.runtime.kv_allocator import PageAllocator, SlotAllocator
from engine.runtime.sampling_params import SamplingParams, step_uniforms
from engine.runtime.scheduler import ADMISSIONS, Batch, Row, Scheduler

BATCHING = ("continuous", "static")
KV_CACHES = ("paged", "contiguous")
# The contiguous cache's default context: each slot reserves max_context positions up front, so the
# model's whole context (131,072 for Llama 3.2) would leave room for a handful of sequences at most.
DEFAULT_MAX_CONTEXT = 4096
# What the KV pool may take by default: half of the GPU memory free after the weights are loaded
# (the rest is for activations, the logits and cuBLAS workspaces), 1 GiB of host memory on the CPU.
GPU_KV_FRACTION = 0.5
CPU_KV_MIB = 1024.0
ASYNC_SWITCH = "ENGINE_ASYNC_SCHEDULING"     # "0" turns async scheduling off


def default_async_scheduling(backend, scheduler_cls) -> bool:
    """On where there is something to overlap (a GPU) and the scheduler is the engine's own (a
    learner's class of chapters 10-11 keeps the one-batch-at-a-time contract), unless
    ENGINE_ASYNC_SCHEDULING=0."""
    wanted = os.environ.get(ASYNC_SWITCH, "1").strip().lower() not in ("0", "false", "off", "no")
    return wanted and backend.is_gpu and scheduler_cls is Scheduler


@dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]       # generated tokens (a stopping eos included)
    text: str                  # decoded generated text (special tokens skipped); "" without a tokenizer
    finish_reason: str         # "stop" | "length" | "cancelled"


class RowLabels:
    """What to call each row of a batch in an error ("request 3, step 7"), formatted only when a
    row's logits are not finite (not every step for every row)."""

    def __init__(self, rows):
        self._rows = rows

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, r) -> str:
        row = self._rows[r]
        return f"request {row.request_id}, step {row.num_generated}"


@dataclass
class LaunchedStep:
    """One batch queued on the device; tokens() waits for what its sampling rows sampled."""
    batch: Batch
    sampling: list[Row]                 # the rows that sample, in row order
    sampled: SampledTokens | None       # None when no row samples (a step of prompt chunks only)
    started: float                      # time.perf_counter() at launch
    launched_at: float                  # time.monotonic() at launch (the clock of handles' timestamps)
    done: object = None                 # GPU, no row samples: an event after the step (tokens() waits on it)

    def tokens(self, is_live=None) -> list[int]:
        """The sampled ids, once the step has run. is_live(request_id): only those rows' logits must be
        finite (async scheduling: the others belong to requests that ended meanwhile)."""
        if self.sampled is None:
            if self.done is not None:
                self.done.synchronize()       # the host never runs more than one step ahead
            return []
        checked = None if is_live is None else [is_live(row.request_id) for row in self.sampling]
        return self.sampled.wait(RowLabels(self.sampling), checked).tolist()


def default_max_context(model_max: int, kv_cache: str = "contiguous") -> int:
    """The context a request may reach when none is given.

    paged: the model's whole context (max_position_embeddings). Pages are taken as tokens arrive, so
    a long context costs nothing until it is used; the pool decides how long a request can get, and
    one that could never fit in it is refused at submit.
    contiguous (and ChatSession): at most DEFAULT_MAX_CONTEXT, because every slot reserves its whole
    context whether it is used or not.
    """
    return model_max if kv_cache == "paged" else min(model_max, DEFAULT_MAX_CONTEXT)


def default_kv_mib(wanted_mib: float, free_gpu_bytes: int | None) -> float:
    """The KV pool's default size: what every seat at full context would take (`wanted_mib`), capped
    by GPU_KV_FRACTION of the free GPU memory (free_gpu_bytes), or by CPU_KV_MIB on the CPU."""
    cap = CPU_KV_MIB if free_gpu_bytes is None else GPU_KV_FRACTION * free_gpu_bytes / 2**20
    return min(wanted_mib, cap)


class LLM:
    def __init__(self, model_dir, backend="auto", batching: str = "continuous", kv_cache: str = "paged",
                 kv_cache_mib: float | None = None, *, max_context: int | None = None,
                 max_seqs: int | None = None, max_batch_tokens: int | None = None,
                 admission: str = "conservative", page_size: int = 16, chunked_prefill: bool = True,
                 cuda_graphs: bool | None = None, async_scheduling: bool | None = None,
                 scheduler_cls: type[Scheduler] = Scheduler, allocator_cls: type[PageAllocator] = PageAllocator):
        """chunked_prefill: long prompts are prefilled in chunks of the step's token budget, mixed with
        the running requests' decodes (continuous batching; chapter 13). cuda_graphs: replay decode
        steps as CUDA graphs per batch size (default: on, unless ENGINE_CUDA_GRAPHS=0).
        async_scheduling: the engine loop schedules step N+1 while the GPU runs step N (default: on a
        GPU with the engine's own Scheduler, unless ENGINE_ASYNC_SCHEDULING=0; on the CPU there is
        nothing to overlap: NumPy computes a step before the host can move on).
        scheduler_cls / allocator_cls: your own Scheduler or PageAllocator subclass (chapters 10-11's
        exercises) runs in place of the engine's, with the same constructor arguments."""
        # every argument is checked against config.json before a weight is read
        for name, value, choices in (("batching", batching, BATCHING), ("kv_cache", kv_cache, KV_CACHES),
                                     ("admission", admission, ADMISSIONS)):
            if not isinstance(value, str) or value not in choices:
                raise ValueError(f"{name} must be one of {choices}, got {value!r}")
        for name, value in (("cuda_graphs", cuda_graphs), ("async_scheduling", async_scheduling)):
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"{name} must be True, False or None (the environment decides), got {value!r}")
        if not isinstance(chunked_prefill, bool):
            raise ValueError(f"chunked_prefill must be True or False, got {chunked_prefill!r}")
        model_dir = Path(model_dir)
        config = load_config(model_dir)
        check_serving_args(config, max_context=max_context, max_seqs=max_seqs, max_batch_tokens=max_batch_tokens,
                           page_size=page_size, kv_cache_mib=kv_cache_mib)
        b = resolve_backend(backend)
        self.max_context = int(max_context) if max_context is not None else \
            default_max_context(config.max_position_embeddings, kv_cache)
        self.tokenizer = None
        if (model_dir / "tokenizer.json").is_file():
            from engine.text.tokenizer import load_tokenizer
            self.tokenizer = load_tokenizer(model_dir)
            check_vocab_fits(self.tokenizer, config)
        self.model: Model = load_model(model_dir, b, self.max_context)
        self.config, self.backend = config, b
        self.batching, self.kv_cache_kind, self.admission = batching, kv_cache, admission
        self.chunked_prefill = chunked_prefill
        self.max_seqs = int(max_seqs) if max_seqs is not None else (256 if b.is_gpu else 16)
        self.max_batch_tokens = max(int(max_batch_tokens) if max_batch_tokens is not None else
                                    (8192 if b.is_gpu else 2048), self.max_seqs)
        self.page_size = int(page_size)
        self.scheduler_cls, self.allocator_cls = scheduler_cls, allocator_cls
        self.async_scheduling = (default_async_scheduling(b, scheduler_cls) if async_scheduling is None
                                 else async_scheduling)
        self.cache = self._allocate_cache(kv_cache_mib)
        # decode steps replayed as CUDA graphs per batch-size bucket (GPU only; None: on unless
        # ENGINE_CUDA_GRAPHS=0); any other batch, or a plug-in, runs eagerly
        self.decode_graphs = DecodeGraphs(self.model, self.cache, self.max_seqs, enabled=cuda_graphs)
        self.last_step_log: list[dict] = []
        self._last_completion = 0.0
        self._engine = EngineLoop(self)
        # GPU: a decode step of a single sequence (a chat, a lone request) replays a CUDA graph.
        self.use_cuda_graph = b.is_gpu and self.decode_graphs.enabled
        self._decode_graph = None

    # ---- memory ------------------------------------------------------------------------------
    def _default_kv_mib(self) -> float:
        """Enough for every sequence at full context, capped by what the device can spare."""
        per_token = kv_bytes_per_token(self.config, self.backend)
        wanted = self.max_seqs * self.max_context * per_token / 2**20
        free = self.backend.xp.cuda.runtime.memGetInfo()[0] if self.backend.is_gpu else None
        return default_kv_mib(wanted, free)

    def _allocate_cache(self, kv_cache_mib):
        mib = self._default_kv_mib() if kv_cache_mib is None else kv_cache_mib
        if self.kv_cache_kind == "contiguous":
            per_slot = kv_bytes_per_token(self.config, self.backend) * self.max_context
            slots = int(mib * 2**20 // per_slot)
            if slots < 1:
                raise ValueError(f"a KV cache of {mib:.0f} MiB cannot hold one slot of {self.max_context} tokens")
            self.max_seqs = min(self.max_seqs, slots)
            return KVCache.contiguous(self.config, self.max_seqs, self.max_context, self.backend)
        return KVCache.paged(self.config, mib, self.page_size, self.backend)

    def new_scheduler(self, first_request_id: int = 0, *, async_scheduling: bool = False) -> Scheduler:
        if self.kv_cache_kind == "contiguous":
            allocator = SlotAllocator(self.cache.num_pages, self.max_context)
        else:
            allocator = self.allocator_cls(self.cache.num_pages, self.page_size)
        # The finish rule lives in the scheduler alone; the tokenizer's eos (a chat model's end of turn)
        # stops a request as well as the config's.
        eos = set(self.config.eos_token_ids) | (self.tokenizer.eos_token_ids if self.tokenizer else set())
        return self.scheduler_cls(allocator, self.max_seqs, self.max_batch_tokens, self.max_context,
                                  eos, policy=self.batching, admission=self.admission,
                                  chunked_prefill=self.chunked_prefill, first_request_id=first_request_id,
                                  **({"async_scheduling": True} if async_scheduling else {}))

    # ---- serving -----------------------------------------------------------------------------
    def _prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model directory has no tokenizer.json: pass token ids")
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)
            self.model.validate_tokens(ids)       # the tokenizer's ids get the same check as ids passed in
            return ids
        ids = list(prompt)
        self.model.validate_tokens(ids)
        return [int(t) for t in ids]

    def submit(self, prompt, params: SamplingParams | None = None, *, session=None) -> RequestHandle:
        """Queue one prompt (text or token ids) from any thread; it joins the running batch at the next
        step. Returns a handle: .stream() / .astream() events, .result(), .cancel(), .request_id.

        Invalid prompts or params raise ValueError here, before anything runs. `session` (any hashable)
        keeps the request's KV pages after it ends, for the next request of that session to reuse
        its common prefix (a chat's next turn computes only the new tokens).
        """
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError("params must be an engine.SamplingParams")
        return self._engine.submit(self._prompt_ids(prompt), params, session)

    def drop_session(self, session) -> None:
        """Free the KV pages kept for `session` (a conversation that was reset or closed)."""
        self._engine.drop_session(session)

    def stats(self) -> dict:
        """A plain-dict snapshot of the engine: running/waiting counts, the page map (pages_total,
        pages_used, page_owners: request id per page, -1 free, -2 cached for a session), per-request
        states with timestamps (time.monotonic()), time-to-first-token values, tokens generated."""
        return self._engine.stats()

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Serve every prompt (strings or token-id lists); results in input order.

        Every request is checked before anything runs: a ValueError leaves nothing behind. Safe to call
        from several threads at once: all requests share the engine loop's batches.
        """
        if isinstance(prompts, str) or (len(prompts) and all(isinstance(t, numbers.Integral) for t in prompts)):
            prompts = [prompts]     # one prompt (text or token ids) rather than a list of them
        params = params if params is not None else SamplingParams()
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"got {len(plist)} SamplingParams for {len(prompts)} prompts")
        if not all(isinstance(p, SamplingParams) for p in plist):
            raise ValueError("params must be engine.SamplingParams (one, or one per prompt)")
        ids = [self._prompt_ids(p) for p in prompts]
        log = self._engine.collect_steps()
        handles = []
        try:
            handles = self._engine.submit_many([(prompt_ids, sp, None)
                                                for prompt_ids, sp in zip(ids, plist, strict=True)])
            outputs = [handle.result() for handle in handles]
        except BaseException:          # an error or Ctrl-C: the rest of this call is not wanted
            for handle in handles:
                handle.cancel()
            raise
        finally:
            self._engine.stop_collecting(log)
        self.last_step_log = log
        return outputs

    def close(self) -> None:
        """Stop the engine loop (it also stops when the LLM is garbage-collected)."""
        self._engine.close()

    def step(self, sched: Scheduler, seeds: dict[int, int]) -> bool:
        """Drive a scheduler of new_scheduler() by hand: one forward pass of whatever it picks; a
        failure leaves its state unchanged and re-raises. False when there was nothing to run.
        Refused while the engine loop serves requests (both would write the same cache)."""
        if sched.async_scheduling:
            raise ValueError("LLM.step drives a scheduler of new_scheduler(), one batch at a time "
                             "(not one with async scheduling, such as the engine loop's)")
        engine = self._engine
        with engine.lock:
            if sched is not engine.runtime.scheduler:
                if engine.runtime.scheduler.has_unfinished():
                    raise RuntimeError("the engine loop is serving requests: wait for them before stepping by hand")
                engine.runtime.scheduler.drop_all_sessions()     # their cached pages are about to be overwritten
                engine.manual = weakref.ref(sched)
            try:
                return self._step(sched, seeds) is not None
            except BatchFailed as failed:
                raise failed.__cause__ from None

    def _graph_decode(self, row):
        """Logits [1, V] of one sequence's decode step through the captured CUDA graph."""
        token, position = row.token_ids[0], row.start_pos
        if self._decode_graph is None:
            from engine.cuda_graph import DecodeGraph
            self._decode_graph = DecodeGraph(self.model, self.cache, token, position, row.page_table)
        return self._decode_graph(token, position, row.page_table)

    def _step(self, sched: Scheduler, seeds: dict[int, int]):
        """schedule -> forward -> sample -> complete. (batch, sampled tokens), or None when there was
        nothing to run; a failed forward pass is undone (sched.fail) and raised as BatchFailed."""
        batch = sched.schedule()
        if batch is None:
            return None
        try:
            launched = self._launch(batch, seeds)
            tokens = launched.tokens()
        except BaseException as exc:
            sched.fail(batch.batch_id)
            raise BatchFailed([row.request_id for row in batch.rows]) from exc
        self._complete(sched, launched, tokens)
        return batch, tokens

    def _launch(self, batch: Batch, seeds: dict[int, int], previous: LaunchedStep | None = None) -> LaunchedStep:
        """Queue the batch's forward pass and sampling on the device (on the CPU: run them).

        Async scheduling: the batch's PENDING tokens are what `previous` (the batch still in flight)
        samples; they are gathered from its device ids, so the host never waits for them."""
        t0 = time.perf_counter()
        sampling = [batch.rows[r] for r in batch.sampling_rows]   # a mid-prompt chunk samples nothing
        # (a step of chunks only still asks for one row of logits: no zero-row GEMM)
        logits_rows = batch.logits_indices if sampling else batch.last_token_indices[-1:]
        fb = ForwardBatch(batch.token_ids, batch.positions, batch.cu_seqlens, batch.page_tables,
                          batch.slot_mapping, logits_rows=logits_rows, feedback=self._feedback(batch, previous))
        logits = self.decode_graphs.forward(fb)          # None: not a graph-able step
        if logits is None and self.use_cuda_graph and batch.kind == "decode" and len(batch.rows) == 1 \
                and fb.feedback is None:
            logits = self._graph_decode(batch.rows[0])
        if logits is None:
            logits = self.model.forward(fb, self.cache)
        sampled = done = None
        if sampling:
            uniforms = step_uniforms([seeds[row.request_id] for row in sampling],
                                     [row.num_generated for row in sampling])
            sampled = start_sampling(logits, [row.params for row in sampling], uniforms)
        elif self.backend.is_gpu:
            done = self.backend.xp.cuda.Event(disable_timing=True)
            done.record()
        return LaunchedStep(batch, sampling, sampled, t0, time.monotonic(), done)

    def _feedback(self, batch: Batch, previous: LaunchedStep | None):
        """ForwardBatch.feedback of a batch with PENDING tokens: (their indices, the device ids that
        `previous` sampled for their requests)."""
        pending = batch.pending_indices
        if not pending.size:
            return None
        if previous is None or previous.sampled is None:
            raise RuntimeError("a batch with pending tokens needs the samples of the batch in flight")
        where = {row.request_id: i for i, row in enumerate(previous.sampling)}
        row_of_token = np.repeat(np.arange(len(batch.rows), dtype=np.int32), batch.lengths)[pending]
        src = np.fromiter((where[batch.rows[r].request_id] for r in row_of_token), dtype=np.int32,
                          count=pending.size)
        xp, ids = self.backend.xp, previous.sampled.ids
        fed = ids[xp.asarray(src) if self.backend.is_gpu else src]
        # a row whose logits were not finite may have sampled any id; its request is failed when step n
        # completes, but its row here still runs: keep the id inside the embedding table
        return pending, xp.clip(fed, 0, self.config.vocab_size - 1)

    def _complete(self, sched: Scheduler, launched: LaunchedStep, tokens: list[int]) -> None:
        """Hand the sampled tokens to the scheduler. A step's `seconds` run from its launch, or from the
        previous completion when steps overlap, so that the seconds of a log add up to its wall time."""
        sched.complete(launched.batch.batch_id, tokens)
        now = time.perf_counter()
        sched.step_log[-1]["seconds"] = now - max(launched.started, self._last_completion)
        self._last_completion = now
