"""The chat on a local engine.LLM (chapter 12): every turn is one request whose prompt is the whole
conversation; the prefix cache (chapter 15) still holds the previous turns' pages, so a turn computes
only its new tokens.
"""
from __future__ import annotations

import sys

from engine.chat.conversation import Conversation, ConversationFrontEnd, Prefilling, TurnCancelled, TurnStats

PAGE_SIZE = 16      # the engine's default KV page: the pool is a whole number of pages


def engine_context(max_context: int | None, max_position_embeddings: int) -> int | None:
    """The engine's max_context for a chat of `max_context` tokens: rounded up to whole KV pages, so
    that a pool sized for one context holds all of it (a pool of 100 tokens is 6 pages, 96 tokens).
    Raises ValueError naming --max-context when the value cannot work with this model."""
    if max_context is None:
        return None
    if isinstance(max_context, bool) or not isinstance(max_context, int) or \
            not 2 <= max_context <= max_position_embeddings:
        raise ValueError(f"--max-context must be a whole number of tokens from 2 to {max_position_embeddings} "
                         f"(this model's max_position_embeddings), got {max_context!r}")
    return min(-(-max_context // PAGE_SIZE) * PAGE_SIZE, max_position_embeddings)


class Chat(ConversationFrontEnd):
    """A conversation on a local engine.LLM: each turn is one request."""

    def __init__(self, model_dir, backend: str, params, system: str | None, max_context: int | None, llm=None,
                 speculative: dict | None = None, quantization: str | None = None):
        from engine.formats.config import load_config
        from engine.runtime.engine_config import default_max_context
        from engine.runtime.llm import LLM
        config = load_config(model_dir)          # first: its error says "not a model directory"
        if llm is None:    # one conversation: a pool of one context is enough
            llm = LLM(model_dir, backend, max_seqs=1, speculative=speculative, quantization=quantization,
                      max_context=engine_context(max_context, config.max_position_embeddings)
                      or default_max_context(config.max_position_embeddings))
        self.llm, self.tokenizer = llm, llm.tokenizer
        # the tokens a turn may use: what was asked for, within what the engine's pool holds
        capacity = getattr(getattr(llm, "cache", None), "capacity_tokens", llm.max_context)
        self.max_context = min(max_context or llm.max_context, llm.max_context, capacity)
        if self.tokenizer is None or not self.tokenizer.chat_template:
            raise ValueError(f"{model_dir} has no chat template (tokenizer_config.json): not a chat model")
        self.params = params
        self.conversation = Conversation(system)
        self.backend_name = llm.backend.describe()
        self.prefill_rate: float | None = None   # tokens/s of the last prefill, for the progress line

    def _encode(self, messages) -> list[int]:
        return self.tokenizer.encode(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True))

    def answer(self, text: str, out=None, notices=None) -> TurnStats:
        """Stream the reply to `out` (stdout); notices go to `notices` (stderr). Ctrl-C after the first
        token ends the answer early (the partial reply is kept); before it (tokenizing, prefilling) it
        cancels the turn: TurnCancelled, with the conversation as it was."""
        out, notices = out or sys.stdout, notices or sys.stderr
        max_context = self.max_context
        room = min(self.params.max_new_tokens, max(1, max_context // 4))   # kept free for the answer
        before = list(self.conversation.messages)
        handle = None
        pieces: list[str] = []
        progress = None
        try:
            convo, dropped = self.conversation.fit(text, lambda m: len(self._encode(m)), max_context - room)
            prompt_ids = self._encode(convo)
            handle = self.llm.submit(prompt_ids, self.params)
            if dropped:
                notices.write(f"(context full: dropped the {dropped} oldest turn{'s' * (dropped > 1)})\n")
                notices.flush()
            progress = Prefilling(notices, len(prompt_ids), self.prefill_rate)
            for event in handle.stream(heartbeat=0.5):
                if event is None:
                    progress.tick()
                    continue
                progress.clear()
                pieces.append(event.text)
                out.write(event.text)
                out.flush()
            result = handle.result()
        except KeyboardInterrupt:
            if progress is not None:
                progress.clear()
            if handle is not None:
                handle.cancel()
            if not pieces:                     # nothing answered yet: the turn never happened
                self.conversation.messages = before
                if handle is not None:
                    handle.result()            # the engine has let the request go
                raise TurnCancelled("cancelled: the message was not sent; the conversation is kept") from None
            assert handle is not None          # a piece came: the request was submitted
            out.write(" [stopped]")
            result = handle.result()
        out.write("\n")
        out.flush()
        self.conversation.add(text, "".join(pieces))
        stats = TurnStats(len(prompt_ids), handle.reused_tokens,
                          (handle.first_token_at or handle.finished_at) - handle.submitted_at,
                          max(0, len(result.token_ids) - 1),
                          handle.finished_at - (handle.first_token_at or handle.finished_at), result.finish_reason)
        computed = stats.prompt_tokens - stats.reused_tokens
        if stats.prefill_seconds > 0 and computed > 0:
            self.prefill_rate = computed / stats.prefill_seconds
        if result.finish_reason == "length" and len(prompt_ids) + len(result.token_ids) >= max_context:
            notices.write("(the answer reached the end of the context)\n")
        return stats
