"""The model runner (chapters 09-14): the device side of one step.

It owns the model, the KV cache memory and the decode CUDA graphs; the scheduler owns only metadata.
A step is three calls, which the engine loop (engine/runtime/engine_loop.py) composes either one
after the other (synchronous) or overlapped with the next step's launch (async scheduling):

    launched = runner.launch(batch, seeds)     queue forward + sampling on the device (CPU: run them)
    tokens = launched.tokens()                 wait for the sampled ids (the only host sync of a step)
    out = runner.complete(sched, launched, tokens)   hand them to the scheduler: a StepOutput

With async scheduling, a batch whose rows' logits depend on the token the batch in flight is still
sampling (penalties, a structured output's mask) queues only its forward pass at launch; once that
token is known, `runner.finish(launched, previous, tokens, is_live)` processes the logits and queues
the draw. The host does that work (advancing the automata, gathering masks) while the device runs
the forward pass, so it is off the device's critical path while it takes less time than the pass.

A decode-only batch replays the CUDA graph of its size bucket (engine/runtime/cuda_graphs.py);
anything else, or a step while a learner's stage is plugged in, runs `Model.forward` eagerly.
"""
from __future__ import annotations

import dataclasses
import functools
import time
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.formats.config import HybridConfig
from engine.model.forward_pass import ForwardBatch, Model
from engine.model.kv_cache import KVCache, kv_bytes_per_token
from engine.ops.logits_processing import masked_logits, process_logits, token_logprobs
from engine.ops.sampling import SampledTokens, start_sampling
from engine.runtime.cuda_graphs import DecodeGraphs
from engine.runtime.draft_model import DraftModelProposer
from engine.runtime.engine_config import EngineConfig
from engine.runtime.recurrent_states import RecurrentSlots, RecurrentStates
from engine.runtime.sampling_params import step_uniforms
from engine.runtime.scheduler import PENDING, Batch, Row, Scheduler, StepOutput
from engine.runtime.speculative import verify_step
from engine.runtime.structured_outputs import StructuredOutputs

# What the KV pool may take by default: half of the GPU memory free after the weights are loaded
# (the rest is for activations, the logits and cuBLAS workspaces), 1 GiB of host memory on the CPU.
GPU_KV_FRACTION = 0.5
CPU_KV_MIB = 1024.0


def default_kv_mib(wanted_mib: float, free_gpu_bytes: int | None) -> float:
    """The KV pool's default size: what every seat at full context would take (`wanted_mib`), capped
    by GPU_KV_FRACTION of the free GPU memory (free_gpu_bytes), or by CPU_KV_MIB on the CPU."""
    cap = CPU_KV_MIB if free_gpu_bytes is None else GPU_KV_FRACTION * free_gpu_bytes / 2**20
    return min(wanted_mib, cap)


def decode_rows(ec: EngineConfig) -> int:
    """The most rows a decode step can have: one per seat, or, speculating, 1 + k for each of the
    requests a verify step may hold (split_verify_rows)."""
    spec = ec.speculative
    if spec is None:
        return ec.max_seqs
    return max(ec.max_seqs, min(ec.max_seqs, spec.max_batch) * (1 + spec.num_tokens))


def split_verify_rows(batch: Batch) -> tuple[np.ndarray, np.ndarray]:
    """(cu_seqlens [S + 1], page_tables [S, W]) of the forward pass: the batch's own, except that each
    verify row (speculative decoding) is cut into one-token sequences that share its page table.

    Why this computes the same thing: token j of a verify row attends to the positions up to its own,
    exactly as a decode row at that position does, and every layer writes the whole batch's K/V before
    it attends. So a step of decode and verify rows is a decode step: it runs on the decode kernels and
    replays the decode CUDA graphs (not ~190 kernels launched one by one), and the verify row's logits
    come from the same kernels as plain decoding's (the same bf16 rounding)."""
    if not any(row.draft for row in batch.rows):
        return batch.cu_seqlens, batch.page_tables
    parts = np.array([len(row.token_ids) if row.draft else 1 for row in batch.rows])      # [R] sequences per row
    lengths = np.repeat(np.where(parts > 1, 1, batch.lengths), parts)                     # [S]
    return (np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32),
            np.repeat(batch.page_tables, parts, axis=0))


