"""The scheduler: which requests run in the next forward pass, and where their KV cache lives.

Metadata only: it never touches device memory or the model. The model runner (engine/llm.py) drives
it in a loop, one batch in flight at a time:

    sched = Scheduler(PageAllocator(num_pages=512), max_seqs=64, max_batch_tokens=4096,
                      max_context=2048, eos_token_ids={2})
    rid = sched.submit(prompt_ids, params)          # params: .max_new_tokens, .ignore_eos
    while sched.has_unfinished():
        batch = sched.schedule()                    # "prefill" or "decode"; None only when idle
        try:
            sampled = run_model(batch)              # one new token per row, from its last position
        except Exception:
            sched.fail(batch.batch_id)              # exact previous state, as if never scheduled
            raise
        sched.complete(batch.batch_id, sampled)
        results += sched.pop_finished()

Rows. Every row samples exactly one token from its last position. A prefill row holds the whole
prompt (no chunking: a prompt longer than max_batch_tokens runs alone in its own batch), or, for a
request that was preempted, prompt + the tokens generated so far, recomputed from position 0. A decode
row holds the one token sampled last step at position start_pos = current length - 1. A row's
block_table covers every position it attends to: positions < context_len = start_pos + len(token_ids).

Policies (`policy=`):
- "continuous" (nano-vllm's, prefill first): if requests are waiting and the head of the FIFO queue
  can be admitted (a seat under max_seqs, memory for it, room in the max_batch_tokens budget), run a
  prefill batch of as many waiting requests as fit, in FIFO order, stopping at the first that does
  not fit (no overtaking); otherwise run one decode step of every running sequence.
- "static": form a group of up to max_seqs requests (prefilled in one or more prefill batches, FIFO,
  under the token budget), then decode the group until EVERY member has finished, admitting nothing
  new; then form the next group. Members that finish early keep their seat until the group ends: the
  step log counts them as `idle_slots` (the rows a padded static batch would still compute). Their
  memory is released at once.

Admission (`admission=`), i.e. how memory is promised:
- "conservative" (default): a request is admitted only if the pool can hold its worst case next to the
  worst cases of everyone running: sum(worst_blocks) <= num_blocks, where worst_blocks =
  blocks_needed(min(prompt + max_new_tokens, max_context) - 1) (the last sampled token is never
  written to the cache). Blocks are still taken lazily, step by step, but no step can ever run dry,
  so there is never a preemption.
- "on_demand": a request is admitted when its prompt fits now. When a decode step cannot get a block
  for every running sequence, the NEWEST running request is preempted (its blocks freed, its
  generated tokens kept, put back at the HEAD of the waiting queue to be re-prefilled with
  prompt + generated) until the step fits. No request is lost and, for a deterministic model, outputs
  are unchanged; the price is recomputation (`recomputed_tokens` in the step log).
With a SlotAllocator a request's worst case is one slot, so both admissions behave the same.

Finishing. A sampled token finishes its request with reason "stop" if it is an eos token (unless
params.ignore_eos); the eos token IS kept in the generated ids (as vLLM and HF do). Otherwise reason
"length" once max_new_tokens tokens were generated or prompt + generated reaches max_context.
Finished requests free their memory at once and wait in pop_finished(). A request with
max_new_tokens == 0 is finished by submit() itself ("length", no tokens) and never scheduled.

Refusals (InvalidRequest, a ValueError, raised by submit before anything runs): empty prompt,
negative or non-integer token ids, a prompt of max_context tokens or more (one position must be
left for the answer), max_new_tokens < 0, or a worst case larger than the whole pool (with either
admission: on demand, such a request could not finish even alone).

Sessions (prefix reuse between the turns of a conversation): submit(..., session=key). When a request
of a session finishes (or is cancelled) while running, its pages are not freed but *parked* under the
key with the tokens whose K/V they hold. The next request of that session that is admitted adopts
them: the common prefix of the parked tokens and its own (at most all but its last token) is not
computed again, the pages past it are freed. Parked pages are a cache, never a promise: admission
counts them as free, and any reservation that finds the free list short evicts parked tables first
(least recently parked first), before it preempts anyone. drop_session(key) frees one at once.

cancel() and fail() work between steps only: cancel() raises SchedulerError while a batch is in
flight (apply it after complete()/fail()); fail() restores waiting queue, running order, group,
allocator (same free list order, so a retry takes the same blocks), counters and batch id exactly.
submit() is allowed at any time; requests submitted while a batch is in flight survive fail().
"""
from __future__ import annotations

