"""Chapter 08: the decode loop of one conversation, with its own KV cache.

prefill: run the prompt once, write every token's K/V into the cache, sample from the last row;
decode:  feed the one new token at its absolute position, attend to everything cached, sample.

`ChatSession` keeps its cache between turns: the next prompt usually starts with the whole
conversation so far, so only the tokens after the common prefix are computed (the cached prefix is
reused, the way vLLM's prefix caching saves work). On the GPU its decode step is a CUDA graph.
`python -m engine.chat` does the same through the engine loop (engine.LLM.submit with a session),
which shares one KV pool between many conversations; this class is the one-sequence version.
"""
from __future__ import annotations

from collections.abc import Iterator

from engine.model.forward_pass import ForwardBatch, Model
from engine.model.kv_cache import KVCache
from engine.ops.sampling import sample
from engine.runtime.cuda_graphs import DecodeGraphs
from engine.runtime.sampling_params import SamplingParams, resolve_seed, step_uniform
from engine.runtime.scheduler import common_prefix


class ChatSession:
    """One sequence, one contiguous cache slot of max_context tokens."""

    def __init__(self, model: Model, eos_token_ids=None):
        self.model = model
        self.max_context = model.max_context
        self.eos = frozenset(model.config.eos_token_ids if eos_token_ids is None else eos_token_ids)
        self.cache = KVCache.contiguous(model.config, 1, self.max_context, model.backend)
        self.cached: list[int] = []          # tokens whose K/V are in the cache, in order
        self.finish_reason: str | None = None
        self.graphs = DecodeGraphs(model, self.cache, max_rows=1)   # GPU: decode steps as a CUDA graph

    def _decode_step(self, token: int, start: int):
        """One token at position `start`: a CUDA graph replay on the GPU (the one-row bucket of
        engine/runtime/cuda_graphs.py over this slot), a plain forward on the CPU or while a
        learner's stage is plugged in."""
        batch = ForwardBatch.single([token], start, page_table=[0], page_size=self.max_context)
        logits = self.graphs.forward(batch)
        if logits is None:
            return self._forward([token], start)
        self.cached = self.cached[:start] + [token]
        return logits

    def reset(self) -> None:
        self.cached = []

    def _forward(self, token_ids: list[int], start: int):
        batch = ForwardBatch.single(token_ids, start, page_table=[0], page_size=self.max_context,
                                    logits_rows=[len(token_ids) - 1])
        logits = self.model.forward(batch, self.cache)            # [1, V]
        self.cached = self.cached[:start] + list(token_ids)       # only after the pass succeeded
        return logits

    def stream(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[int]:
        """Yield generated token ids one by one; `finish_reason` is set when the loop ends."""
        prompt = [int(t) for t in self.model.validate_tokens(prompt_ids)]
        if len(prompt) >= self.max_context:
            raise ValueError(f"prompt of {len(prompt)} tokens does not fit the context of "
                             f"{self.max_context} with room for one new token")
        self.finish_reason = None
        seed = resolve_seed(params)
        # Reuse the cached prefix; at least the last prompt token is fed, its logits are needed.
        start = min(common_prefix(self.cached, prompt), len(prompt) - 1)
        logits = self._forward(prompt[start:], start)
        for step in range(params.max_new_tokens):
            token = int(sample(logits, [params], [step_uniform(seed, step)])[0])
            yield token
            if token in self.eos and not params.ignore_eos:
                self.finish_reason = "stop"
                return
            if len(self.cached) + 1 >= self.max_context or step + 1 == params.max_new_tokens:
                break
            logits = self._decode_step(token, len(self.cached))
        self.finish_reason = "length"
