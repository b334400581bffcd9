"""The scheduler: which requests run in the next forward pass, and where their KV cache lives.

Metadata only: it never touches device memory or the model. The engine loop (engine/runtime/engine_loop.py)
drives it with the model runner (engine/runtime/model_runner.py), one batch in flight at a time:

    sched = Scheduler(PageAllocator(num_pages=512), max_seqs=64, max_batch_tokens=4096,
                      max_context=2048, eos_token_ids={2}, chunked_prefill=True)
    rid = sched.submit(prompt_ids, params)          # params: .max_new_tokens, .ignore_eos
    results = sched.pop_finished()                  # max_new_tokens == 0: finished at submit
    while sched.has_unfinished():
        batch = sched.schedule()                    # "prefill", "decode" or "mixed"; None only when idle
        try:
            sampled = run_model(batch)              # one token per sampling row (batch.sampling_rows)
        except Exception:
            sched.fail(batch.batch_id)              # exact previous state, as if never scheduled
            raise
        out = sched.complete(batch.batch_id, sampled)   # a StepOutput: what the step did to each request
        results += out.finished

Rows. A row feeds the next tokens of one request at positions start_pos... and attends to everything
before them through its page_table (which covers positions < context_len = start_pos +
len(token_ids)). A request's tokens are prompt + generated; the first `num_computed` have their K/V in
the cache, and a row always continues from there:
- a prefill row feeds the prompt (or, for a request that was preempted, prompt + the tokens generated
  so far, recomputed from position 0), whole or, with chunked prefill, a chunk of it;
- a decode row feeds the one token sampled last step, at start_pos = current length - 1.
A row samples one token from its last position when it reaches the end of the request's tokens
(`row.samples`); a chunk that stops short of the prompt's end samples nothing, and complete() takes
one token per sampling row. Batch.logits_indices says which packed tokens need logits.

Policies (`policy=`):
- "continuous" (nano-vllm's, prefill first): if requests are waiting and the head of the FIFO queue
  can be admitted (a seat under max_seqs, memory for it, room in the max_batch_tokens budget), run a
  prefill batch of as many waiting requests as fit, in FIFO order, stopping at the first that does
  not fit (no overtaking); otherwise run one decode step of every running sequence. Without chunking
  a prompt longer than max_batch_tokens runs alone in its own batch.
- "continuous" with `chunked_prefill=True` (Sarathi-Serve's stall-free batching): every step carries
  every running decode (one token each), then the next chunks of requests part-way through their
  prompt (oldest first), then first chunks of newly admitted requests (FIFO), until the step holds
  max_batch_tokens tokens. A long prompt is prefilled over several steps while the running requests
  keep producing a token every step: a batch is "mixed" when it has both kinds of rows.
- "static": form a group of up to max_seqs requests (prefilled in one or more prefill batches, FIFO,
  under the token budget; with chunking, long prompts over several of them), then decode the group
  until EVERY member has finished, admitting nothing new; then form the next group. Members that
  finish early keep their seat until the group ends: the step log counts them as `idle_slots` (the
  rows a padded static batch would still compute). Their memory is released at once.

Fair seats (continuous policy). A request may name its `client` (submit(..., client=): the server
passes the API key, or the address without keys). Among waiting requests the next admitted is the
first of the client holding the fewest seats (running requests); one client alone, or requests that
name none, are plain FIFO. When every seat is taken and a waiting client holds at least two seats
fewer than the heaviest client, the heaviest client's newest running requests are preempted (as
on-demand admission does: pages freed, generated tokens kept, recomputed later, mostly from the
prefix cache) until the two are within one seat: a client flooding the server with a thousand
requests holds its share of the seats, never all of them, and a newcomer's first token waits for
one step, not for the flood to drain. A client is never preempted for its own requests.

Admission (`admission=`), i.e. how memory is promised:
- "conservative" (default): a request is admitted only if the pool can hold its worst case next to the
  worst cases of everyone running, where worst_pages = pages_needed(min(prompt + max_new_tokens,
  max_context) - 1) (the last sampled token is never written to the cache): the free pages after
  its first row must cover every running request's growth to its worst case, sum(worst_pages -
  pages held). Without shared pages that is sum(worst_pages) <= num_pages; a page several requests
  share is counted once. Pages are still taken lazily, step by step, but no step can ever run dry,
  so memory never forces a preemption (fair seats may still move one, see above).
- "on_demand": a request is admitted when its prompt fits now. When a step cannot get a page for
  a running sequence's row (decode or chunk), the NEWEST running request without a row in this step
  is preempted (its pages freed, its generated tokens kept, put back at the HEAD of the waiting
  queue to be re-prefilled with prompt + generated) until the row fits. No request is lost and, for
  a deterministic model, outputs are unchanged; the price is recomputation (`recomputed_tokens` in
  the step log).
With a SlotAllocator a request's worst case is one slot, so both admissions behave the same.

Finishing. A sampled token finishes its request with reason "stop" if it is an eos token (unless
params.ignore_eos); the eos token IS kept in the generated ids (as vLLM and HF do). Otherwise reason
"length" once max_new_tokens tokens were generated or prompt + generated reaches max_context.
Finished requests free their memory at once; complete() returns their results in its StepOutput.
A request with max_new_tokens == 0 is finished by submit() itself ("length", no tokens), never
scheduled, and waits in pop_finished().

Refusals (InvalidRequest, a ValueError, raised by submit before anything runs): empty prompt,
negative or non-integer token ids, a prompt of max_context tokens or more (one position must be
left for the answer), max_new_tokens < 0, or a worst case larger than the whole pool (with either
admission: on demand, such a request could not finish even alone).

Prefix caching (`prefix_caching=True`, chapter 15; what engine.LLM uses with the paged cache). As a
row is formed, every full page of known tokens it writes is *registered* under a key that names its
tokens and all the tokens before them (engine/runtime/prefix_cache.py); tokens that become known
later (async scheduling) are named when their step completes. A request being admitted (a newcomer,
or a preempted request coming back) looks its tokens up page by page: the longest chain of
registered pages from position 0 goes into its table as it is, shared with whoever else holds it
(reference counts, engine/runtime/kv_allocator.py), and counts as computed (num_computed), so its
first row, the rest of the prompt or a first chunk of it, starts after that prefix. A page named in
the step being formed can be shared in that same step: every layer writes the step's K/V into the
cache before it attends (engine/model/forward_pass.py), and a later step runs after it on the same
stream. So 30 requests with one system prompt arriving together compute it once. At least the last
token is always fed (its logits are sampled): when every page of a request is cached, its first row
starts at its last token, inside a shared page, and that page is copied first (copy-on-write: the
row's `copy` names the source and the private destination, and the runner copies the K/V before the
forward pass; a page this very step writes is computed again instead, as there is nothing to copy
yet). A registered page is never written after the step that named it.
A finished, cancelled or preempted request's pages stay registered when it lets go of them: free, at
the tail of the free queue, until a reservation reaches them at its head and evicts them (least
recently freed first). So cached pages are a cache, never a promise: admission counts them as free,
and they are evicted before anyone is preempted. A conversation needs nothing else: its next turn
starts with the same tokens, so it finds its pages by their contents.

Speculative decoding (`speculative=SpeculativeConfig(...)`, chapter 16; engine/runtime/speculative.py).
A decoding request whose tokens are all known gets a *verify row* instead of a decode row: its one
token, then up to k guesses from the proposer (row.draft), fed at the next positions through the
paged cache; the runner reads the logits of all 1 + k positions and applies the acceptance rule.
complete() takes that row's entry as the list of tokens it yields (the accepted guesses, then the
model's own token); the request's computed tokens end after the accepted ones (the K/V written for
rejected guesses sit past it and are overwritten later; no page holding them is ever named, as only
known tokens' pages are). Guesses are capped so that the request can never pass max_new_tokens, the
context or its worst case of pages, and dropped rather than preempting anyone. A step speculates only
while it holds at most `max_batch` decoding requests. With async scheduling a speculating request sits
out the lookahead: its guesses need its last token, and after a verify row, how many tokens it
yielded; it runs in the step scheduled once that is known (the rest of the batch still overlaps).
The proposer is a function (a request's last tokens, k) -> guesses, called per request (n-gram
lookup), or an object with propose_batch(items) and release(request_id) (a draft model: one call for
all of a step's speculating requests, told when a request ends).

cancel() and fail() work between steps only: cancel() raises SchedulerError while a batch is in
flight (apply it after complete()/fail()); fail() restores waiting queue, running order, group,
allocator (same free list order, so a retry takes the same pages), progress through the prompts,
counters and batch id exactly.

The step log (one StepRecord per completed step, engine/runtime/step_log.py) names the rows: request_ids
(all) and their start_positions, prefill_ids (prompt, chunk and recompute rows), chunks ([request id,
start_pos, tokens, samples] of every prefill row that holds only part of its sequence), sampled (how
many rows sampled), sampled_ids and sampled_tokens (which, and what: one entry per token, several for
a verify row), draft_tokens and accepted_tokens (speculative decoding), tokens and prefill_tokens,
admitted, preempted, recomputed_tokens, reused_tokens, and the memory and queue figures after the step.
submit() is allowed at any time; requests submitted while a batch is in flight survive fail().

Async scheduling (`async_scheduling=True`, what the engine loop uses on a GPU): the host forms batch
N+1 while the GPU still runs batch N, so the GPU never waits for Python between two steps. schedule()
may then be called with one batch in flight. The token each row of N samples is not known yet: a
request with such a *pending* token gets a decode row whose token id is PENDING (-1), and the runner
feeds it on the device from batch N's sampled ids. A request whose pending token finishes it by
length gets no row; one whose pending token turns out to be eos (or that is cancelled or stopped
meanwhile) already has a row in N+1: that row still runs, and complete() discards its token
(`discarded` in the step log). The rest of the contract changes in four places:
- progress (num_computed) and page reservations count from schedule(), and are committed there;
- a lookahead schedule() never preempts: when a row would need it, it changes nothing and returns
  None (the runner completes batch N first and schedules again, with nothing in flight);
- cancel() is allowed while batches are in flight (the pages of the request's rows still in flight are
  written by the GPU before any later batch can reuse them: one stream);
- a batch that fails is abort()ed: its requests end ("cancelled") and their pages are freed; the
  pages named for what it was to write lose their names, and requests that already share one (in
  the batch formed after it) end as well.
"""
from __future__ import annotations

