"""The chat on a local engine.LLM (chapter 12): every turn is one request whose prompt is the whole
conversation; the prefix cache (chapter 15) still holds the previous turns' pages, so a turn computes
only its new tokens.
"""
from __future__ import annotations

import sys

from engine.chat.conversation import Conversation, ConversationFrontEnd, Prefilling, TurnStats


class Chat(ConversationFrontEnd):
    """A conversation on a local engine.LLM: each turn is one request."""

    def __init__(self, model_dir, backend: str, params, system: str | None, max_context: int | None, llm=None):
        from engine.formats.config import load_config
        from engine.runtime.engine_config import default_max_context
        from engine.runtime.llm import LLM
        config = load_config(model_dir)          # first: its error says "not a model directory"
        if llm is None:    # one conversation: a pool of one context is enough
            llm = LLM(model_dir, backend, max_seqs=1,
                      max_context=max_context or default_max_context(config.max_position_embeddings))
        self.llm, self.tokenizer = llm, llm.tokenizer
        if self.tokenizer is None or not self.tokenizer.chat_template:
            raise ValueError(f"{model_dir} has no chat template (tokenizer_config.json): not a chat model")
        self.params = params
        self.conversation = Conversation(system)
        self.backend_name = llm.backend.describe()
        self.prefill_rate: float | None = None   # tokens/s of the last prefill, for the progress line

    def _encode(self, messages) -> list[int]:
        return self.tokenizer.encode(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True))

    def answer(self, text: str, out=None, notices=None) -> TurnStats:
        """Stream the reply to `out` (stdout); notices go to `notices` (stderr). Ctrl-C ends it early
        (the partial reply is kept)."""
        out, notices = out or sys.stdout, notices or sys.stderr
        max_context = self.llm.max_context
        room = min(self.params.max_new_tokens, max(1, max_context // 4))   # kept free for the answer
        convo, dropped = self.conversation.fit(text, lambda m: len(self._encode(m)), max_context - room)
        if dropped:
            notices.write(f"(context full: dropped the {dropped} oldest turn{'s' * (dropped > 1)})\n")
            notices.flush()
        prompt_ids = self._encode(convo)
        handle = self.llm.submit(prompt_ids, self.params)
        progress = Prefilling(notices, len(prompt_ids), self.prefill_rate)
        pieces = []
        try:
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
            handle.cancel()
            progress.clear()
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