import itertools
import numbers
import operator
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import numpy as np

from engine.paged_kv import BlockAllocator, PageAllocator, SlotAllocator
from engine.step_log import StepRecord

__all__ = ["Scheduler", "Batch", "Row", "Result", "InvalidRequest", "SchedulerError",
           "BlockAllocator", "PageAllocator", "SlotAllocator"]

POLICIES = ("static", "continuous")
ADMISSIONS = ("conservative", "on_demand")


class InvalidRequest(ValueError):
    """A request that can never be served, or an unknown request id."""


class SchedulerError(RuntimeError):
    """The scheduler was driven against its lifecycle (e.g. two batches in flight)."""


@dataclass
class Row:
    """One sequence in a batch: feed `token_ids` at positions start_pos..., sample one token."""
    request_id: int
    token_ids: list[int]
    start_pos: int          # absolute position of token_ids[0]
    block_table: list[int]  # covers positions < context_len, after this step's reservation
    params: object          # the request's sampling params, for the runner's sampler
    num_generated: int      # tokens generated before this step (a seeded sampler can key on it)

    @property
    def context_len(self) -> int:
        """Tokens attended to after this step (cached ones + the new ones)."""
        return self.start_pos + len(self.token_ids)


@dataclass
class Batch:
    """What the runner executes in one forward pass. Rows and arrays are copies: safe to keep.

    The arrays are built with NumPy from the rows' lengths, start positions and page tables (no
    per-token Python), once per batch: each property caches its array, read-only.
    """
    batch_id: int
    kind: str               # "prefill" | "decode"
    rows: list[Row]
    block_size: int

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
    def context_lens(self) -> np.ndarray:
        """[R] int32, tokens each row attends to after this step."""
        return self._cached("context_lens", lambda: (self.start_positions + self.lengths).astype(np.int32))

    @property
    def slot_mapping(self) -> np.ndarray:
        """[T] int32, where each new token's K/V goes: block * block_size + offset."""
        def build():
            pos = self.positions
            row = np.repeat(np.arange(len(self.rows)), self.lengths)                    # [T]
            pages = self.block_tables[row, pos // self.block_size]
            return (pages * self.block_size + pos % self.block_size).astype(np.int32)
        return self._cached("slot_mapping", build)

    @property
    def block_tables(self) -> np.ndarray:
        """[R, max table length] int32, padded with -1."""
        def build():
            sizes = np.fromiter((len(row.block_table) for row in self.rows), dtype=np.int64, count=len(self.rows))
            tables = np.full((len(self.rows), int(sizes.max())), -1, dtype=np.int32)
            filled = np.arange(tables.shape[1]) < sizes[:, None]                          # [R, W]
            tables[filled] = np.fromiter(itertools.chain.from_iterable(row.block_table for row in self.rows),
                                         dtype=np.int32, count=int(sizes.sum()))
            return tables
        return self._cached("block_tables", build)


@dataclass
class Result:
    request_id: int
    prompt_ids: list[int]
    token_ids: list[int]    # generated tokens (an eos that stopped the request included)
    finish_reason: str      # "stop" | "length" | "cancelled"


@dataclass
class _Request:
    request_id: int
    prompt_ids: list[int]
    params: object
    max_new_tokens: int
    ignore_eos: bool
    worst_blocks: int       # blocks it can ever need: what conservative admission promises it
    generated: list[int] = field(default_factory=list)
    status: str = "waiting"  # "waiting" | "running" (finished requests leave the scheduler)
    num_preemptions: int = 0
    session: object = None   # hashable key: its pages are parked for the session's next request

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.generated)


@dataclass
class _Parked:
    """The pages a finished request of a session left behind: K/V of `tokens`, in table `seq_id`."""
    seq_id: int
    tokens: list[int]


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
    request_states: dict[int, tuple[str, int]]
    group: list[int]
    group_decoding: bool
    next_batch_id: int
    next_request_id: int
    num_preemptions: int
    parked: list[tuple[object, _Parked]]


