"""`engine.LLM`: serve many prompts at once (chapters 09-12).

The model runner: it owns the model and the KV cache memory, and drives the scheduler (which owns
only metadata) one step at a time:

    schedule() -> Batch  ->  model.forward(ForwardBatch, cache)  ->  sample  ->  complete()

Batching is "continuous" (admit whenever capacity frees up) or "static" (one group at a time);
the cache is "paged" (a shared pool of 16-token pages) or "contiguous" (one max_context slot per
sequence). Every combination returns the same greedy tokens: the tests hold them to it.
"""
from __future__ import annotations

import numbers
import time
from dataclasses import dataclass
from pathlib import Path

from engine.backend import resolve_backend
from engine.config import load_config
from engine.kv_cache import KVCache
from engine.model import ForwardBatch, Model, load_model
from engine.paged_kv import PageAllocator, SlotAllocator
from engine.sampling import SamplingParams, resolve_seed, sample, step_uniform
from engine.scheduler import Scheduler

BATCHING = ("continuous", "static")
KV_CACHES = ("paged", "contiguous")
# The contiguous cache's default context: each slot reserves max_context positions up front, so the
# model's whole context (131,072 for Llama 3.2) would leave room for a handful of sequences at most.
DEFAULT_MAX_CONTEXT = 4096
# What the KV pool may take by default: half of the GPU memory free after the weights are loaded
# (the rest is for activations, the logits and cuBLAS workspaces), 1 GiB of host memory on the CPU.
GPU_KV_FRACTION = 0.5
CPU_KV_MIB = 1024.0


@dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]       # generated tokens (a stopping eos included)
    text: str                  # decoded generated text (special tokens skipped); "" without a tokenizer
    finish_reason: str         # "stop" | "length"


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
                 admission: str = "conservative", page_size: int = 16, chunked_prefill: bool = True):
        if batching not in BATCHING:
            raise ValueError(f"batching must be one of {BATCHING}, got {batching!r}")
        if kv_cache not in KV_CACHES:
            raise ValueError(f"kv_cache must be one of {KV_CACHES}, got {kv_cache!r}")
        if kv_cache_mib is not None and not kv_cache_mib > 0:
            raise ValueError(f"kv_cache_mib must be > 0, got {kv_cache_mib!r}")
        b = resolve_backend(backend)
        model_dir = Path(model_dir)
        config = load_config(model_dir)
        self.max_context = max_context or default_max_context(config.max_position_embeddings, kv_cache)
        self.model: Model = load_model(model_dir, b, self.max_context)
        self.config, self.backend = config, b
        self.tokenizer = None
        if (model_dir / "tokenizer.json").is_file():
            from engine.tokenizer import load_tokenizer
            self.tokenizer = load_tokenizer(model_dir)
        self.batching, self.kv_cache_kind, self.admission = batching, kv_cache, admission
        self.chunked_prefill = chunked_prefill
        self.max_seqs = max_seqs or (256 if b.is_gpu else 16)
        self.max_batch_tokens = max(max_batch_tokens or (8192 if b.is_gpu else 2048), self.max_seqs)
        self.page_size = page_size
        self.cache = self._allocate_cache(kv_cache_mib)
        self.last_step_log: list[dict] = []

    # ---- memory ------------------------------------------------------------------------------
    def _default_kv_mib(self) -> float:
        """Enough for every sequence at full context, capped by what the device can spare."""
        per_token = self.config.kv_bytes_per_token(2 if self.backend.is_gpu else 4)
        wanted = self.max_seqs * self.max_context * per_token / 2**20
        free = self.backend.xp.cuda.runtime.memGetInfo()[0] if self.backend.is_gpu else None
        return default_kv_mib(wanted, free)

    def _allocate_cache(self, kv_cache_mib):
        mib = self._default_kv_mib() if kv_cache_mib is None else kv_cache_mib
        if self.kv_cache_kind == "contiguous":
            per_slot = self.config.kv_bytes_per_token(2 if self.backend.is_gpu else 4) * self.max_context
            slots = int(mib * 2**20 // per_slot)
            if slots < 1:
                raise ValueError(f"a KV cache of {mib:.0f} MiB cannot hold one slot of {self.max_context} tokens")
            self.max_seqs = min(self.max_seqs, slots)
            return KVCache.contiguous(self.config, self.max_seqs, self.max_context, self.backend)
        return KVCache.paged(self.config, mib, self.page_size, self.backend)

    def new_scheduler(self) -> Scheduler:
        if self.kv_cache_kind == "contiguous":
            allocator = SlotAllocator(self.cache.num_blocks, self.max_context)
        else:
            allocator = PageAllocator(self.cache.num_blocks, self.page_size)
        return Scheduler(allocator, self.max_seqs, self.max_batch_tokens, self.max_context,
                         self.config.eos_token_ids, policy=self.batching, admission=self.admission,
                         chunked_prefill=self.chunked_prefill)

    # ---- serving -----------------------------------------------------------------------------
    def _prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model directory has no tokenizer.json: pass token ids")
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        ids = list(prompt)
        self.model.validate_tokens(ids)
        return [int(t) for t in ids]

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Serve every prompt (strings or token-id lists); results in input order.

        Every request is checked before anything runs: a ValueError leaves nothing behind.
        """
        if isinstance(prompts, str) or (len(prompts) and all(isinstance(t, numbers.Integral) for t in prompts)):
            prompts = [prompts]     # one prompt (text or token ids) rather than a list of them
        params = params if params is not None else SamplingParams()
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"got {len(plist)} SamplingParams for {len(prompts)} prompts")
        if not all(isinstance(p, SamplingParams) for p in plist):
            raise ValueError("params must be engine.SamplingParams (one, or one per prompt)")
        sched = self.new_scheduler()
        ids = [sched.submit(self._prompt_ids(p), sp) for p, sp in zip(prompts, plist)]
        seeds = {rid: resolve_seed(sp) for rid, sp in zip(ids, plist)}
        results = {}
        while sched.has_unfinished():
            if not self.step(sched, seeds):
                raise RuntimeError("the scheduler has unfinished requests but scheduled nothing")
            results.update((r.request_id, r) for r in sched.pop_finished())
        results.update((r.request_id, r) for r in sched.pop_finished())
        self.last_step_log = sched.step_log
        return [self._output(results[rid]) for rid in ids]

    def step(self, sched: Scheduler, seeds: dict[int, int]) -> bool:
        """One forward pass of whatever the scheduler picks; a failure leaves its state unchanged.
        False when there was nothing to run."""
        batch = sched.schedule()
        if batch is None:
            return False
        t0 = time.perf_counter()
        sampling = [batch.rows[r] for r in batch.sampling_rows]   # a mid-prompt chunk samples nothing
        try:
            # (a step of chunks only still asks for one row of logits: no zero-row GEMM)
            logits_rows = batch.logits_indices if sampling else batch.last_token_indices[-1:]
            fb = ForwardBatch(batch.token_ids, batch.positions, batch.cu_seqlens, batch.block_tables,
                              batch.slot_mapping, logits_rows=logits_rows)
            logits = self.model.forward(fb, self.cache)
            tokens = sample(logits, [row.params for row in sampling],
                            [step_uniform(seeds[row.request_id], row.num_generated) for row in sampling]
                            ).tolist() if sampling else []
        except BaseException:
            sched.fail(batch.batch_id)
            raise
        sched.complete(batch.batch_id, tokens)
        sched.step_log[-1]["seconds"] = time.perf_counter() - t0
        return True

    def _output(self, result) -> RequestOutput:
        text = self.tokenizer.decode(result.token_ids, skip_special_tokens=True) if self.tokenizer else ""
        return RequestOutput(result.prompt_ids, result.token_ids, text, result.finish_reason)
