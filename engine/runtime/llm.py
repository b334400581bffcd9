"""`engine.LLM`: serve many prompts at once (chapters 09-12). A facade over the runtime:

    EngineConfig   the settings, checked once against config.json before a weight is read
    ModelRunner    the model, the KV cache memory and the decode CUDA graphs (launch, wait, complete)
    EngineLoop     the one thread that owns the runner and a long-lived scheduler

`submit()` hands the loop a request from any thread and returns a handle that streams tokens;
`generate()` is submit() for a list of prompts, then waiting. An LLM is therefore safe to share
between threads. `new_scheduler()` + `step(sched, seeds)` drive the same runner by hand (chapters
10-11), only while the engine loop serves nothing.

Batching is "continuous" (admit whenever capacity frees up) or "static" (one group at a time);
the cache is "paged" (a shared pool of 16-token pages) or "contiguous" (one max_context slot per
sequence). Every combination returns the same greedy tokens: the tests hold them to it.
"""
from __future__ import annotations

import numbers
from pathlib import Path

from engine.backend import resolve_backend
from engine.formats.config import load_config
from engine.model.forward_pass import Model, check_vocab_fits, load_model
from engine.runtime.draft_model import check_draft_model
from engine.runtime.engine_config import EngineConfig
from engine.runtime.engine_loop import EngineLoop
from engine.runtime.kv_allocator import PageAllocator
from engine.runtime.model_runner import ModelRunner
from engine.runtime.request import RequestHandle, RequestOutput, prepare_prompt, warn_sessions_gone
from engine.runtime.sampling_params import SamplingParams
from engine.runtime.scheduler import Scheduler, StepOutput
from engine.runtime.step_log import StepRecord
from engine.text.tokenizer import load_tokenizer


