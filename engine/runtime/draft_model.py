"""Draft-model proposals (chapter 16): a smaller model of the same tokenizer guesses the next k tokens.

The draft runs in the engine's process on the same backend, with a paged KV cache and page allocator of
its own: for each speculating request it keeps the K/V of the tokens it has seen. One proposal, for all
of a step's speculating requests together:

    catch up   feed the known tokens the draft has not seen, one row per request (after a verify step:
               the target's own token, and the last accepted guess, which the draft never fed); the
               argmax at each row's last position is guess 1
    guess      k - 1 more passes of one token per request, each feeding the previous guess

so k forward passes of the draft per verify step. Rows that short are decode-shaped (one-token rows
sharing a page table, as engine/runtime/model_runner.split_verify_rows does for the target) and replay
the draft's own decode graphs; the first catch-up of a request (its whole prompt) runs as a prefill.

The guesses are greedy (the draft's argmax): a deterministic proposal, so the acceptance rule's q is
one-hot, exactly as for n-gram lookup, and every output follows the target's distribution whatever its
sampling settings. (Sampling the guesses from the draft, with q its distribution, accepts more often
under a high temperature; the greedy draft is what greedy and low-temperature requests want.)

Rollback is a count: K/V the draft wrote for guesses the target rejected are overwritten by the next
catch-up. A request's pages are given back when it ends; when the draft's pool runs short, the requests
of the step take the pages of draft sequences that are not in it (they catch up later if they return),
and a request that still does not fit gets no guesses this step (it decodes plainly).
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from engine.checks import path_exists, read_regular_file
from engine.formats.config import HybridConfig, load_config
from engine.model.forward_pass import ForwardBatch, load_model
from engine.model.kv_cache import KVCache, kv_bytes_per_token
from engine.runtime.cuda_graphs import DecodeGraphs
from engine.runtime.kv_allocator import PageAllocator
from engine.runtime.scheduler import common_prefix
from engine.runtime.speculative import SpeculativeError

TOKENIZER_BYTES = 64 * 2**20       # the largest tokenizer.json compared (a 256k vocabulary is ~20 MB)
DRAFT_KV_FRACTION = 0.25           # of the GPU memory still free after the target's pool
CPU_DRAFT_KV_MIB = 256.0

Tokens = Callable[[int, int], list[int]]      # (start, end) -> the request's known tokens[start:end]


@dataclass
class DraftSequence:
    seen: int = 0                                   # known tokens whose K/V the draft holds
    guesses: list[int] = field(default_factory=list)   # the guesses it fed after them (positions seen...)


def same_vocabulary(draft_dir: Path, target_dir: Path | None, draft_config, target_config) -> None:
    """Refuse a draft whose token ids mean other tokens than the target's: the vocabularies of both
    tokenizer.json files must be equal (or, without tokenizers, the vocabulary sizes), and the draft's
    ids must all exist in the target."""
    if draft_config.vocab_size > target_config.vocab_size:
        raise SpeculativeError(f"the draft model's vocabulary ({draft_config.vocab_size} ids) is larger than the "
                               f"target's ({target_config.vocab_size}): they do not share a tokenizer")
    files = [None if d is None else Path(d) / "tokenizer.json" for d in (draft_dir, target_dir)]
    if all(f is not None and path_exists(f) for f in files):
        vocabs = [json.loads(read_regular_file(f, TOKENIZER_BYTES, SpeculativeError, "tokenizer.json"))
                  .get("model", {}).get("vocab") for f in files]
        if vocabs[0] != vocabs[1]:
            raise SpeculativeError(f"the draft model's tokenizer ({files[0]}) is not the target's ({files[1]})")
    elif draft_config.vocab_size != target_config.vocab_size:
        raise SpeculativeError(f"the draft model has {draft_config.vocab_size} token ids, the target "
                               f"{target_config.vocab_size}, and no tokenizer.json to show they agree")


def check_draft_model(draft_dir, target_config, target_dir, max_context: int):
    """The draft's config.json, if the draft can serve this target: the same tokenizer, and a context
    as long as the target's (checked before a weight is read)."""
    try:
        config = load_config(Path(draft_dir))
    except (OSError, ValueError) as exc:
        raise SpeculativeError(f"the draft model {draft_dir}: {exc}") from exc
    if isinstance(config, HybridConfig):
        raise SpeculativeError(f"the draft model {draft_dir} is a {config.model_type} model: it cannot run with a "
                               "cache yet (no per-request recurrent state for its Gated DeltaNet layers)")
    if config.max_position_embeddings < max_context:
        raise SpeculativeError(f"the draft model {draft_dir} reaches {config.max_position_embeddings} positions, "
                               f"the target's context is {max_context}: pass a shorter max_context")
    same_vocabulary(Path(draft_dir), None if target_dir is None else Path(target_dir), config, target_config)
    return config


