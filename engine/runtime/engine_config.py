"""The engine's settings (chapters 09-14), checked once, before a weight is read.

`EngineConfig.build(config, backend, ...)` takes what `engine.LLM(...)` was given, refuses what
cannot work with this model (a ValueError naming the setting), and fills in the defaults that depend
on the device. The model runner sizes the KV cache from it; the engine loop makes its schedulers
with `new_scheduler()`. Nothing else re-reads the arguments.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.backend import Backend
from engine.checks import env_switch
from engine.formats.config import HybridConfig, LlamaConfig, check_serving_args
from engine.runtime.kv_allocator import KVAllocator, PageAllocator, SlotAllocator
from engine.runtime.scheduler import ADMISSIONS, Scheduler
from engine.runtime.speculative import SpeculativeConfig

BATCHING = ("continuous", "static")
KV_CACHES = ("paged", "contiguous")
# The contiguous cache's default context: each slot reserves max_context positions up front, so the
# model's whole context (131,072 for Llama 3.2) would leave room for a handful of sequences at most.
DEFAULT_MAX_CONTEXT = 4096
ASYNC_SWITCH = "ENGINE_ASYNC_SCHEDULING"     # "0" turns async scheduling off


def check_hybrid_settings(config: LlamaConfig, prefix_caching, speculative) -> None:
    """ValueError naming the setting that a hybrid model (Qwen3.5) cannot run with."""
    if not isinstance(config, HybridConfig):
        return
    if prefix_caching:
        raise ValueError(f"prefix_caching=True cannot serve {config.model_type} models: a cached page restores the "
                         "K/V of its tokens, but not the recurrent state the Gated DeltaNet layers had reached there")
    if speculative is not None:
        raise ValueError(f"speculative decoding is not supported for {config.model_type} models: rejected tokens "
                         "would have to be taken back out of the recurrent state")


def default_async_scheduling(backend: Backend, scheduler_cls: type) -> bool:
    """On where there is something to overlap (a GPU) and the scheduler is the engine's own (a
    learner's class of chapters 10-11 keeps the one-batch-at-a-time contract), unless
    ENGINE_ASYNC_SCHEDULING=0."""
    return env_switch(ASYNC_SWITCH) and backend.is_gpu and scheduler_cls is Scheduler


def default_max_context(model_max: int, kv_cache: str = "contiguous") -> int:
    """The context a request may reach when none is given.

    paged: the model's whole context (max_position_embeddings). Pages are taken as tokens arrive, so
    a long context costs nothing until it is used; the pool decides how long a request can get, and
    one that could never fit in it is refused at submit.
    contiguous (and ChatSession): at most DEFAULT_MAX_CONTEXT, because every slot reserves its whole
    context whether it is used or not.
    """
    return model_max if kv_cache == "paged" else min(model_max, DEFAULT_MAX_CONTEXT)


@dataclass(frozen=True)
class EngineConfig:
    batching: str                     # "continuous" | "static"
    kv_cache: str                     # "paged" | "contiguous"
    admission: str                    # Scheduler's admission policy
    max_context: int                  # the longest a request may get (prompt + output)
    max_seqs: int                     # requests running at once (the contiguous cache may lower it)
    max_batch_tokens: int             # tokens one step may feed
    page_size: int
    chunked_prefill: bool
    cuda_graphs: bool | None          # None: the environment decides (ENGINE_CUDA_GRAPHS)
    async_scheduling: bool
    kv_cache_mib: float | None        # None: the runner's default pool size
    prefix_caching: bool = False      # share full KV pages between requests with the same prefix
    speculative: SpeculativeConfig | None = None   # verify rows of proposed tokens (chapter 16)
    scheduler_cls: type[Scheduler] = Scheduler
    allocator_cls: type[PageAllocator] = PageAllocator

    @classmethod
    def build(cls, config: LlamaConfig, backend: Backend, *, batching: str = "continuous",
              kv_cache: str = "paged", kv_cache_mib: float | None = None, max_context: int | None = None,
              max_seqs: int | None = None, max_batch_tokens: int | None = None,
              admission: str = "conservative", page_size: int = 16, chunked_prefill: bool = True,
              cuda_graphs: bool | None = None, async_scheduling: bool | None = None,
              prefix_caching: bool | None = None, scheduler_cls: type[Scheduler] = Scheduler,
              allocator_cls: type[PageAllocator] = PageAllocator, speculative=None) -> EngineConfig:
        for name, value, choices in (("batching", batching, BATCHING), ("kv_cache", kv_cache, KV_CACHES),
                                     ("admission", admission, ADMISSIONS)):
            if not isinstance(value, str) or value not in choices:
                raise ValueError(f"{name} must be one of {choices}, got {value!r}")
        for name, flag in (("cuda_graphs", cuda_graphs), ("async_scheduling", async_scheduling)):
            if flag is not None and not isinstance(flag, bool):
                raise ValueError(f"{name} must be True, False or None (the environment decides), got {flag!r}")
        if not isinstance(chunked_prefill, bool):
            raise ValueError(f"chunked_prefill must be True or False, got {chunked_prefill!r}")
        if prefix_caching is not None and not isinstance(prefix_caching, bool):
            raise ValueError(f"prefix_caching must be True, False or None (on with the paged cache), "
                             f"got {prefix_caching!r}")
        if prefix_caching and kv_cache != "paged":
            raise ValueError("prefix_caching=True needs kv_cache='paged': it shares pages between requests, "
                             "and a contiguous slot is one page as long as the whole context")
        check_serving_args(config, max_context=max_context, max_seqs=max_seqs, max_batch_tokens=max_batch_tokens,
                           page_size=page_size, kv_cache_mib=kv_cache_mib)
        check_hybrid_settings(config, prefix_caching, speculative)
        hybrid = isinstance(config, HybridConfig)
        spec = SpeculativeConfig.parse(speculative)
        if spec is not None and (batching != "continuous" or scheduler_cls is not Scheduler):
            raise ValueError("speculative decoding needs continuous batching and the engine's own Scheduler")
        seqs = int(max_seqs) if max_seqs is not None else (256 if backend.is_gpu else 16)
        budget = int(max_batch_tokens) if max_batch_tokens is not None else (8192 if backend.is_gpu else 2048)
        return cls(batching=batching, kv_cache=kv_cache, admission=admission,
                   max_context=int(max_context) if max_context is not None else
                   default_max_context(config.max_position_embeddings, kv_cache),
                   max_seqs=seqs, max_batch_tokens=max(budget, seqs), page_size=int(page_size),
                   chunked_prefill=chunked_prefill, cuda_graphs=cuda_graphs,
                   async_scheduling=(default_async_scheduling(backend, scheduler_cls) if async_scheduling is None
                                     else async_scheduling),
                   kv_cache_mib=None if kv_cache_mib is None else float(kv_cache_mib),
                   prefix_caching=(kv_cache == "paged" and scheduler_cls is Scheduler and not hybrid)
                   if prefix_caching is None else prefix_caching,
                   scheduler_cls=scheduler_cls, allocator_cls=allocator_cls, speculative=spec)

    def new_scheduler(self, num_pages: int, eos_token_ids: set[int], first_request_id: int = 0, *,
                      async_scheduling: bool = False, proposer=None) -> Scheduler:
        """A scheduler over a cache of num_pages pages (contiguous: slots). The finish rule lives in
        the scheduler alone: eos_token_ids are the config's and the tokenizer's (a chat model's end of
        turn)."""
        allocator: KVAllocator
        if self.kv_cache == "contiguous":
            allocator = SlotAllocator(num_pages, self.max_context)
        else:
            allocator = self.allocator_cls(num_pages, self.page_size)
        # only what is on: a learner's scheduler of chapters 10-11 need not know these two arguments
        extra: dict[str, Any] = {}
        if async_scheduling:
            extra["async_scheduling"] = True
        if self.prefix_caching:
            extra["prefix_caching"] = True
        if self.speculative is not None:
            extra["speculative"] = self.speculative
        if proposer is not None:         # a draft model (engine/runtime/draft_model.py)
            extra["proposer"] = proposer
        return self.scheduler_cls(allocator, self.max_seqs, self.max_batch_tokens, self.max_context,
                                  eos_token_ids, policy=self.batching, admission=self.admission,
                                  chunked_prefill=self.chunked_prefill, first_request_id=first_request_id,
                                  **extra)