@dataclass
class _InFlight:
    batch: Batch
    saved: _Saved
    log_entry: StepRecord
    arrived_before: int     # next request id when the batch was scheduled


class Scheduler:
    """Static or continuous batching over a BlockAllocator (SlotAllocator or PageAllocator).

    See the module docstring for the policies, admissions, finishing rules and refusals.
    `step_log` holds one StepRecord (engine/step_log.py) per completed step (failed ones leave no
    trace); the runner adds the step's wall time as step_log[-1]["seconds"] after complete().
    """

    def __init__(self, allocator: BlockAllocator, max_seqs: int, max_batch_tokens: int,
                 max_context: int, eos_token_ids=(), policy: str = "continuous",
                 admission: str = "conservative", first_request_id: int = 0):
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
        self.allocator = allocator
        self.max_seqs = max_seqs
        self.max_batch_tokens = max_batch_tokens
        self.max_context = max_context
        eos = [eos_token_ids] if isinstance(eos_token_ids, (int, np.integer)) else eos_token_ids
        self.eos_token_ids = frozenset(operator.index(t) for t in eos)
        self.policy = policy
        self.admission = admission

        self._requests: dict[int, _Request] = {}   # live requests: waiting or running
        self._waiting: deque[int] = deque()        # FIFO; preempted requests go back to the head
        self._running: list[int] = []              # admission order: the last one is the newest
        self._finished: list[Result] = []
        self._group: list[int] = []                # static: members of the current group
        self._group_decoding = False               # static: the group is sealed once it decodes
        self._next_request_id = first_request_id   # a replacement scheduler continues the numbering
        self._next_batch_id = 0
        self._in_flight: _InFlight | None = None
        self._logged_request_id = 0                # requests below this id arrived before a logged step
        self.num_preemptions = 0
        self.num_steps = 0                         # completed steps (step_log may be drained by a loop)
        self._parked: OrderedDict[object, _Parked] = OrderedDict()   # session -> parked pages, LRU first
        self.step_log: list[StepRecord] = []

    # ---- requests in -------------------------------------------------------------------------
    def submit(self, prompt_ids, params, session=None) -> int:
        """Queue a request and return its id; InvalidRequest if it can never be served.

        `session`: a hashable key; the request reuses (and leaves behind) the session's cached pages.
        """
        prompt, max_new, worst_blocks = self.validate(prompt_ids, params)
        request_id = self._new_request_id()
        if max_new == 0:   # nothing to generate: finished at once, never scheduled
            self._finished.append(Result(request_id, prompt, [], "length"))
            return request_id
        self._requests[request_id] = _Request(request_id, prompt, params, max_new,
                                              bool(getattr(params, "ignore_eos", False)),
                                              worst_blocks, session=session)
        self._waiting.append(request_id)
        return request_id

    def validate(self, prompt_ids, params) -> tuple[list[int], int, int]:
        """(prompt, max_new_tokens, worst-case blocks) of a servable request, else InvalidRequest.

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
        max_new = getattr(params, "max_new_tokens", None)
        if isinstance(max_new, bool) or not isinstance(max_new, numbers.Integral) or max_new < 0:
            raise InvalidRequest(f"max_new_tokens must be an int >= 0, got {max_new!r}")
        max_new = int(max_new)
        if max_new == 0:
            return prompt, 0, 0
        # The last sampled token is never fed back, so the cache holds one token less than the end.
        cached_tokens = min(len(prompt) + max_new, self.max_context) - 1
        worst_blocks = self.allocator.blocks_needed(cached_tokens)
        if cached_tokens > self.allocator.max_seq_len or worst_blocks > self.allocator.num_blocks:
            raise InvalidRequest(
                f"request needs up to {cached_tokens} cached tokens ({worst_blocks} blocks of "
                f"{self.allocator.block_size}), larger than the whole KV pool "
                f"({self.allocator.num_blocks} blocks, at most {self.allocator.max_seq_len} "
                f"tokens per sequence)")
        return prompt, max_new, worst_blocks

    # ---- one step ----------------------------------------------------------------------------
    def schedule(self) -> Batch | None:
        """The next batch to run; None exactly when no request is waiting or running.

        (With live requests there is always something to run: the oldest running request alone
        always fits, and a waiting head always fits an empty pool, or submit() refused it.)
        """
        if self._in_flight is not None:
            raise SchedulerError(f"batch {self._in_flight.batch.batch_id} is still in flight: "
                                 f"complete() or fail() it first")
        if self.allocator.in_transaction:
            raise SchedulerError("the allocator has uncommitted changes made outside the scheduler")
        saved = self._save()
        rows, preempted = self._prefill_rows(), []
        kind = "prefill"
        if not rows:
            kind = "decode"
            rows, preempted = self._decode_rows()
            if not rows:
                return None
            self._group_decoding = self.policy == "static"
        batch = Batch(self._next_batch_id, kind, rows, self.allocator.block_size)
        self._next_batch_id += 1
        self._in_flight = _InFlight(batch, saved, self._log_entry(batch, preempted),
                                    self._next_request_id)
        return batch

    def complete(self, batch_id: int, sampled_tokens) -> None:
        """Accept one sampled token per row (row order): commit the step, finish requests."""
        flight = self._flight(batch_id)
        tokens = [operator.index(t) for t in sampled_tokens]
        if len(tokens) != len(flight.batch.rows):
            raise ValueError(f"batch {batch_id} has {len(flight.batch.rows)} rows, "
                             f"got {len(tokens)} sampled tokens")
        if tokens and min(tokens) < 0:
            raise ValueError(f"sampled token ids must be >= 0, got {min(tokens)}")
        self._in_flight = None
        finished = []
        for row, token in zip(flight.batch.rows, tokens, strict=True):
            request = self._requests[row.request_id]
            request.generated.append(token)
            reason = self._finish_reason(request, token)
            if reason is not None:
                self._finished.append(self._retire(request, reason))
                finished.append(request.request_id)
        self.allocator.commit()
        flight.log_entry["finished"] = finished
        flight.log_entry["sampled"] = tokens
        self.num_steps += 1
        self.step_log.append(flight.log_entry)
        self._logged_request_id = flight.arrived_before

    def fail(self, batch_id: int) -> None:
        """Forget the batch: every piece of state goes back to what it was before schedule()."""
        saved = self._flight(batch_id).saved
        self._in_flight = None
        self.allocator.rollback()
        arrived_since = [rid for rid in self._waiting if rid >= saved.next_request_id]
        self._waiting = deque(saved.waiting + arrived_since)
        self._running = saved.running
        for request_id, (status, num_preemptions) in saved.request_states.items():
            request = self._requests[request_id]
            request.status, request.num_preemptions = status, num_preemptions
        self._group, self._group_decoding = saved.group, saved.group_decoding
        self._next_batch_id = saved.next_batch_id
        self.num_preemptions = saved.num_preemptions
        self._parked = OrderedDict(saved.parked)

    # ---- requests out ------------------------------------------------------------------------
    def cancel(self, request_id: int) -> Result:
        """Drop a waiting or running request; return what it generated so far ("cancelled").

        The result is returned here, not through pop_finished(). Between steps only.
        """
        if self._in_flight is not None:
            raise SchedulerError("cancel() between steps only: a batch is in flight")
        request = self._requests.get(request_id)
        if request is None:
            raise InvalidRequest(f"no waiting or running request {request_id}")
        if request.status == "waiting":
            self._waiting.remove(request_id)
        result = self._retire(request, "cancelled")
        self.allocator.commit()
        return result

    def drop_session(self, session) -> None:
        """Free the pages parked for `session` (if any). Between steps only."""
        if self._in_flight is not None:
            raise SchedulerError("drop_session() between steps only: a batch is in flight")
        parked = self._parked.pop(session, None)
        if parked is not None:
            self.allocator.free(parked.seq_id)
            self.allocator.commit()

    def drop_all_sessions(self) -> None:
        for session in list(self._parked):
            self.drop_session(session)

    def pop_finished(self) -> list[Result]:
        """Results of the requests finished since the last call, in finishing order."""
        finished, self._finished = self._finished, []
        return finished

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def snapshot(self) -> dict:
        """Plain-data picture of the state, for inspection, plots and exact comparisons."""
        return {
            "policy": self.policy,
            "admission": self.admission,
            "in_flight": None if self._in_flight is None else self._in_flight.batch.batch_id,
            "step": self.num_steps,
            "waiting": list(self._waiting),
            "running": list(self._running),
            "num_tokens": {rid: r.num_tokens for rid, r in self._requests.items()},
            "preemptions": {rid: r.num_preemptions for rid, r in self._requests.items()},
            "status": {rid: r.status for rid, r in self._requests.items()},
            "block_tables": {rid: self.allocator.block_table(rid) for rid in self._running},
            "free_blocks": self.allocator.num_free,
            "used_blocks": self.allocator.num_used,
            "num_blocks": self.allocator.num_blocks,
            "block_size": self.allocator.block_size,
            "group": list(self._group),
            "group_decoding": self._group_decoding,
            "idle_slots": self._idle_slots(),
            "total_preemptions": self.num_preemptions,
            "next_batch_id": self._next_batch_id,
            "finished": [result.request_id for result in self._finished],
            "parked_tables": {p.seq_id: self.allocator.block_table(p.seq_id) for p in self._parked.values()},
        }

    # ---- internals ---------------------------------------------------------------------------
    def _new_request_id(self) -> int:
        self._next_request_id += 1
        return self._next_request_id - 1

    def _prefill_rows(self) -> list[Row]:
        """Admit waiting requests from the head of the queue while they fit (FIFO, no overtaking)."""
        rows: list[Row] = []
        num_tokens = 0
        promised = sum(self._requests[rid].worst_blocks for rid in self._running)
        while self._waiting:
            request = self._requests[self._waiting[0]]
            n = request.num_tokens
            if not self._has_seat(request):
                break
            if rows and num_tokens + n > self.max_batch_tokens:
                break
            tokens = request.prompt_ids + request.generated
            parked = self._parked.get(request.session) if request.session is not None else None
            own = len(self.allocator.block_table(parked.seq_id)) if parked else 0
            evictable = sum(len(self.allocator.block_table(p.seq_id)) for p in self._parked.values()) - own
            if n > self.allocator.max_seq_len or \
                    self.allocator.blocks_needed(n) > self.allocator.num_free + own + evictable:
                break
            if (self.admission == "conservative"
                    and promised + request.worst_blocks > self.allocator.num_blocks):
                break
            self._waiting.popleft()
            while self.allocator.blocks_needed(n) > self.allocator.num_free + own:
                self._evict_oldest_parked(keep=request.session)
            reused = 0
            if parked:   # adopt the session's pages: their common prefix is not computed again
                reused = min(common_prefix(parked.tokens, tokens), n - 1)
                del self._parked[request.session]
                self.allocator.adopt(request.request_id, parked.seq_id, reused)
            self.allocator.reserve(request.request_id, n)
            request.status = "running"
            self._running.append(request.request_id)
            if self.policy == "static" and request.request_id not in self._group:
                self._group.append(request.request_id)
            promised += request.worst_blocks
            num_tokens += n - reused
            rows.append(self._row(request, tokens[reused:], start_pos=reused))
        return rows

    def _evict_oldest_parked(self, keep=None) -> None:
        """Free the least recently parked table (never `keep`'s); the caller checked one exists."""
        session = next(s for s in self._parked if s != keep)
        self.allocator.free(self._parked.pop(session).seq_id)

    def _has_seat(self, request: _Request) -> bool:
        if self.policy == "continuous":
            return len(self._running) < self.max_seqs
        if request.request_id in self._group:   # a preempted member comes back to its own seat
            return True
        return not self._group_decoding and len(self._group) < self.max_seqs

    def _decode_rows(self) -> tuple[list[Row], list[int]]:
        """One new position for every running sequence, preempting the newest while blocks lack."""
        queue = deque(self._running)   # oldest first
        scheduled, preempted = [], []
        while queue:
            request = self._requests[queue.popleft()]
            n = request.num_tokens
            while not self.allocator.can_reserve(request.request_id, n):
                if self._parked and n <= self.allocator.max_seq_len:
                    self._evict_oldest_parked()   # cached pages go before anyone is preempted
                    continue
                victim = queue.pop() if queue else request.request_id
                self._preempt(victim)
                preempted.append(victim)
                if victim == request.request_id:
                    break
            else:
                self.allocator.reserve(request.request_id, n)
                scheduled.append(request)
        self._running = [request.request_id for request in scheduled]
        rows = [self._row(request, request.generated[-1:], start_pos=request.num_tokens - 1) for request in scheduled]
        return rows, preempted

    def _preempt(self, request_id: int) -> None:
        request = self._requests[request_id]
        self.allocator.free(request_id)
        request.status = "waiting"
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._waiting.appendleft(request_id)   # several in one step: the oldest ends up first

    def _row(self, request: _Request, token_ids: list[int], start_pos: int) -> Row:
        return Row(request.request_id, list(token_ids), start_pos,
                   self.allocator.block_table(request.request_id), request.params,
                   len(request.generated))

    def _finish_reason(self, request: _Request, token: int) -> str | None:
        if token in self.eos_token_ids and not request.ignore_eos:
            return "stop"
        if len(request.generated) >= request.max_new_tokens or request.num_tokens >= self.max_context:
            return "length"
        return None

    def _retire(self, request: _Request, reason: str) -> Result:
        """Remove a request for good, free its memory, end a static group it was the last of."""
        if request.status == "running":
            self._running.remove(request.request_id)
            if request.session is not None:   # keep the pages for the session's next request
                old = self._parked.pop(request.session, None)
                if old is not None:
                    self.allocator.free(old.seq_id)
                cached = (request.prompt_ids + request.generated)[:request.num_tokens - 1]
                self._parked[request.session] = _Parked(request.request_id, cached)
            else:
                self.allocator.free(request.request_id)
        del self._requests[request.request_id]
        if self._group and not any(member in self._requests for member in self._group):
            self._group, self._group_decoding = [], False
        return Result(request.request_id, list(request.prompt_ids), list(request.generated), reason)

    def _idle_slots(self) -> int:
        """Static: members already finished but still holding their seat in the group."""
        return sum(member not in self._requests for member in self._group)

    def _flight(self, batch_id: int) -> _InFlight:
        if self._in_flight is None or self._in_flight.batch.batch_id != batch_id:
            current = None if self._in_flight is None else self._in_flight.batch.batch_id
            raise SchedulerError(f"batch {batch_id} is not in flight (in flight: {current})")
        return self._in_flight

    def _save(self) -> _Saved:
        return _Saved(list(self._waiting), list(self._running),
                      {rid: (r.status, r.num_preemptions) for rid, r in self._requests.items()},
                      list(self._group), self._group_decoding, self._next_batch_id,
                      self._next_request_id, self.num_preemptions,
                      list(self._parked.items()))

    def _log_entry(self, batch: Batch, preempted: list[int]) -> StepRecord:
        # A running request has generated at least one token, so a prefill row with generated
        # tokens is a preempted request coming back, and one without is a first admission.
        prefill_rows = batch.rows if batch.kind == "prefill" else []
        # Tokens whose K/V sit in the cache after this step: the rows' context, plus (prefill)
        # the running sequences that wait outside the batch with length - 1 tokens cached.
        in_batch = {row.request_id for row in batch.rows}
        cached = sum(self._requests[rid].num_tokens - (rid not in in_batch) for rid in self._running)
        return {
            "step": self.num_steps,
            "batch_id": batch.batch_id,
            "kind": batch.kind,
            "request_ids": [row.request_id for row in batch.rows],
            "start_positions": batch.start_positions.tolist(),      # the runner's arrays, built once
            "rows": len(batch.rows),
            "tokens": batch.num_tokens,
            "context_tokens": int(batch.context_lens.sum()),
            "arrived": list(range(self._logged_request_id, self._next_request_id)),
            "admitted": [row.request_id for row in prefill_rows if not row.num_generated],
            "recomputed_tokens": sum(len(row.token_ids) for row in prefill_rows if row.num_generated),
            "reused_tokens": sum(row.start_pos for row in prefill_rows),
            "preempted": list(preempted),
            "running": len(self._running),
            "waiting": len(self._waiting),
            "idle_slots": self._idle_slots(),
            "used_blocks": self.allocator.num_used,
            "free_blocks": self.allocator.num_free,
            "cached_tokens": cached,
            "finished": [],        # filled in by complete()
        }