class DraftModelProposer:
    """The scheduler's batched proposer: propose_batch() for a step's speculating requests, release()
    when a request ends (engine/runtime/scheduler.py)."""

    def __init__(self, draft_dir, backend, target_config, *, max_context: int, max_rows: int, max_seqs: int = 1,
                 page_size: int = 16, kv_cache_mib: float | None = None, cuda_graphs: bool | None = None,
                 target_dir=None):
        """max_rows: the most tokens of one pass that replay a decode graph; max_seqs: the sequences whose
        whole context the draft's pool holds by default (kv_cache_mib sets it)."""
        check_draft_model(draft_dir, target_config, target_dir, max_context)
        self.model = load_model(draft_dir, backend, max_context=max_context)
        self.backend, self.config = self.model.backend, self.model.config
        if kv_cache_mib is None:
            wanted = max_seqs * max_context * kv_bytes_per_token(self.config, self.backend) / 2**20
            free = self.backend.xp.cuda.runtime.memGetInfo()[0] if self.backend.is_gpu else None
            kv_cache_mib = min(wanted, CPU_DRAFT_KV_MIB if free is None else DRAFT_KV_FRACTION * free / 2**20)
        self.cache = KVCache.paged(self.config, kv_cache_mib, page_size, self.backend)
        self.allocator = PageAllocator(self.cache.num_pages, page_size)
        self.graphs = DecodeGraphs(self.model, self.cache, max_rows, enabled=cuda_graphs)
        self.max_rows = max_rows
        self._seqs: dict[int, DraftSequence] = {}
        self.passes = 0                               # draft forward passes run

    # ---- the scheduler's side ---------------------------------------------------------------------
    def propose_batch(self, items: list[tuple[int, int, Tokens, int]]) -> list[list[int]]:
        """items: (request_id, n known tokens, tokens(start, end), k) -> up to k guesses each."""
        rows = []                               # (item index, request id, tokens to feed, first position)
        keep = {item[0] for item in items}
        for i, (rid, n, tokens, k) in enumerate(items):
            seq = self._seqs.setdefault(rid, DraftSequence())
            if seq.guesses:                     # the guesses the verify step kept are K/V worth keeping
                seq.seen += common_prefix(tokens(seq.seen, min(n, seq.seen + len(seq.guesses))), seq.guesses)
                seq.guesses = []
            seq.seen = min(seq.seen, n - 1)     # the last known token is fed again: its logits give guess 1
            if self._make_room(rid, n + k - 1, keep):
                rows.append((i, rid, tokens(seq.seen, n), seq.seen))
        out: list[list[int]] = [[] for _ in items]
        for step in range(max((items[i][3] for i, *_ in rows), default=0)):
            if not rows:
                break
            best = self._argmax_at_last(rows)
            fed = []
            for (i, rid, _, _), token in zip(rows, best, strict=True):
                out[i].append(token)
                if step == 0:
                    self._seqs[rid].seen = items[i][1]
                if len(out[i]) < items[i][3]:   # more guesses wanted: feed this one
                    self._seqs[rid].guesses.append(token)
                    fed.append((i, rid, [token], items[i][1] + step))
            rows = fed
        return out

    def release(self, request_id: int) -> None:
        if self._seqs.pop(request_id, None) is not None and self.allocator.has_table(request_id):
            self.allocator.free(request_id)
            self.allocator.commit()

    def reset(self) -> None:
        """Forget every sequence (a new scheduler: request ids start over)."""
        for rid in list(self._seqs):
            self.release(rid)

    # ---- the draft's device side ------------------------------------------------------------------
    def _make_room(self, rid: int, length: int, keep: set[int]) -> bool:
        """Pages for positions < length of rid, taking those of draft sequences not in `keep` if needed."""
        while not self.allocator.can_reserve(rid, length):
            victim = next((other for other in self._seqs if other not in keep and self.allocator.has_table(other)), None)
            if victim is None:
                return False
            self.release(victim)
        self.allocator.reserve(rid, length)
        self.allocator.commit()
        return True

    def _argmax_at_last(self, rows) -> list[int]:
        """One forward pass of the draft over `rows`: the argmax at each row's last position."""
        ps = self.allocator.page_size
        lengths = np.array([len(feed) for _, _, feed, _ in rows])                              # [R]
        ids = np.fromiter((t for _, _, feed, _ in rows for t in feed), dtype=np.int32, count=int(lengths.sum()))
        pos = np.concatenate([np.arange(start, start + len(feed)) for _, _, feed, start in rows]).astype(np.int32)
        tables = [self.allocator.page_table(rid) for _, rid, _, _ in rows]
        width = max(len(t) for t in tables)
        table = np.array([t + [-1] * (width - len(t)) for t in tables], dtype=np.int32)        # [R, W]
        row_of = np.repeat(np.arange(len(rows)), lengths)                                     # [T]
        slots = (table[row_of, pos // ps] * ps + pos % ps).astype(np.int32)
        last = np.cumsum(lengths) - 1                                                         # [R]
        self.passes += 1
        if ids.size <= self.max_rows:
            # decode-shaped: each token its own one-token sequence over its row's pages, every logit read
            fb = ForwardBatch(ids, pos, np.arange(ids.size + 1, dtype=np.int32), table[row_of], slots)
            logits = self.graphs.forward(fb)
            if logits is None:
                logits = self.model.forward(fb, self.cache)
            logits = logits[last if self.backend.xp is np else self.backend.xp.asarray(last)]
        else:                                   # a prompt (or a long catch-up): a prefill over the pages
            cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
            logits = self.model.forward(ForwardBatch(ids, pos, cu, table, slots, logits_rows=last.astype(np.int32)),
                                        self.cache)
        best = self.backend.xp.argmax(logits, axis=1)
        return [int(t) for t in (best.get() if hasattr(best, "get") else best)]