import functools
import itertools
import operator
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from engine.checks import is_int
from engine.runtime.kv_allocator import KVAllocator, PageAllocator, SlotAllocator
from engine.runtime.prefix_cache import PageKey, PrefixLookup, cached_prefix, page_key, root_key
from engine.runtime.speculative import NGRAM_WINDOW, SpeculativeConfig, ngram_propose
from engine.runtime.step_log import StepRecord

Proposer = Callable[[list[int], int], list[int]]    # (a request's last tokens, k) -> up to k guesses


class BatchedProposer(Protocol):
    """A proposer for all of a step's speculating requests at once (engine/runtime/draft_model.py)."""

    def propose_batch(self, items: list[tuple[int, int, Callable[[int, int], list[int]], int]]) -> list[list[int]]:
        """items: (request_id, n known tokens, tokens(start, end), k) -> up to k guesses each."""

    def release(self, request_id: int) -> None:
        """The request ended: forget what was kept for it."""

__all__ = ["Scheduler", "Batch", "Row", "Result", "InvalidRequest", "SchedulerError", "PENDING",
           "KVAllocator", "PageAllocator", "SlotAllocator"]

POLICIES = ("static", "continuous")
PENDING = -1     # a row's token id that the runner takes from the previous batch's samples (async scheduling)
ADMISSIONS = ("conservative", "on_demand")


class InvalidRequest(ValueError):
    """A request that can never be served, or an unknown request id."""


class SchedulerError(RuntimeError):
    """The scheduler was driven against its lifecycle (e.g. two batches in flight)."""


@dataclass
class Row:
    """One sequence in a batch: feed `token_ids` at positions start_pos..., and sample one token
    from the last position if `samples` (every row but a chunk that stops short of the prompt's end)."""
    request_id: int
    token_ids: list[int]
    start_pos: int          # absolute position of token_ids[0]
    page_table: list[int]  # covers positions < context_len, after this step's reservation
    params: Any             # the request's SamplingParams (read by the runner's sampler, not here)
    num_generated: int      # tokens generated before this step (a seeded sampler can key on it)
    samples: bool = True    # False for a chunk that does not reach the end of the prompt
    kind: str = "prefill"   # "prefill" (a prompt, a chunk of one, or a recompute) | "decode"
    copy: tuple[int, int] | None = None   # copy-on-write: copy page src's K/V into dst before the pass
    # speculative decoding: the proposed tokens fed after the row's one known token (a verify row:
    # its logits are read at all 1 + len(draft) positions, and it yields 1 .. 1 + len(draft) tokens)
    draft: list[int] = field(default_factory=list)
    # (prompt ids, generated ids) when the request's logits depend on its tokens so far (penalties, a
    # structured output: params.needs_history); with async scheduling the row may hold one pending
    # token, which `generated` lacks: the runner adds it before the draw (ModelRunner.finish)
    history: tuple[list[int], list[int]] | None = None

    @property
    def context_len(self) -> int:
        """Tokens attended to after this step (cached ones + the new ones)."""
        return self.start_pos + len(self.token_ids)

    @property
    def num_logits(self) -> int:
        """Positions whose logits the runner reads: 1 for a sampling row, 1 + len(draft) for a verify row."""
        return (1 + len(self.draft)) if self.samples else 0