class RowLabels:
    """What to call each row of a batch in an error ("request 3, step 7"), formatted only when a
    row's logits are not finite (not every step for every row)."""

    def __init__(self, rows: list[Row]):
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
    done: Any = None                    # GPU, no row samples: a cupy.cuda.Event after the step (tokens() waits on it)
    fed: list[Row] | None = None        # the rows `sampled` holds, in order (None: all of `sampling`)
    verify: Any = None                  # speculative decoding: () -> the tokens each verify row yields
    logprobs: Any = None                # (rows of `fed`, device arrays of token_logprobs) when asked for
    waiting: Any = None                 # (logits, seeds): the draw waits for the batch in flight (finish())

    def token_logprobs(self) -> dict[int, tuple[float, list[tuple[int, float]]]]:
        """{request id: (the sampled token's logprob, [(id, logprob)] of the asked alternatives)} (after tokens())."""
        if self.logprobs is None:
            return {}
        rows, arrays = self.logprobs
        chosen, top, top_lp = (a.get() if hasattr(a, "get") else a for a in arrays)
        fed = self.sampling if self.fed is None else self.fed
        out = {}
        for j, r in enumerate(rows):
            k = fed[r].params.logprobs
            out[fed[r].request_id] = (float(chosen[j]), [(int(t), float(v)) for t, v in zip(top[j, :k], top_lp[j, :k])])
        return out

    def tokens(self, is_live=None) -> list:
        """The sampled ids, once the step has run: one per sampling row, a list for a verify row.
        is_live(request_id): only those rows' logits must be finite (async scheduling: the others
        belong to requests that ended meanwhile)."""
        if self.waiting is not None:
            raise RuntimeError("this step's draw waits for the batch before it: ModelRunner.finish() first")
        fed = self.sampling if self.fed is None else self.fed
        ids: list = []
        if self.sampled is not None:
            checked = None if is_live is None else [is_live(row.request_id) for row in fed]
            ids = self.sampled.wait(RowLabels(fed), checked).tolist()
        elif self.done is not None:
            self.done.synchronize()           # the host never runs more than one step ahead
        if self.verify is None:
            return ids
        verified, plain = iter(self.verify(is_live)), iter(ids)
        return [next(verified) if row.draft else next(plain) for row in self.sampling]