class LLM:
    def __init__(self, model_dir, backend="auto", batching: str = "continuous", kv_cache: str = "paged",
                 kv_cache_mib: float | None = None, *, max_context: int | None = None,
                 max_seqs: int | None = None, max_batch_tokens: int | None = None,
                 admission: str = "conservative", page_size: int = 16, chunked_prefill: bool = True,
                 cuda_graphs: bool | None = None, async_scheduling: bool | None = None,
                 prefix_caching: bool | None = None, speculative: dict | None = None,
                 quantization: str | None = None, group_size: int | None = None,
                 scheduler_cls: type[Scheduler] = Scheduler, allocator_cls: type[PageAllocator] = PageAllocator):
        """chunked_prefill: long prompts are prefilled in chunks of the step's token budget, mixed with
        the running requests' decodes (continuous batching; chapter 13). cuda_graphs: replay decode
        steps as CUDA graphs per batch size (default: on, unless ENGINE_CUDA_GRAPHS=0).
        async_scheduling: the engine loop schedules step N+1 while the GPU runs step N (default: on a
        GPU with the engine's own Scheduler, unless ENGINE_ASYNC_SCHEDULING=0; on the CPU there is
        nothing to overlap: NumPy computes a step before the host can move on).
        prefix_caching: requests share the KV pages of a common prefix (a system prompt, a chat's
        earlier turns), which are then not computed again (chapter 15; default: on with the paged
        cache and the engine's own Scheduler).
        speculative: {"method": "ngram", "num_tokens": 4} proposes up to num_tokens next tokens by
        looking up the request's own last tokens earlier in its prompt and output, and the model checks
        them in one pass (chapter 16; engine/runtime/speculative.py for the other settings);
        {"method": "draft", "model": DIR, "num_tokens": 4} has a smaller model of the same tokenizer
        guess them (engine/runtime/draft_model.py). Outputs follow exactly the model's distribution
        (greedy: exactly its tokens). Default: off.
        quantization: "int8" | "int4" quantizes every projection on load (weight-only, `group_size`
        inputs per scale and zero point, by default 128 or the largest group below it that the model's
        sizes take; chapter 18); an AWQ checkpoint runs its own 4-bit weights.
        scheduler_cls / allocator_cls: your own Scheduler or PageAllocator subclass (chapters 10-11's
        exercises) runs in place of the engine's, with the same constructor arguments."""
        model_dir = Path(model_dir)
        config = load_config(model_dir)
        b = resolve_backend(backend)
        # every setting is checked against config.json before a weight is read
        settings = EngineConfig.build(config, b, batching=batching, kv_cache=kv_cache, kv_cache_mib=kv_cache_mib,
                                      max_context=max_context, max_seqs=max_seqs, max_batch_tokens=max_batch_tokens,
                                      admission=admission, page_size=page_size, chunked_prefill=chunked_prefill,
                                      cuda_graphs=cuda_graphs, async_scheduling=async_scheduling,
                                      prefix_caching=prefix_caching, scheduler_cls=scheduler_cls, allocator_cls=allocator_cls,
                                      speculative=speculative)
        if settings.speculative is not None and settings.speculative.method == "draft":
            check_draft_model(settings.speculative.model, config, model_dir, settings.max_context)
        self.tokenizer = None
        if (model_dir / "tokenizer.json").is_file():
            self.tokenizer = load_tokenizer(model_dir)
            check_vocab_fits(self.tokenizer, config)
        self.config, self.backend = config, b
        self.model: Model = load_model(model_dir, b, settings.max_context, quantization, group_size)
        eos = set(config.eos_token_ids) | (self.tokenizer.eos_token_ids if self.tokenizer else set())
        self.runner = ModelRunner(self.model, settings, model_dir, self.tokenizer, eos)
        self.engine_config = self.runner.engine_config     # as the cache left it (contiguous: its slots)
        self.cache, self.decode_graphs = self.runner.cache, self.runner.decode_graphs
        self.last_step_log: list[StepRecord] = []
        # The finish rule lives in the scheduler alone; the tokenizer's eos (a chat model's end of turn)
        # stops a request as well as the config's (`eos` above).
        self._engine = EngineLoop(self.runner, self.engine_config, self.tokenizer, eos)

    # the settings, as plain attributes (chapters and tests read them)
    max_context = property(lambda self: self.engine_config.max_context)
    max_seqs = property(lambda self: self.engine_config.max_seqs)
    max_batch_tokens = property(lambda self: self.engine_config.max_batch_tokens)
    page_size = property(lambda self: self.engine_config.page_size)
    batching = property(lambda self: self.engine_config.batching)
    kv_cache_kind = property(lambda self: self.engine_config.kv_cache)
    admission = property(lambda self: self.engine_config.admission)
    chunked_prefill = property(lambda self: self.engine_config.chunked_prefill)
    async_scheduling = property(lambda self: self.engine_config.async_scheduling)
    prefix_caching = property(lambda self: self.engine_config.prefix_caching)
    speculative = property(lambda self: self.engine_config.speculative)

    @property
    def handle_hub(self):
        """What every request handle of this LLM waits on (the engine process's forwarder too)."""
        return self._engine.hub

    def new_scheduler(self, first_request_id: int = 0, *, async_scheduling: bool = False) -> Scheduler:
        """A scheduler over this LLM's KV pool, to drive by hand with step() (chapters 10-11)."""
        return self._engine.new_scheduler(first_request_id, async_scheduling=async_scheduling)

    # ---- serving -----------------------------------------------------------------------------
    def _prepare(self, prompt, params) -> tuple[list[int], SamplingParams]:
        return prepare_prompt(prompt, params, self.tokenizer, self.config.vocab_size)

    def submit(self, prompt, params: SamplingParams | None = None, *, session=None, client=None) -> RequestHandle:
        """Queue one prompt (text or token ids) from any thread; it joins the running batch at the next
        step. Returns a handle: .stream() / .astream() events, .result(), .cancel(), .request_id.

        Invalid prompts or params raise ValueError here, before anything runs. A chat's next turn
        needs nothing special: with prefix caching it finds the earlier turns' pages by their tokens
        (`session` is ignored, with a DeprecationWarning). `client` (any hashable: an API key, an
        address) names who sent it: when every seat is taken, seats are shared fairly among clients
        (engine/runtime/scheduler.py, "Fair seats").
        """
        if session is not None:
            warn_sessions_gone()
        prompt_ids, params = self._prepare(prompt, params)
        return self._engine.submit(prompt_ids, params, client)

    def reset_prefix_cache(self) -> None:
        """Forget every cached page (a benchmark's warm-up must not serve the timed run). Between
        requests only: RuntimeError while any runs."""
        self._engine.reset_prefix_cache()

    def drop_session(self, session) -> None:
        """Does nothing (DeprecationWarning): cached pages are evicted by the pool when it needs them."""
        warn_sessions_gone()

    def stats(self) -> dict:
        """A plain-dict snapshot of the engine: running/waiting counts, the page map (pages_total,
        pages_used, pages_cached, pages_shared, page_owners: request id per page, -1 free, -2 free but
        holding a cached prefix), prefix_cache (enabled, lookup_tokens, hit_tokens, hit_rate), per-request
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
        ids = [self._prepare(p, sp)[0] for p, sp in zip(prompts, plist, strict=True)]
        log = self._engine.collect_steps()
        handles = []
        try:
            handles = self._engine.submit_many(list(zip(ids, plist, strict=True)))
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

    def step(self, sched: Scheduler, seeds: dict[int, int]) -> StepOutput | None:
        """Drive a scheduler of new_scheduler() by hand: one forward pass of whatever it picks; a
        failure leaves its state unchanged and re-raises. Returns what the step did (its `finished`
        results among it), None when there was nothing to run.
        Refused while the engine loop serves requests (both would write the same cache)."""
        if sched.async_scheduling:
            raise ValueError("LLM.step drives a scheduler of new_scheduler(), one batch at a time "
                             "(not one with async scheduling, such as the engine loop's)")
        return self._engine.step_by_hand(self.runner, sched, seeds)