@dataclass
class Batch:
    """What the runner executes in one forward pass. Rows and arrays are copies: safe to keep.

    The arrays are built with NumPy from the rows' lengths, start positions and page tables (no
    per-token Python), once per batch: each property caches its array, read-only.
    """
    batch_id: int
    kind: str               # "prefill" | "decode" | "mixed" (chunked prefill: both kinds of rows)
    rows: list[Row]
    page_size: int

    @property
    def num_tokens(self) -> int:
        return int(self.cu_seqlens[-1])

    def _cached(self, name: str, build) -> np.ndarray:
        cache = self.__dict__.setdefault("_arrays", {})
        array = cache.get(name)
        if array is None:
            array = cache[name] = build()
            array.flags.writeable = False
        return array

    @property
    def token_ids(self) -> np.ndarray:
        """[T] int32, all rows' tokens packed one after another (no padding)."""
        return self._cached("token_ids", lambda: np.fromiter(
            itertools.chain.from_iterable(row.token_ids for row in self.rows), dtype=np.int32, count=self.num_tokens))

    @property
    def pending_indices(self) -> np.ndarray:
        """[K] int32, packed tokens that are PENDING (async scheduling: sampled by the batch in flight)."""
        return self._cached("pending_indices", lambda: np.flatnonzero(self.token_ids == PENDING).astype(np.int32))

    @property
    def lengths(self) -> np.ndarray:
        """[R] int32, tokens of each row in this batch."""
        return self._cached("lengths", lambda: np.fromiter((len(row.token_ids) for row in self.rows),
                                                           dtype=np.int32, count=len(self.rows)))

    @property
    def start_positions(self) -> np.ndarray:
        """[R] int32, absolute position of each row's first token."""
        return self._cached("start_positions", lambda: np.fromiter((row.start_pos for row in self.rows),
                                                                   dtype=np.int32, count=len(self.rows)))

    @property
    def positions(self) -> np.ndarray:
        """[T] int32, the absolute position of every token (what RoPE rotates by)."""
        def build():
            offset = np.repeat(self.start_positions - self.cu_seqlens[:-1], self.lengths)   # [T]
            return (offset + np.arange(self.num_tokens, dtype=np.int32)).astype(np.int32)
        return self._cached("positions", build)

    @property
    def cu_seqlens(self) -> np.ndarray:
        """[R+1] int32, row r's tokens are token_ids[cu_seqlens[r]:cu_seqlens[r+1]]."""
        return self._cached("cu_seqlens", lambda: np.concatenate([[0], np.cumsum(self.lengths)]).astype(np.int32))

    @property
    def last_token_indices(self) -> np.ndarray:
        """[R] int32, where each row's logits are sampled from."""
        return self._cached("last_token_indices", lambda: (self.cu_seqlens[1:] - 1).astype(np.int32))

    @property
    def page_copies(self) -> list[tuple[int, int]]:
        """(src, dst) pages whose K/V the runner copies before the forward pass (copy-on-write)."""
        return [row.copy for row in self.rows if row.copy is not None]

    @property
    def sampling_rows(self) -> list[int]:
        """Indices of the rows that sample a token (complete() takes one token for each, in order)."""
        return [r for r, row in enumerate(self.rows) if row.samples]

    @property
    def logits_indices(self) -> np.ndarray:
        """[S] int32, the token whose logits each sampling row samples from (ForwardBatch.logits_rows);
        a verify row contributes all its positions, in order (its last 1 + len(draft) tokens)."""
        last = self.last_token_indices[self.sampling_rows]
        drafts = [len(self.rows[r].draft) for r in self.sampling_rows]
        if not any(drafts):
            return last.astype(np.int32)
        return np.concatenate([np.arange(end - n, end + 1) for end, n in zip(last.tolist(), drafts, strict=True)]
                              ).astype(np.int32)

    @property
    def context_lens(self) -> np.ndarray:
        """[R] int32, tokens each row attends to after this step."""
        return self._cached("context_lens", lambda: (self.start_positions + self.lengths).astype(np.int32))

    @property
    def slot_mapping(self) -> np.ndarray:
        """[T] int32, where each new token's K/V goes: page * page_size + offset."""
        def build():
            pos = self.positions
            row = np.repeat(np.arange(len(self.rows)), self.lengths)                    # [T]
            pages = self.page_tables[row, pos // self.page_size]
            return (pages * self.page_size + pos % self.page_size).astype(np.int32)
        return self._cached("slot_mapping", build)

    @property
    def page_tables(self) -> np.ndarray:
        """[R, max table length] int32, padded with -1."""
        def build():
            sizes = np.fromiter((len(row.page_table) for row in self.rows), dtype=np.int64, count=len(self.rows))
            tables = np.full((len(self.rows), int(sizes.max())), -1, dtype=np.int32)
            filled = np.arange(tables.shape[1]) < sizes[:, None]                          # [R, W]
            tables[filled] = np.fromiter(itertools.chain.from_iterable(row.page_table for row in self.rows),
                                         dtype=np.int32, count=int(sizes.sum()))
            return tables
        return self._cached("page_tables", build)


@dataclass
class Result:
    request_id: int
    prompt_ids: list[int]
    token_ids: list[int]    # generated tokens (an eos that stopped the request included)
    finish_reason: str      # "stop" | "length" | "cancelled"


@dataclass(frozen=True)
class RowProgress:
    """Where one live request stands after a step in which it had a row."""
    request_id: int
    prefill: bool          # a prefill row (a prompt, a chunk of one, or a recompute), else decode
    start_pos: int         # position of the row's first token
    end_pos: int           # start_pos + tokens fed: with `samples` False, how far its prompt is computed
    samples: bool          # the row reached the end of its tokens and sampled one
    admitted: bool         # its first row since admission: positions before start_pos came from
                           # cached pages (prefix caching)


@dataclass
class StepOutput:
    """What one completed step did, for whoever hands results to callers (the engine loop).

    Rows and tokens of requests that ended while the batch was in flight (async scheduling) are left
    out: those requests have already been answered. `record` is the step's telemetry (the same
    object appended to step_log); nothing needs to read it to serve the requests."""
    batch_id: int
    kind: str                        # "prefill" | "decode" | "mixed"
    rows: list[RowProgress]          # one per live row, in row order
    sampled: list[tuple[int, int]]   # (request id, token) of each live row that sampled, in row order
    finished: list[Result]           # requests this step finished (eos or length), in row order
    preempted: list[int]             # live requests preempted while this batch was formed
    record: StepRecord
    # {request id: (logprob, alternatives)} of this step's tokens, for requests that ask (the runner's)
    logprobs: dict = field(default_factory=dict)


@dataclass
class _Request:
    request_id: int
    prompt_ids: list[int]
    params: object
    max_new_tokens: int
    ignore_eos: bool
    worst_pages: int       # pages it can ever need: what conservative admission promises it
    generated: list[int] = field(default_factory=list)
    status: str = "waiting"  # "waiting" | "running" (finished requests leave the scheduler)
    num_preemptions: int = 0
    num_computed: int = 0   # leading tokens whose K/V are in the cache (0 again after a preemption)
    num_lost: int = 0       # tokens it had computed when it was last preempted: computed again later
    num_reused: int = 0     # leading tokens found in the prefix cache at admission
    pending: int = 0        # async scheduling: tokens sampled by batches in flight, not known yet
    # prefix caching: the registration numbers of its first len(chain) full pages (the parents that
    # its next page's key names), and the root its chain started from at admission
    chain: list[int] = field(default_factory=list)
    root: Any = None
    client: Any = None      # who sent it (the server's API key or address): seats are shared fairly among clients
    verifying: bool = False  # async: a verify row of it is in flight (its length is not known until it completes)
    # its last lookup while it waits at the head of the queue: (root, known tokens, pages, their serials)
    lookup: tuple[Any, int, list[int], list[int]] | None = None

    @property
    def num_tokens(self) -> int:
        """Its tokens, counting the pending ones."""
        return len(self.prompt_ids) + len(self.generated) + self.pending

    @property
    def num_known(self) -> int:
        """Its tokens whose ids are known (prompt + generated)."""
        return len(self.prompt_ids) + len(self.generated)

    @property
    def num_sampled(self) -> int:
        """Tokens sampled so far, the pending ones included."""
        return len(self.generated) + self.pending

    @property
    def tokens(self) -> list[int]:
        """prompt + generated (the known tokens)."""
        return self.prompt_ids + self.generated

    @property
    def needs_history(self) -> bool:
        return bool(getattr(self.params, "needs_history", False))    # (a learner's params may lack it)

    @property
    def num_remaining(self) -> int:
        """Tokens still to feed before the next sample: 1 for a decode, more while prefilling."""
        return self.num_tokens - self.num_computed


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens a and b share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@dataclass
class _Saved:
    """Everything schedule() may change, captured so that fail() can put it back."""
    waiting: list[int]
    running: list[int]
    # status, preemptions, computed, lost, reused, chain, root (schedule() replaces a chain, never edits it)
    request_states: dict[int, tuple[str, int, int, int, int, list[int], Any]]
    group: list[int]
    group_decoding: bool
    next_batch_id: int
    next_request_id: int
    num_preemptions: int


@dataclass
class _InFlight:
    batch: Batch
    saved: _Saved
    log_entry: StepRecord
    arrived_before: int     # next request id when the batch was scheduled
    registered: list[tuple[int, int]]   # prefix caching: (page, serial) named as the batch formed (it writes them)
    unnamed: list[int] = field(default_factory=list)   # async: requests with a full page to name later


class _Declined(Exception):
    """A lookahead schedule() would have to preempt: it is undone and returns None."""


class Scheduler:
    """Static or continuous batching over a KVAllocator (SlotAllocator or PageAllocator).

    See the module docstring for the policies, admissions, finishing rules and refusals.
    `step_log` holds one StepRecord (engine/runtime/step_log.py) per completed step (failed ones leave no
    trace); the runner adds the step's wall time as step_log[-1]["seconds"] after complete().
    """

    def __init__(self, allocator: KVAllocator, max_seqs: int, max_batch_tokens: int,
                 max_context: int, eos_token_ids=(), policy: str = "continuous",
                 admission: str = "conservative", chunked_prefill: bool = False, first_request_id: int = 0,
                 async_scheduling: bool = False, prefix_caching: bool = False, page_key: PageKey = page_key,
                 prefix_lookup: PrefixLookup = cached_prefix, speculative: SpeculativeConfig | None = None,
                 proposer: Proposer | BatchedProposer | None = None):
        for name, value in (("max_seqs", max_seqs), ("max_batch_tokens", max_batch_tokens),
                            ("max_context", max_context)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if max_context < 2:
            raise ValueError("max_context must be at least 2 (one prompt token, one new token)")
        if max_batch_tokens < max_seqs:
            raise ValueError(f"max_batch_tokens ({max_batch_tokens}) must be >= max_seqs "
                             f"({max_seqs}): a decode step feeds one token per sequence")
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        if admission not in ADMISSIONS:
            raise ValueError(f"admission must be one of {ADMISSIONS}, got {admission!r}")
        if allocator.in_transaction:
            raise ValueError("the allocator has uncommitted changes")
        if not isinstance(prefix_caching, bool):
            raise ValueError(f"prefix_caching must be True or False, got {prefix_caching!r}")
        if not callable(page_key) or not callable(prefix_lookup):
            raise ValueError("page_key must be a function (parent, tokens) -> key and prefix_lookup one "
                             "(allocator, tokens, root, page_key) -> pages (engine/runtime/prefix_cache.py)")
        self.allocator = allocator
        self.max_seqs = max_seqs
        self.max_batch_tokens = max_batch_tokens
        self.max_context = max_context
        eos = [eos_token_ids] if isinstance(eos_token_ids, (int, np.integer)) else eos_token_ids
        self.eos_token_ids = frozenset(operator.index(t) for t in eos)
        self.policy = policy
        self.admission = admission
        self.chunked_prefill = bool(chunked_prefill)
        self.async_scheduling = bool(async_scheduling)
        self.prefix_caching = prefix_caching
        self.page_key, self.prefix_lookup = page_key, prefix_lookup   # chapter 15: yours may plug in here
        if speculative is not None and policy != "continuous":
            raise ValueError("speculative decoding needs the continuous policy (a static group decodes in lockstep)")
        if speculative is not None and speculative.method == "draft" and not hasattr(proposer, "propose_batch"):
            raise ValueError("speculative method 'draft' needs the draft model's proposer "
                             "(engine/runtime/draft_model.py; the model runner builds it)")
        self.speculative = speculative      # chapter 16: verify rows for decoding requests
        self.proposer: Proposer | BatchedProposer = proposer or (
            (lambda tokens, k: ngram_propose(tokens, k, speculative.ngram_max, speculative.ngram_min))
            if speculative is not None else (lambda tokens, k: []))
        self.draft_tokens = 0               # completed steps: tokens proposed, and of those accepted
        self.accepted_tokens = 0
        self.verify_rows = 0
        # (page, registration serial) named while forming the current batch: the pages it will write
        self._registered_now: list[tuple[int, int]] = []

        self._requests: dict[int, _Request] = {}   # live requests: waiting or running
        self._waiting: deque[int] = deque()        # FIFO; preempted requests go back to the head
        self._running: list[int] = []              # admission order: the last one is the newest
        self._finished: list[Result] = []
        self._group: list[int] = []                # static: members of the current group
        self._group_decoding = False               # static: the group is sealed once it decodes
        self._next_request_id = first_request_id   # a replacement scheduler continues the numbering
        self._next_batch_id = 0
        self._in_flight: dict[int, _InFlight] = {}   # batch id -> batch, oldest first (async: up to 2)
        self._logged_request_id = 0                # requests below this id arrived before a logged step
        self.num_preemptions = 0
        self.num_steps = 0                         # completed steps (step_log may be drained by a loop)
        self.lookup_tokens = 0                     # prefix caching, completed steps: tokens looked up at
        self.hit_tokens = 0                        # admission, and of those found in the cache
        self.step_log: list[StepRecord] = []

    # ---- requests in -------------------------------------------------------------------------
    def submit(self, prompt_ids, params, client=None) -> int:
        """Queue a request and return its id; InvalidRequest if it can never be served. `client` (any
        hashable: an API key, an address) names who sent it, for fair seats (see the module docstring)."""
        prompt, max_new, worst_pages = self.validate(prompt_ids, params)
        request_id = self._new_request_id()
        if max_new == 0:   # nothing to generate: finished at once, never scheduled
            self._finished.append(Result(request_id, prompt, [], "length"))
            return request_id
        self._requests[request_id] = _Request(request_id, prompt, params, max_new,
                                              bool(getattr(params, "ignore_eos", False)), worst_pages,
                                              client=client)
        self._waiting.append(request_id)
        return request_id

    def validate(self, prompt_ids, params) -> tuple[list[int], int, int]:
        """(prompt, max_new_tokens, worst-case pages) of a servable request, else InvalidRequest.

        Depends only on the sizes fixed at construction: safe to call from any thread.
        """
        try:
            prompt = [operator.index(t) for t in prompt_ids]
        except TypeError as e:
            raise InvalidRequest(f"prompt token ids must be integers ({e})") from None
        if not prompt:
            raise InvalidRequest("empty prompt: there is no position to sample the first token from")
        if min(prompt) < 0:
            raise InvalidRequest(f"negative token id {min(prompt)} in the prompt")
        if len(prompt) >= self.max_context:
            raise InvalidRequest(f"prompt of {len(prompt)} tokens does not fit the context of "
                                 f"{self.max_context} with room for one new token")
        wanted = getattr(params, "max_new_tokens", None)
        if not is_int(wanted) or wanted < 0:
            raise InvalidRequest(f"max_new_tokens must be an int >= 0, got {wanted!r}")
        max_new = int(wanted)
        if max_new == 0:
            return prompt, 0, 0
        # The last sampled token is never fed back, so the cache holds one token less than the end.
        cached_tokens = min(len(prompt) + max_new, self.max_context) - 1
        worst_pages = self.allocator.pages_needed(cached_tokens)
        if cached_tokens > self.allocator.max_seq_len or worst_pages > self.allocator.num_pages:
            raise InvalidRequest(
                f"request needs up to {cached_tokens} cached tokens ({worst_pages} pages of "
                f"{self.allocator.page_size}), larger than the whole KV pool "
                f"({self.allocator.num_pages} pages, at most {self.allocator.max_seq_len} "
                f"tokens per sequence)")
        return prompt, max_new, worst_pages

    # ---- one step ----------------------------------------------------------------------------
    def schedule(self) -> Batch | None:
        """The next batch to run; None exactly when no request is waiting or running.

        (With live requests there is always something to run: the oldest running request alone
        always fits, and a waiting head always fits an empty pool, or submit() refused it.)
        """
        if len(self._in_flight) >= (2 if self.async_scheduling else 1):
            raise SchedulerError(f"batch {next(iter(self._in_flight))} is still in flight: "
                                 f"complete() or fail() it first")
        if self.allocator.in_transaction:
            raise SchedulerError("the allocator has uncommitted changes made outside the scheduler")
        saved = self._save()
        self._registered_now = []                # (page, serial): this batch writes them, named as rows form
        try:
            rows, preempted = self._next_rows()
        except _Declined:                 # lookahead only: put everything back, run nothing yet
            self._restore(saved)
            return None
        if not rows:
            return None
        kinds = {row.kind for row in rows}
        kind = kinds.pop() if len(kinds) == 1 else "mixed"
        batch = Batch(self._next_batch_id, kind, rows, self.allocator.page_size)
        self._next_batch_id += 1
        self._in_flight[batch.batch_id] = _InFlight(batch, saved, self._log_entry(batch, preempted),
                                                    self._next_request_id, self._registered_now)
        if self.async_scheduling:         # progress counts from here: the next batch continues after it
            flight = self._in_flight[batch.batch_id]
            size = self.allocator.page_size
            for row in rows:
                request = self._requests[row.request_id]
                end = request.num_computed = row.context_len     # a verify row: corrected at complete()
                request.pending += row.samples
                request.verifying = bool(row.draft)
                if self.prefix_caching and end >= (len(request.chain) + 1) * size:
                    flight.unnamed.append(row.request_id)   # a full page with a PENDING token: name
            self.allocator.commit()                          # it when this batch completes
        return batch

    def _next_rows(self) -> tuple[list[Row], list[int]]:
        fair = self._share_seats() if self.policy == "continuous" else []
        if self.chunked_prefill and self.policy == "continuous":
            rows, preempted = self._mixed_rows()
            return rows, fair + preempted
        rows, preempted = self._prefill_rows()
        preempted = fair + preempted
        if not rows:
            rows, more = self._decode_rows()
            preempted += more
            if rows:        # (a lookahead may find no row: every member's pending token ends it)
                self._group_decoding = self.policy == "static"
        return rows, preempted

    def complete(self, batch_id: int, sampled_tokens) -> StepOutput:
        """Accept one sampled token per sampling row (batch.sampling_rows, in row order): commit the
        step, finish requests. A verify row's entry is the list of tokens it yields instead: its accepted
        guesses (a prefix of row.draft), then the model's token. Returns what the step did to each live
        request (its finished results come back here, not through pop_finished())."""
        flight = self._flight(batch_id, oldest=True)
        sampling = [row for row in flight.batch.rows if row.samples]
        if len(sampled_tokens) != len(sampling):
            raise ValueError(f"batch {batch_id} has {len(sampling)} sampling rows, "
                             f"got {len(sampled_tokens)} sampled tokens")
        emitted = [self._emitted(row, entry) for row, entry in zip(sampling, sampled_tokens, strict=True)]
        del self._in_flight[batch_id]
        entry = flight.log_entry
        # async: a request that ended while this batch was in flight has no use for its row's token
        discarded = {row.request_id for row in flight.batch.rows if row.request_id not in self._requests}
        if not self.async_scheduling:
            for row in flight.batch.rows:
                self._requests[row.request_id].num_computed = row.context_len
        if flight.unnamed:            # async: pages whose last token was PENDING when the batch formed
            ends = {row.request_id: row.context_len for row in flight.batch.rows}
            for request_id in flight.unnamed:
                request = self._requests.get(request_id)
                if request is not None:
                    self._register_pages(request, ends[request_id])
        finished: list[Result] = []
        sampled: list[tuple[int, int]] = []
        drafted = accepted = 0
        for row, tokens in zip(sampling, emitted, strict=True):
            request = self._requests.get(row.request_id)
            if request is None:
                continue
            if self.async_scheduling:
                request.pending -= 1
                request.verifying = False
            if row.draft:                 # the K/V of rejected guesses are garbage: computed ends before them
                request.num_computed = row.start_pos + len(tokens)
                drafted, accepted = drafted + len(row.draft), accepted + len(tokens) - 1
            for token in tokens:
                request.generated.append(token)
                sampled.append((row.request_id, token))
                reason = self._finish_reason(request, token)
                if reason is not None:    # (an eos among accepted guesses ends it there)
                    finished.append(self._retire(request, reason))
                    break
        self.allocator.commit()
        if discarded:
            self._drop_rows(entry, discarded)
        # async: a victim of this batch's preemptions may have been cancelled or aborted since
        entry["preempted"] = [rid for rid in entry["preempted"] if rid in self._requests]
        entry["step"] = self.num_steps             # its index in the log (an aborted batch leaves none)
        entry["finished"] = [result.request_id for result in finished]
        entry["sampled_tokens"] = [token for _, token in sampled]
        entry["sampled_ids"] = [rid for rid, _ in sampled]
        entry["draft_tokens"], entry["accepted_tokens"] = drafted, accepted
        self.draft_tokens += drafted
        self.accepted_tokens += accepted
        self.verify_rows += sum(1 for row in sampling if row.draft and row.request_id not in discarded)
        self.lookup_tokens += entry["lookup_tokens"]
        self.hit_tokens += entry["reused_tokens"]
        self.num_steps += 1
        self.step_log.append(entry)
        self._logged_request_id = max(self._logged_request_id, flight.arrived_before)
        admitted = set(entry["admitted"])
        rows = [RowProgress(row.request_id, row.kind == "prefill", row.start_pos, row.context_len, row.samples,
                            row.request_id in admitted)
                for row in flight.batch.rows if row.request_id not in discarded]
        return StepOutput(flight.batch.batch_id, flight.batch.kind, rows, sampled, finished,
                          list(entry["preempted"]), entry)

    @staticmethod
    def _emitted(row: Row, entry) -> list[int]:
        """The tokens one sampling row yields: [token], or a verify row's accepted guesses + one token."""
        if not row.draft:
            tokens = [operator.index(entry)]
        else:
            tokens = [operator.index(t) for t in entry]
            m = len(tokens) - 1
            if not 0 <= m <= len(row.draft) or tokens[:m] != row.draft[:m]:
                raise ValueError(f"a verify row of request {row.request_id} yields its accepted guesses (a "
                                 f"prefix of {row.draft}) and one token, got {tokens}")
        if min(tokens) < 0:
            raise ValueError(f"sampled token ids must be >= 0, got {min(tokens)}")
        return tokens

    @staticmethod
    def _drop_rows(entry: StepRecord, discarded: set[int]) -> None:
        """Take the rows of requests that ended while the batch was in flight out of its record's
        per-request lists; rows and tokens still count them (they ran)."""
        keep = [i for i, rid in enumerate(entry["request_ids"]) if rid not in discarded]
        entry["start_positions"] = [entry["start_positions"][i] for i in keep]
        entry["request_ids"] = [entry["request_ids"][i] for i in keep]
        for key in ("prefill_ids", "sampled_ids", "admitted"):
            entry[key] = [rid for rid in entry[key] if rid not in discarded]
        entry["chunks"] = [chunk for chunk in entry["chunks"] if chunk[0] not in discarded]
        entry["sampled"] = len(entry["sampled_ids"])
        entry["discarded"] = sorted(discarded)

    def fail(self, batch_id: int) -> None:
        """Forget the batch: every piece of state goes back to what it was before schedule().
        (Async scheduling commits at schedule(): there a failed batch is abort()ed instead.)"""
        if self.async_scheduling:
            raise SchedulerError("with async scheduling a failed batch is abort()ed, not failed")
        saved = self._flight(batch_id).saved
        del self._in_flight[batch_id]
        self._restore(saved)

    def abort(self, batch_id: int) -> list[Result]:
        """Async scheduling: a batch that failed (or whose samples cannot be trusted) ends every request
        that has a row in it, "cancelled", with its pages freed; the pages named for what it was to
        write lose their names, and any request sharing one ends too. Their rows in a later batch are
        discarded. Returns their results."""
        flight = self._flight(batch_id)
        del self._in_flight[batch_id]
        in_batch = dict.fromkeys(row.request_id for row in flight.batch.rows)
        # pages named for what this batch was to write hold garbage now: forget them (unless the page has
        # been taken and named again since, for someone else), and end whoever shares one
        garbage = self._still_named(flight.registered)
        if garbage:
            for page in garbage:
                self.allocator.unregister(page)
            for request_id in list(self._running):
                if request_id not in in_batch and garbage & set(self.allocator.page_table(request_id)):
                    in_batch[request_id] = None
        results = []
        for request_id in in_batch:
            request = self._requests.get(request_id)
            if request is not None:
                if request.status == "waiting":
                    self._waiting.remove(request_id)
                results.append(self._retire(request, "cancelled"))
        self.allocator.commit()
        later = next(iter(self._in_flight.values()), None)
        if later is not None and later.batch.batch_id > batch_id:   # its arrivals go with the next record
            later.log_entry["arrived"] = flight.log_entry["arrived"] + later.log_entry["arrived"]
        return results

    def is_live(self, request_id: int) -> bool:
        """Waiting or running (async: a row of a batch in flight may belong to a request that ended)."""
        return request_id in self._requests

    def is_running(self, request_id: int) -> bool:
        """Admitted and not preempted: its next row continues what it has computed."""
        request = self._requests.get(request_id)
        return request is not None and request.status == "running"

    def _restore(self, saved: _Saved) -> None:
        self.allocator.rollback()
        arrived_since = [rid for rid in self._waiting if rid >= saved.next_request_id]
        self._waiting = deque(saved.waiting + arrived_since)
        self._running = saved.running
        for request_id, state in saved.request_states.items():
            request = self._requests[request_id]
            (request.status, request.num_preemptions, request.num_computed, request.num_lost,
             request.num_reused, request.chain, request.root) = state
        self._group, self._group_decoding = saved.group, saved.group_decoding
        self._next_batch_id = saved.next_batch_id
        self.num_preemptions = saved.num_preemptions

    # ---- requests out ------------------------------------------------------------------------
    def cancel(self, request_id: int) -> Result:
        """Drop a waiting or running request; return what it generated so far ("cancelled").

        The result is returned here, not through pop_finished(). Between steps only.
        """
        if self._in_flight and not self.async_scheduling:
            raise SchedulerError("cancel() between steps only: a batch is in flight")
        request = self._requests.get(request_id)
        if request is None:
            raise InvalidRequest(f"no waiting or running request {request_id}")
        if request.status == "waiting":
            self._waiting.remove(request_id)
        result = self._retire(request, "cancelled")
        self.allocator.commit()
        return result

    def clear_prefix_cache(self) -> None:
        """Forget every cached page (another scheduler is about to write this pool). Between steps only."""
        if self._in_flight:
            raise SchedulerError("clear_prefix_cache() between steps only: a batch is in flight")
        self.allocator.clear_cache()
        self.allocator.commit()
        for request in self._requests.values():   # running requests keep their pages, unnamed
            request.chain = []

    def pop_finished(self) -> list[Result]:
        """Results of the requests finished at submit (max_new_tokens == 0: nothing to generate) since
        the last call. Requests finished by a step come back in that step's StepOutput."""
        finished, self._finished = self._finished, []
        return finished

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def snapshot(self) -> dict:
        """Plain-data picture of the state, for inspection, plots and exact comparisons."""
        return {
            "policy": self.policy,
            "admission": self.admission,
            "in_flight": next(iter(self._in_flight), None),     # the oldest batch in flight
            "step": self.num_steps,
            "waiting": list(self._waiting),
            "running": list(self._running),
            "num_tokens": {rid: r.num_tokens for rid, r in self._requests.items()},
            "num_computed": {rid: r.num_computed for rid, r in self._requests.items()},
            "preemptions": {rid: r.num_preemptions for rid, r in self._requests.items()},
            "status": {rid: r.status for rid, r in self._requests.items()},
            "page_tables": {rid: self.allocator.page_table(rid) for rid in self._running},
            "free_pages": self.allocator.num_free,
            "used_pages": self.allocator.num_used,
            "num_pages": self.allocator.num_pages,
            "page_size": self.allocator.page_size,
            "group": list(self._group),
            "group_decoding": self._group_decoding,
            "idle_slots": self._idle_slots(),
            "total_preemptions": self.num_preemptions,
            "next_batch_id": self._next_batch_id,
            "finished": [result.request_id for result in self._finished],
            "prefix_caching": self.prefix_caching,
            "cached_pages": self.allocator.cached_free_pages(),
            "shared_pages": self.allocator.num_shared,
            "lookup_tokens": self.lookup_tokens,
            "hit_tokens": self.hit_tokens,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "verify_rows": self.verify_rows,
        }

    # ---- internals ---------------------------------------------------------------------------
    def _new_request_id(self) -> int:
        self._next_request_id += 1
        return self._next_request_id - 1

    def _prefill_rows(self) -> tuple[list[Row], list[int]]:
        """A prefill batch: the chunks of requests part-way through their prompt (chunked prefill
        only), then newly admitted requests from the head of the queue."""
        prefilling = [rid for rid in self._running if self._requests[rid].num_remaining > 1
                      or not self._requests[rid].num_sampled]
        rows, preempted = self._advance(prefilling, self.max_batch_tokens, in_step=set())
        used = sum(len(row.token_ids) for row in rows)
        return rows + self._admit(self.max_batch_tokens - used, alone_if_long=not rows), preempted

    def _mixed_rows(self) -> tuple[list[Row], list[int]]:
        """Chunked prefill (Sarathi-Serve): every running decode, then the chunks of requests still
        prefilling, then newcomers' first chunks, until the step's token budget is spent."""
        decoding = [rid for rid in self._running if self._requests[rid].num_remaining == 1]
        in_step: set[int] = set()
        rows, preempted = self._advance(decoding, self.max_batch_tokens, in_step, self._speculating(decoding))
        used = sum(len(row.token_ids) for row in rows)       # one each, more for verify rows
        waiting_decodes = set(decoding) - in_step       # (no row: out of budget, or sitting out a lookahead)
        prefilling = [rid for rid in self._running if rid not in in_step and rid not in waiting_decodes]
        chunks, more = self._advance(prefilling, self.max_batch_tokens - used, in_step)
        used += sum(len(row.token_ids) for row in chunks)
        return rows + chunks + self._admit(self.max_batch_tokens - used, alone_if_long=False), preempted + more

    def _admit(self, budget: int, alone_if_long: bool) -> list[Row]:
        """Admit waiting requests while they fit, in queue order (FIFO, no overtaking); with several
        clients, the next is the first waiting request of the client holding the fewest seats.

        A request's tokens to compute are those after the prefix found in the prefix cache. Without
        chunking they must all fit the budget (a longer request runs alone when `alone_if_long`); with
        chunking it is admitted with a first chunk of what is left of them.
        """
        rows: list[Row] = []
        if not self._waiting:
            return rows
        size_of = self.allocator.table_size
        # conservative: the pages the running requests may still take, each up to its worst case
        growth = sum(self._requests[rid].worst_pages - size_of(rid) for rid in self._running) \
            if self.admission == "conservative" else None
        root = root_key() if self.prefix_caching else None
        seats = self._seats()
        while self._waiting and budget > 0:
            request = self._requests[self._next_waiting(seats)]
            if not self._has_seat(request):
                break
            plan = self._plan(request, self._cache_hits(request, root), budget, growth)
            if plan is None:        # its pages do not fit now
                break
            hits, chunk = plan
            if not self.chunked_prefill and chunk > budget and not (alone_if_long and not rows):
                break
            rows.append(self._start(request, hits, root, chunk))
            seats[request.client] = seats.get(request.client, 0) + 1
            if growth is not None:
                growth += request.worst_pages - size_of(request.request_id)
            budget -= chunk
        return rows

    def _cache_hits(self, request: _Request, root) -> list[int]:
        """Prefix caching: the registered pages that hold the request's longest cached prefix of full
        pages (of its known tokens: a preempted request's generated ones count too)."""
        if not self.prefix_caching:
            return []
        tokens = request.prompt_ids if not request.generated else request.tokens    # no copy of a prompt
        if self.prefix_lookup is cached_prefix:
            # a head that waits is looked up again every step: go on from its last walk, if every page
            # of it still carries the same registration (an int compare each, no tuple built)
            known = None
            if request.lookup is not None and request.lookup[:2] == (root, request.num_known):
                known = request.lookup[2:]
            pages = cached_prefix(self.allocator, tokens, root, self.page_key, known)
            request.lookup = (root, request.num_known, pages, [self.allocator.serial(p) for p in pages])
            return pages
        pages = self.prefix_lookup(self.allocator, tokens, root, self.page_key)
        if len(pages) * self.allocator.page_size > request.num_known or len(set(pages)) != len(pages) or \
                any(self.allocator.lookup_page(page) is None for page in pages):
            raise SchedulerError(f"prefix_lookup returned {pages!r}: not registered pages of full pages of "
                                 f"the request's {request.num_known} tokens")
        return pages

    def _reused(self, request: _Request, hits: list[int]) -> int:
        """Tokens the hits hold, short of the last one (it must be fed: its logits are sampled)."""
        return min(len(hits) * self.allocator.page_size, request.num_tokens - 1)

    def _plan(self, request: _Request, hits: list[int], budget: int,
              growth: int | None) -> tuple[list[int], int] | None:
        """(the hits to share, the first row's tokens) if what must fit now does, else None. What must
        fit: on demand, the whole sequence; conservative, the first row, with the free pages left
        after it covering `growth` (the running requests' way to their worst cases) and this
        request's own. A hit page that is free leaves the free queue when shared. A first row that
        starts inside the last hit page (every page of the request cached) needs one page more, for
        the copy; short of it, that page is computed again instead."""
        size = self.allocator.page_size
        while True:
            reused = self._reused(request, hits)
            todo = request.num_tokens - reused
            chunk = min(todo, budget) if self.chunked_prefill else todo
            end = request.num_tokens if self.admission == "on_demand" else reused + chunk
            copy = reused < len(hits) * size
            if copy and hits[-1] in self._unwritten():   # a batch not yet completed writes it: copied now
                hits = hits[:-1]                         # it could hold garbage (or, for this very batch,
                continue                                 # nothing yet), so compute that page instead
            new = self.allocator.pages_needed(end) - len(hits) + copy
            taken = sum(self.allocator.is_cached_free(page) for page in hits)
            left = self.allocator.num_free - new - taken      # free pages after its first row
            promised = 0 if growth is None else \
                growth + request.worst_pages - self.allocator.pages_needed(reused + chunk)
            if end <= self.allocator.max_seq_len and left >= promised:
                return hits, chunk
            if not copy:
                return None
            hits = hits[:-1]

    def _start(self, request: _Request, hits: list[int], root, chunk: int) -> Row:
        """Move the head of the queue to the running requests: share the cached pages of its prefix
        (not computed again); the row of the first `chunk` tokens after it."""
        if self._waiting[0] == request.request_id:
            self._waiting.popleft()
        else:                                  # a lighter client's request, chosen by _next_waiting
            self._waiting.remove(request.request_id)
        if hits:
            self.allocator.share(request.request_id, hits)
        request.chain = [self.allocator.serial(page) for page in hits]
        request.root = root
        request.status = "running"
        request.num_computed = request.num_reused = self._reused(request, hits)
        self._running.append(request.request_id)
        if self.policy == "static" and request.request_id not in self._group:
            self._group.append(request.request_id)
        # the first row starts inside the last shared page (every page cached): it writes into a copy
        # (only a first row can: every later row starts where this request's own pages are)
        copy = None
        index = request.num_computed // self.allocator.page_size
        if hits and self.allocator.must_copy(request.request_id, index):
            copy = self.allocator.copy_on_write(request.request_id, index)
        return self._reserve_row(request, chunk, copy)

    def _seats(self) -> dict:
        """client -> running requests it holds."""
        seats: dict = {}
        for rid in self._running:
            client = self._requests[rid].client
            seats[client] = seats.get(client, 0) + 1
        return seats

    def _next_waiting(self, seats: dict) -> int:
        """The waiting request to admit next: the first in the queue of the client holding the fewest
        seats (ties: the one queued first). One client alone (or none named) is plain FIFO."""
        head = self._waiting[0]
        if self.policy != "continuous":
            return head
        best, fewest, seen = head, seats.get(self._requests[head].client, 0), set()
        for rid in self._waiting:
            if fewest == 0:
                break
            client = self._requests[rid].client
            if client in seen:
                continue
            seen.add(client)
            held = seats.get(client, 0)
            if held < fewest:
                best, fewest = rid, held
        return best

    def _share_seats(self) -> list[int]:
        """Fair seats: when every seat is taken and a waiting client holds at least two seats fewer
        than the client holding the most, seats move from the heaviest client to the lightest waiting
        one until they are within one seat of each other: the heaviest client's newest running request
        is preempted (its K/V computed again later, from the prefix cache where its pages still are)
        and _admit() gives the freed seat to the lightest client. A client alone is never preempted for
        its own requests. A lookahead (a batch in flight) never preempts: it declines, and the next
        schedule() does it."""
        if not self._waiting or len(self._running) < self.max_seqs:
            return []
        seats = self._seats()
        queued: dict = {}
        for rid in self._waiting:
            client = self._requests[rid].client
            queued[client] = queued.get(client, 0) + 1
        moves = []
        while True:
            lightest = min(queued, key=lambda c: seats.get(c, 0)) if queued else None
            heaviest = max(seats, key=lambda c: seats[c])
            if lightest is None or seats[heaviest] <= seats.get(lightest, 0) + 1:
                break
            moves.append(heaviest)
            seats[heaviest] -= 1
            seats[lightest] = seats.get(lightest, 0) + 1
            queued[lightest] -= 1
            if not queued[lightest]:
                del queued[lightest]
        if moves and self._in_flight:
            raise _Declined
        preempted = []
        for client in moves:
            victim = next(rid for rid in reversed(self._running) if self._requests[rid].client == client)
            self._preempt(victim)
            preempted.append(victim)
        return preempted

    def _has_seat(self, request: _Request) -> bool:
        if self.policy == "continuous":
            return len(self._running) < self.max_seqs
        if request.request_id in self._group:   # a preempted member comes back to its own seat
            return True
        return not self._group_decoding and len(self._group) < self.max_seqs

    def _decode_rows(self) -> tuple[list[Row], list[int]]:
        """Without chunking, when no prefill can run: one new position for every running sequence."""
        return self._advance(list(self._running), budget=None, in_step=set(),
                             speculate=self._speculating(self._running))

    def _speculating(self, decoding: list[int]) -> bool:
        """Speculation steps aside when the step holds more than max_batch decoding requests: the step
        is no longer bound by reading the weights, and k extra positions per row would cost time."""
        return self.speculative is not None and len(decoding) <= self.speculative.max_batch

    def _draft_limit(self, request: _Request) -> int:
        """Guesses that may still become tokens: max_new_tokens and the context bound them. A request
        whose logits depend on its tokens so far gets none (each guess's logits would need its own
        processing), nor one that asks for log-probabilities (one per step, from its decode row)."""
        if request.needs_history or getattr(request.params, "logprobs", None) is not None:
            return 0
        return min(self.speculative.num_tokens if self.speculative else 0,
                   request.max_new_tokens - request.num_sampled - 1, self.max_context - request.num_tokens - 1)

    def _propose_all(self, request_ids: list[int]) -> dict[int, list[int]]:
        """A batched proposer's guesses for each request of the step that may get a verify row."""
        propose_batch = getattr(self.proposer, "propose_batch", None)
        if propose_batch is None:
            return {}
        items = []
        for rid in request_ids:
            request = self._requests[rid]
            if request.status == "running" and request.num_remaining == 1 and request.num_sampled \
                    and not request.pending and not request.verifying and self._draft_limit(request) >= 1:
                items.append((rid, request.num_known, functools.partial(self._known_tokens, request),
                              self._draft_limit(request)))
        return {item[0]: guesses for item, guesses in zip(items, propose_batch(items), strict=True)} if items else {}

    def _draft(self, request: _Request, budget: int | None, proposed: dict[int, list[int]]) -> list[int]:
        """The proposer's guesses for a decoding request's verify row, as many as may still become
        tokens (max_new_tokens, the context) and as fit the step's budget and the pool (speculation never
        preempts anyone)."""
        k = self._draft_limit(request)
        if budget is not None:
            k = min(k, budget - 1)
        if k < 1:
            return []
        if hasattr(self.proposer, "propose_batch"):
            guesses = proposed.get(request.request_id, [])[:k]
        else:
            n = request.num_known
            guesses = self.proposer(self._known_tokens(request, max(0, n - NGRAM_WINDOW), n), k)
        draft = [operator.index(t) for t in guesses]
        if len(draft) > k or (draft and min(draft) < 0):
            raise SchedulerError(f"the proposer returned {draft!r}: at most {k} token ids")
        while draft and not self.allocator.can_reserve(request.request_id, request.num_computed + 1 + len(draft)):
            draft.pop()
        return draft

    def _advance(self, request_ids: list[int], budget: int | None,
                 in_step: set[int], speculate: bool = False) -> tuple[list[Row], list[int]]:
        """The next tokens of running requests, oldest first, at most `budget` tokens in all (None:
        no limit); `in_step` (updated) holds the requests already given a row in this step. The free
        queue's cached pages are evicted first (reserve() takes them as free pages); when the pool
        still lacks pages, the newest running request without a row is preempted (on-demand
        admission only ever gets there) until the row fits, or the request itself when it is that
        newest. With `speculate`, a decoding request whose tokens are all known gets a verify row (its
        token, then the proposer's guesses)."""
        rows, preempted = [], []
        proposed = self._propose_all(request_ids) if speculate else {}
        sat_out = 0
        for rid in request_ids:
            request = self._requests[rid]
            if request.pending and speculate and request.status == "running":
                sat_out += 1
            if request.status != "running" or self._finishes_pending(request) or request.verifying \
                    or (request.pending and speculate):
                continue      # preempted for an older request of this step; ends with its pending token;
                              # its verify row is in flight (how many tokens it yields is not known yet);
                              # or it speculates: it sits out the lookahead until its token is known
            chunk = request.num_remaining if budget is None else min(request.num_remaining, budget)
            if chunk < 1:
                break
            while not self.allocator.can_reserve(rid, request.num_computed + chunk):
                if self._in_flight:               # a lookahead never preempts (see the module docstring)
                    raise _Declined
                victim = next(v for v in reversed(self._running) if v not in in_step)
                self._preempt(victim)
                preempted.append(victim)
                if victim == rid:
                    break
            else:
                in_step.add(rid)
                decoding = chunk == 1 and request.num_remaining == 1 and request.num_sampled and not request.pending
                draft = self._draft(request, budget, proposed) if speculate and decoding else []
                rows.append(self._reserve_row(request, chunk, draft=draft))
                if budget is not None:
                    budget -= chunk + len(draft)
        if self._in_flight and sat_out and sat_out >= len(rows):
            # A lookahead without most of the batch would split the decoding requests into two halves
            # that take turns, each every other step; waiting for the batch in flight keeps them in one.
            raise _Declined
        return rows, preempted

    def _finishes_pending(self, request: _Request) -> bool:
        """Async: the request's pending token will end it by length (it needs no further row)."""
        return bool(request.pending) and (request.num_sampled >= request.max_new_tokens
                                          or request.num_tokens >= self.max_context)

    def _preempt(self, request_id: int) -> None:
        request = self._requests[request_id]
        self.allocator.free(request_id)
        self._running.remove(request_id)
        request.status = "waiting"
        request.num_lost, request.num_computed, request.num_reused = request.num_computed, 0, 0
        request.chain = []      # its registered pages stay cached: coming back, it may find them
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._waiting.appendleft(request_id)   # several in one step: the oldest ends up first

    def _reserve_row(self, request: _Request, chunk: int, copy: tuple[int, int] | None = None,
                     draft: list[int] | None = None) -> Row:
        """Reserve memory for the next `chunk` tokens of a request and describe them as a row (`copy`:
        the copy-on-write its first row after admission needs; `draft`: a verify row's guesses, fed
        after its one token)."""
        start, end = request.num_computed, request.num_computed + chunk
        self.allocator.reserve(request.request_id, end + len(draft or ()))
        decode = chunk == 1 and request.num_sampled and end == request.num_tokens
        prompt_len = len(request.prompt_ids)     # slice without building prompt + generated (O(context))
        tokens = request.generated[start - prompt_len:end - prompt_len] if start >= prompt_len \
            else self._known_tokens(request, start, end)
        tokens += [PENDING] * (chunk - len(tokens))    # async: sampled by the batch in flight
        # a request admitted later in this step may share the pages this row fills already (the check
        # inline: it runs for every row of every step, and a page fills once in page_size decodes)
        if self.prefix_caching and end >= (len(request.chain) + 1) * self.allocator.page_size:
            self._register_pages(request, end, self._registered_now)
        return Row(request.request_id, tokens + (draft or []), start,
                   self.allocator.page_table(request.request_id), request.params,
                   request.num_sampled, samples=end == request.num_tokens,
                   kind="decode" if decode else "prefill", copy=copy, draft=list(draft or ()),
                   history=(request.prompt_ids, list(request.generated)) if request.needs_history else None)

    @staticmethod
    def _known_tokens(request: _Request, start: int, end: int) -> list[int]:
        """request.tokens[start:end] without building prompt + generated (O(context) per row)."""
        prompt_len = len(request.prompt_ids)
        if start >= prompt_len:
            return request.generated[start - prompt_len:end - prompt_len]
        return request.prompt_ids[start:end] + request.generated[:max(0, end - prompt_len)]

    def _still_named(self, named: list[tuple[int, int]]) -> set[int]:
        """The pages of `named` (page, serial) that still carry that very registration."""
        return {page for page, serial in named
                if self.allocator.lookup_page(page) is not None and self.allocator.serial(page) == serial}

    def _unwritten(self) -> set[int]:
        """Pages named for batches not completed yet (the one being formed, those in flight)."""
        named = list(self._registered_now)
        for flight in self._in_flight.values():
            named += flight.registered
        return self._still_named(named)

    def _register_pages(self, request: _Request, upto: int,
                        written_by: list[tuple[int, int]] | None = None) -> None:
        """Prefix caching: name the full pages of known tokens among the request's first `upto`
        positions that have no name yet; `written_by` collects those the batch being formed writes.
        A page whose key another page holds already (a prefix computed twice: a lookahead batch
        formed before its twin was named) stays private; its successors are named after the page
        that holds the key."""
        size = self.allocator.page_size
        full = min(upto, request.num_known) // size
        if full <= len(request.chain):
            return
        chain = list(request.chain)
        parent = chain[-1] if chain else request.root
        for i in range(len(chain), full):
            tokens = tuple(self._known_tokens(request, i * size, (i + 1) * size))
            page = self.allocator.page_at(request.request_id, i)
            holder = self.allocator.register(page, self.page_key(parent, tokens))
            if holder == page and written_by is not None:
                written_by.append((page, self.allocator.serial(page)))
            parent = self.allocator.serial(holder)
            chain.append(parent)
        request.chain = chain

    def _finish_reason(self, request: _Request, token: int) -> str | None:
        if token in self.eos_token_ids and not request.ignore_eos:
            return "stop"
        if len(request.generated) >= request.max_new_tokens or request.num_known >= self.max_context:
            return "length"
        return None

    def _retire(self, request: _Request, reason: str) -> Result:
        """Remove a request for good, free its memory, end a static group it was the last of."""
        if request.status == "running":     # its registered pages stay cached for whoever comes next
            self._running.remove(request.request_id)
            self.allocator.free(request.request_id)
        del self._requests[request.request_id]
        release = getattr(self.proposer, "release", None)
        if release is not None:
            release(request.request_id)
        if self._group and not any(member in self._requests for member in self._group):
            self._group, self._group_decoding = [], False
        return Result(request.request_id, list(request.prompt_ids), list(request.generated), reason)

    def _idle_slots(self) -> int:
        """Static: members already finished but still holding their seat in the group."""
        return sum(member not in self._requests for member in self._group)

    def _flight(self, batch_id: int, oldest: bool = False) -> _InFlight:
        """The in-flight batch batch_id (with `oldest`: it must be the oldest, batches complete in order)."""
        ids = list(self._in_flight)
        if batch_id not in self._in_flight or (oldest and batch_id != ids[0]):
            raise SchedulerError(f"batch {batch_id} is not {'the oldest batch ' if oldest else ''}in flight "
                                 f"(in flight: {ids or None})")
        return self._in_flight[batch_id]

    def _save(self) -> _Saved:
        return _Saved(list(self._waiting), list(self._running),
                      {rid: (r.status, r.num_preemptions, r.num_computed, r.num_lost, r.num_reused, r.chain, r.root)
                       for rid, r in self._requests.items()},
                      list(self._group), self._group_decoding, self._next_batch_id,
                      self._next_request_id, self.num_preemptions)

    def _log_entry(self, batch: Batch, preempted: list[int]) -> StepRecord:
        prefill_rows = [row for row in batch.rows if row.kind == "prefill"]
        # A request's first row after its admission starts where its reused prefix ends (0 without
        # one); num_computed is not advanced before complete(), so that row starts at num_computed
        # == num_reused, and any later chunk of it starts further on.
        first_rows = [row for row in prefill_rows if row.start_pos == self._requests[row.request_id].num_reused]
        # Tokens whose K/V sit in the cache after this step: the rows' context, plus the running
        # requests outside the batch with what they had computed.
        in_batch = {row.request_id for row in batch.rows}
        cached = sum(row.context_len for row in batch.rows) + sum(
            self._requests[rid].num_computed for rid in self._running if rid not in in_batch)
        arrived_from = max([self._logged_request_id] + [f.arrived_before for f in self._in_flight.values()])
        return {
            "step": -1,            # filled in by complete(): its index in the log
            "batch_id": batch.batch_id,
            "kind": batch.kind,
            "request_ids": [row.request_id for row in batch.rows],
            "start_positions": batch.start_positions.tolist(),      # the runner's arrays, built once
            "prefill_ids": [row.request_id for row in prefill_rows],
            # prefill rows holding part of a sequence: [request id, start position, tokens, samples]
            "chunks": [[row.request_id, row.start_pos, len(row.token_ids), row.samples]
                       for row in prefill_rows if row.start_pos > 0 or not row.samples],
            "rows": len(batch.rows),
            "sampled": len(batch.sampling_rows),
            "sampled_ids": [row.request_id for row in batch.rows if row.samples],
            "tokens": batch.num_tokens,
            "prefill_tokens": sum(len(row.token_ids) for row in prefill_rows),
            "context_tokens": int(batch.context_lens.sum()),
            "arrived": list(range(arrived_from, self._next_request_id)),
            "admitted": [row.request_id for row in first_rows if not self._requests[row.request_id].num_preemptions],
            # tokens computed a second time because a preemption threw their K/V away
            "recomputed_tokens": sum(max(0, min(row.context_len, self._requests[row.request_id].num_lost)
                                         - row.start_pos) for row in prefill_rows),
            # tokens admitted requests looked up in the prefix cache, and of those found there (not fed)
            "lookup_tokens": sum(self._requests[row.request_id].num_tokens for row in first_rows)
            if self.prefix_caching else 0,
            "reused_tokens": sum(row.start_pos for row in first_rows),
            "preempted": list(preempted),
            "running": len(self._running),
            "waiting": len(self._waiting),
            "idle_slots": self._idle_slots(),
            "used_pages": self.allocator.num_used,
            "free_pages": self.allocator.num_free,
            "cached_pages": self.allocator.num_cached,
            "shared_pages": self.allocator.num_shared,
            "cached_tokens": cached,
            "finished": [],        # filled in by complete()
            "sampled_tokens": [],  # filled in by complete(): one per sampling row
        }