class ModelRunner:
    """The model, its KV cache and its decode graphs, driven one batch at a time."""

    def __init__(self, model: Model, engine_config: EngineConfig, model_dir=None, tokenizer=None,
                 eos_token_ids: set[int] | None = None):
        self.model, self.backend, self.config = model, model.backend, model.config
        # structured outputs: each constrained request's automaton over the tokenizer's vocabulary
        self.structured = StructuredOutputs(tokenizer, self.config.vocab_size, eos_token_ids or set(), self.backend.xp)
        # a hybrid model's linear layers: one recurrent state per request, beside the cache (on the GPU
        # its pools are allocated first, so that the KV pool's default size leaves room for them)
        self.recurrent: RecurrentStates | RecurrentSlots | None = None
        if isinstance(self.config, HybridConfig):
            self.recurrent = (RecurrentSlots(self.config, engine_config.max_seqs) if self.backend.is_gpu
                              else RecurrentStates(self.config))
        self.cache, self.engine_config = self._allocate_cache(engine_config)
        # decode steps replayed as CUDA graphs per batch-size bucket (GPU only; None: on unless
        # ENGINE_CUDA_GRAPHS=0); any other batch, or a plug-in, runs eagerly
        self.decode_graphs = DecodeGraphs(model, self.cache, decode_rows(self.engine_config),
                                          enabled=engine_config.cuda_graphs,
                                          pools=self.recurrent.pools if isinstance(self.recurrent, RecurrentSlots)
                                          else None)
        # speculative method "draft": the draft model, its own KV pool and decode graphs (after the
        # target's pool, so that the target's share of the memory is what it would be without it)
        self.proposer: DraftModelProposer | None = None
        spec = self.engine_config.speculative
        if spec is not None and spec.method == "draft":
            ec = self.engine_config
            self.proposer = DraftModelProposer(spec.model, self.backend, self.config, max_context=ec.max_context,
                                               max_rows=decode_rows(ec), max_seqs=ec.max_seqs, page_size=ec.page_size,
                                               cuda_graphs=ec.cuda_graphs, target_dir=model_dir)
        self._last_completion = 0.0
        self._writer: weakref.ref | None = None   # the scheduler whose batches last wrote the pool

    # ---- memory ------------------------------------------------------------------------------
    def _allocate_cache(self, ec: EngineConfig) -> tuple[KVCache, EngineConfig]:
        """The KV pool, and the settings it leaves (a contiguous cache may seat fewer sequences)."""
        per_token = kv_bytes_per_token(self.config, self.backend)
        if ec.kv_cache_mib is not None:
            mib = ec.kv_cache_mib
        else:   # enough for every sequence at full context, capped by what the device can spare
            free = self.backend.xp.cuda.runtime.memGetInfo()[0] if self.backend.is_gpu else None
            mib = default_kv_mib(ec.max_seqs * ec.max_context * per_token / 2**20, free)
        if ec.kv_cache == "contiguous":
            slots = int(mib * 2**20 // (per_token * ec.max_context))
            if slots < 1:
                raise ValueError(f"a KV cache of {mib:.0f} MiB cannot hold one slot of {ec.max_context} tokens")
            ec = dataclasses.replace(ec, max_seqs=min(ec.max_seqs, slots))
            return KVCache.contiguous(self.config, ec.max_seqs, ec.max_context, self.backend), ec
        return KVCache.paged(self.config, mib, ec.page_size, self.backend), ec

    def claim_cache(self, sched: Scheduler) -> None:
        """`sched` is about to run batches on this pool. If another scheduler wrote it since sched last
        did (LLM.step drives a learner's scheduler over the engine's pool), the pages sched has cached
        hold someone else's K/V now: it forgets them."""
        if self._writer is not None and self._writer() is not sched:
            if hasattr(sched, "clear_prefix_cache"):
                sched.clear_prefix_cache()
            if self.proposer is not None:      # the draft's sequences belong to the other scheduler
                self.proposer.reset()
            if self.recurrent is not None:     # so do the recurrent states (request ids start over)
                self.recurrent.clear()
        self._writer = weakref.ref(sched)

    # ---- one step ----------------------------------------------------------------------------
    def launch(self, batch: Batch, seeds: dict[int, int], previous: LaunchedStep | None = None) -> LaunchedStep:
        """Queue the batch's forward pass and sampling on the device (on the CPU: run them).

        Async scheduling: the batch's PENDING tokens are what `previous` (the batch still in flight)
        samples; they are gathered from its device ids, so the host never waits for them."""
        t0 = time.perf_counter()
        if batch.page_copies:          # copy-on-write: a shared page first becomes this row's own
            self.cache.copy_pages(batch.page_copies)
        sampling = [batch.rows[r] for r in batch.sampling_rows]   # a mid-prompt chunk samples nothing
        # (a step of chunks only still asks for one row of logits: no zero-row GEMM)
        logits_rows = batch.logits_indices if sampling else batch.last_token_indices[-1:]
        cu_seqlens, page_tables = split_verify_rows(batch)
        recurrent = None
        if self.recurrent is not None:
            sched = self._writer() if self._writer is not None else None
            recurrent = self.recurrent.for_rows(batch.rows, getattr(sched, "is_running", None))
        fb = ForwardBatch(batch.token_ids, batch.positions, cu_seqlens, page_tables, batch.slot_mapping,
                          logits_rows=logits_rows, feedback=self._feedback(batch, previous), recurrent=recurrent)
        try:
            logits = self.decode_graphs.forward(fb)      # None: not a graph-able step
            if logits is None:
                logits = self.model.forward(fb, self.cache)
        except BaseException:
            if self.recurrent is not None:
                self.recurrent.forget(batch.rows)
            raise
        done = verify = None
        fed = sampling
        if any(row.draft for row in sampling):     # speculative decoding: verify rows read 1 + k positions
            offsets = np.cumsum([0] + [row.num_logits for row in sampling])[:-1]
            fed = [row for row in sampling if not row.draft]
            checks = [(row, int(offset)) for row, offset in zip(sampling, offsets, strict=True) if row.draft]
            xp = self.backend.xp
            verify = functools.partial(verify_step, xp, logits, checks, dict(seeds))
            plain = offsets[[i for i, row in enumerate(sampling) if not row.draft]]
            logits = logits[plain if xp is np else xp.asarray(plain)]
        if not fed and self.backend.is_gpu:
            done = self.backend.xp.cuda.Event(disable_timing=True)
            done.record()
        step = LaunchedStep(batch, sampling, None, t0, time.monotonic(), done, fed=fed, verify=verify)
        if fed and any(row.history is not None and PENDING in row.token_ids for row in fed):
            step.waiting = (logits, dict(seeds))      # the draw needs a token the batch in flight samples
        elif fed:
            self._draw(step, logits, seeds, {})
        return step

    def finish(self, step: LaunchedStep, previous: LaunchedStep | None, tokens: list | None, is_live) -> None:
        """Async scheduling: queue the draw of a step launched while `previous` was in flight, now that
        `previous` has sampled `tokens` (None: it failed) and the scheduler has them. Rows whose
        request ended or failed meanwhile are drawn unprocessed (their tokens are discarded)."""
        if step.waiting is None:
            return
        (logits, seeds), step.waiting = step.waiting, None
        known = {}
        if previous is not None and tokens is not None:
            known = {row.request_id: token for row, token in zip(previous.sampling, tokens, strict=True)
                     if is_live(row.request_id)}
        self._draw(step, logits, seeds, known)

    def _draw(self, step: LaunchedStep, logits, seeds: dict[int, int], known: dict) -> None:
        """Queue the sampling (and the asked log-probabilities) of the step's rows that are not verify
        rows; `known`: the tokens, by request, that rows holding a pending token were waiting for."""
        fed = step.sampling if step.fed is None else step.fed
        raw = None
        if any(getattr(row.params, "processes_logits", False) for row in fed):
            raw, logits = logits, self._processed(logits, fed, known)
        uniforms = step_uniforms([seeds[row.request_id] for row in fed], [row.num_generated for row in fed])
        step.sampled = start_sampling(logits, [row.params for row in fed], uniforms, raw)
        asked = [i for i, row in enumerate(fed) if getattr(row.params, "logprobs", None) is not None]
        if asked:
            k = max(fed[i].params.logprobs for i in asked)
            step.logprobs = (asked, token_logprobs(self.backend.xp, logits if raw is None else raw, asked,
                                                   step.sampled.ids, k))

    def _processed(self, logits, fed: list[Row], known: dict):
        """The sampling rows' logits after their penalties, logit bias, min-p and structured-output
        masks (engine/ops/logits_processing.py): a float32 copy, so a graph's output buffer is never
        written. A row holding a pending token counts it from `known`; without it (its request ended
        or failed while the token was drawn) the row is left as it is."""
        xp = self.backend.xp
        rows, masked, constrained = [], [], []
        for i, row in enumerate(fed):
            params = row.params
            if not getattr(params, "processes_logits", False):
                continue
            prompt, output = row.history or ([], [])
            if row.history is not None and PENDING in row.token_ids:
                if row.request_id not in known:
                    continue
                token = known[row.request_id]
                output = output + (token if isinstance(token, list) else [token])
            if params.adjusts_logits:
                rows.append((i, params, prompt, output))
            if params.structured is not None:
                masked.append(i)
                constrained.append((row.request_id, params.structured, output))
        # each constrained row's mask: a row of the runner's table of masks (-1: the row has none)
        slots = np.full(len(fed), -1, dtype=np.int32)
        if masked:
            slots[masked] = self.structured.slots(constrained)
        return process_logits(xp, masked_logits(xp, logits, self.structured.table, slots), rows)

    def _feedback(self, batch: Batch, previous: LaunchedStep | None):
        """ForwardBatch.feedback of a batch with PENDING tokens: (their indices, the device ids that
        `previous` sampled for their requests)."""
        pending = batch.pending_indices
        if not pending.size:
            return None
        if previous is None or previous.sampled is None:
            raise RuntimeError("a batch with pending tokens needs the samples of the batch in flight")
        where = {row.request_id: i for i, row in enumerate(previous.sampling if previous.fed is None else previous.fed)}
        row_of_token = np.repeat(np.arange(len(batch.rows), dtype=np.int32), batch.lengths)[pending]
        src = np.fromiter((where[batch.rows[r].request_id] for r in row_of_token), dtype=np.int32,
                          count=pending.size)
        xp, ids = self.backend.xp, previous.sampled.ids
        fed = ids[xp.asarray(src) if self.backend.is_gpu else src]
        # a row whose logits were not finite may have sampled any id; its request is failed when step n
        # completes, but its row here still runs: keep the id inside the embedding table
        return pending, xp.clip(fed, 0, self.config.vocab_size - 1)

    def complete(self, sched: Scheduler, launched: LaunchedStep, tokens: list[int]) -> StepOutput:
        """Hand the sampled tokens to the scheduler. A step's `seconds` run from its launch, or from the
        previous completion when steps overlap, so that the seconds of a log add up to its wall time."""
        out = sched.complete(launched.batch.batch_id, tokens)
        if self.recurrent is not None:     # ended requests need their state no more
            self.recurrent.keep_live(sched.is_live)
        out.logprobs = launched.token_logprobs()
        now = time.perf_counter()
        out.record["seconds"] = now - max(launched.started, self._last_completion)
        self._last_completion = now
        return out
