"""Chapter 09 exercises: the cost of static batching, counted by hand and checked against the engine.

`run_scheduler` drives the real Scheduler with a stand-in model (every sampled token is 7 and eos
never stops a request), so a timeline depends only on prompt lengths, max_new_tokens and arrivals:
the checkers of chapters 09-10 take their expected answers from it.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from engine.exercises import check_cases
from engine.formats.config import config_from_dict
from engine.model.forward_pass import ForwardBatch
from engine.model.random_model import PRESETS
from engine.runtime.kv_allocator import KVAllocator, SlotAllocator
from engine.runtime.sampling_params import SamplingParams
from engine.runtime.scheduler import Scheduler
from engine.runtime.step_log import StepRecord

STAND_IN_TOKEN = 7


def run_scheduler(prompt_lens: Sequence[int], max_new: Sequence[int], *, policy: str, max_seqs: int,
                  max_batch_tokens: int | None = None, arrivals: Sequence[int] | None = None,
                  allocator: KVAllocator | None = None, admission: str = "conservative",
                  scheduler_cls: type[Scheduler] = Scheduler, max_steps: int | None = None) -> list[StepRecord]:
    """The step log of a workload. Request i gets id i and is submitted once arrivals[i] steps have
    run (non-decreasing; default: all before the first step), or earlier when the engine would
    otherwise sit idle. Without an allocator: max_seqs contiguous slots of a context just long
    enough for the longest request. Without max_batch_tokens: no token limit. scheduler_cls: the
    Scheduler (sub)class that runs it. Raises NoProgress when schedule() returns no batch while
    requests are unfinished, or when more than max_steps steps run (default: a bound far above what
    any working scheduler needs)."""
    n = len(prompt_lens)
    arrivals = list(arrivals) if arrivals is not None else [0] * n
    if not len(max_new) == len(arrivals) == n:
        raise ValueError("prompt_lens, max_new and arrivals must have one entry per request")
    if any(a > b for a, b in zip(arrivals, arrivals[1:])):
        raise ValueError(f"arrivals must be non-decreasing (request i gets id i), got {arrivals}")
    max_context = max(p + m for p, m in zip(prompt_lens, max_new)) + 1
    allocator = allocator or SlotAllocator(max_seqs, max_context)
    budget = max_batch_tokens or max(max_seqs, sum(prompt_lens) + sum(max_new))
    sched = scheduler_cls(allocator, max_seqs, budget, max(max_context, allocator.max_seq_len + 1),
                      policy=policy, admission=admission)
    # A bound on the steps of any workload: the engine's own scheduler needs far fewer (each step
    # computes at least one token of some request); a learner's loop that keeps scheduling without
    # finishing anything is stopped here instead of running forever.
    cap = max_steps if max_steps is not None else 20 * (sum(prompt_lens) + sum(max_new)) + 100
    submitted = 0
    while submitted < n or sched.has_unfinished():
        while submitted < n and (arrivals[submitted] <= len(sched.step_log) or not sched.has_unfinished()):
            params = SamplingParams(max_new_tokens=max_new[submitted], ignore_eos=True)
            sched.submit([STAND_IN_TOKEN] * prompt_lens[submitted], params)
            submitted += 1
        if len(sched.step_log) >= cap:
            raise NoProgress(f"{len(sched.step_log)} steps ran and {_unfinished(sched)} still unfinished: "
                             f"the scheduler keeps running steps without finishing the workload")
        batch = sched.schedule()
        if batch is not None:
            sched.complete(batch.batch_id, [STAND_IN_TOKEN] * len(batch.rows))
        elif sched.has_unfinished():
            # the engine loop refuses this too: nothing would ever change, so the loop would spin forever
            raise NoProgress(f"after {len(sched.step_log)} steps schedule() returned no batch while "
                             f"{_unfinished(sched)} unfinished (when a running sequence has no room to "
                             f"grow, something must be preempted)")
        # (None without unfinished requests: every request so far had max_new_tokens == 0)
    return sched.step_log


class NoProgress(RuntimeError):
    """A scheduler that stopped making progress: no batch while requests wait, or steps without end."""


def _unfinished(sched: Scheduler) -> str:
    try:
        return f"{len(sched._running)} running and {len(sched._waiting)} waiting requests"
    except AttributeError:
        return "requests"


def demo_workload(num_requests: int = 12, seed: int = 0, vocab_size: int = 397):
    """The small workload of chapters 09-11: (prompts as token-id lists, one SamplingParams each).
    Prompts of 8-64 tokens, 4-64 new tokens, eos ignored so that every request generates exactly
    what it asked for (ids 3.. avoid the tiny model's special tokens)."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, vocab_size, int(n)).tolist() for n in rng.integers(8, 65, num_requests)]
    params = [SamplingParams(max_new_tokens=int(n), ignore_eos=True) for n in rng.integers(4, 65, num_requests)]
    return prompts, params


# ----------------------------------------------------------------------------- padding

def pad_tokens_ref(prompt_lens: Sequence[int], batch_size: int) -> int:
    """FIFO batches of batch_size prompts, each batch padded to its longest prompt."""
    pads = 0
    for start in range(0, len(prompt_lens), batch_size):
        group = prompt_lens[start:start + batch_size]
        pads += len(group) * max(group) - sum(group)
    return pads


def check_pad_tokens(fn: Callable[[list, int], int]) -> bool:
    """fn(prompt_lens, batch_size) -> pad tokens of FIFO batches, each padded to its own longest prompt."""
    rng = np.random.default_rng(9)
    workloads = [([3, 5, 2], 3), ([3, 5, 2], 2), ([7], 4), ([4, 4, 4, 4], 2), ([1, 9, 1, 9, 1], 2)]
    workloads += [(rng.integers(100, 1025, n).tolist(), b) for n, b in ((256, 64), (50, 16), (9, 4))]
    cases = [((lens, b), pad_tokens_ref(lens, b)) for lens, b in workloads]
    hints = [("every batch was padded to the longest prompt of the whole workload",
              lambda lens, b: len(lens) * max(lens) - sum(lens)),
             ("these are the padded tokens in total (real + pad); count only the pads",
              lambda lens, b: pad_tokens_ref(lens, b) + sum(lens)),
             ("the last, partial batch was left out",
              lambda lens, b: pad_tokens_ref(lens[:len(lens) - len(lens) % b], b))]
    return check_cases("pad_tokens", fn, cases, hints=hints)


# ----------------------------------------------------------------------------- waiting for the slowest

def static_decode_cost_ref(max_new: Sequence[int], batch_size: int) -> tuple[int, int]:
    """(decode steps, idle slot-steps) of static batching, read off the scheduler's step log."""
    log = run_scheduler([4] * len(max_new), max_new, policy="static", max_seqs=batch_size)
    decode = [e for e in log if e["kind"] == "decode"]
    return len(decode), sum(e["idle_slots"] for e in decode)


def check_static_decode_cost(fn: Callable[[list, int], tuple]) -> bool:
    """fn(max_new_tokens per request, batch_size) -> (decode steps, idle slot-steps) under static
    batching. Requests are grouped FIFO; the first token of each comes from its prefill step."""
    rng = np.random.default_rng(10)
    workloads = [([3, 1, 2], 3), ([5, 5], 2), ([1, 1, 1], 2), ([10, 2, 3, 4, 1], 2), ([1], 1)]
    workloads += [(rng.integers(1, 60, n).tolist(), b) for n, b in ((12, 4), (20, 5), (7, 8))]
    cases = [((m, b), static_decode_cost_ref(m, b)) for m, b in workloads]

    def groups(m, b):
        return [m[i:i + b] for i in range(0, len(m), b)]
    hints = [("the first token was counted as a decode step; it comes from the prefill",
              lambda m, b: (sum(max(g) for g in groups(m, b)), sum(len(g) * max(g) - sum(g) for g in groups(m, b)))),
             ("the group was padded to the longest request of the whole workload",
              lambda m, b: (len(groups(m, b)) * (max(m) - 1), sum(len(g) * max(m) - sum(g) for g in groups(m, b))))]
    return check_cases("static_decode_cost", fn, cases, hints=hints,
                             same=lambda got, want: tuple(int(v) for v in got) == want)


# ----------------------------------------------------------------------------- slot memory

def check_slot_cache_bytes(fn: Callable) -> bool:
    """fn(config, num_slots, max_context, bytes_per_value) -> bytes of a contiguous KV cache of
    num_slots slots, each reserving max_context positions of K and V in every layer."""
    configs = [config_from_dict(dict(PRESETS[name])) for name in ("smollm2-135m", "llama-3.2-1b", "tiny", "tiny-mqa")]
    cases = [((cfg, slots, ctx, b), slots * ctx * cfg.kv_bytes_per_token(b))
             for cfg in configs for slots, ctx, b in ((1, 2048, 2), (16, 4096, 2), (4, 256, 4))]
    hints = [("the K and V heads were counted with num_attention_heads; GQA stores only the "
              "num_key_value_heads", lambda c, s, t, b: 2 * c.num_hidden_layers * c.num_attention_heads * c.head_dim * b * s * t),
             ("only K was counted (V takes as much again)", lambda c, s, t, b: s * t * c.kv_bytes_per_token(b) // 2),
             ("one layer was counted; every layer has its own K and V",
              lambda c, s, t, b: s * t * c.kv_bytes_per_token(b) // c.num_hidden_layers)]
    return check_cases("slot_cache_bytes", fn, cases, hints=hints)


# ----------------------------------------------------------------------------- in the real model

def check_static_batching_in_model(static_decode_cost: Callable, max_new=(16, 5, 12, 3), batch_size: int = 2) -> bool:
    """The default model answers four chat prompts with static batching (FIFO groups of batch_size, eos
    ignored so every answer has exactly max_new[i] tokens). Your static_decode_cost(max_new, batch_size)
    must predict the decode steps and idle seat-steps that engine.LLM's step log records."""
    import engine
    from engine.exercises import call_learner
    from engine.exercises.serving_check import default_chat_prompts
    title = "static batching in the model"
    model_dir, prompts = default_chat_prompts(("What is the capital of France?", "Name a color.",
                                               "Why is the sky blue?", "Say hi."))
    llm = engine.LLM(model_dir, backend="numpy", batching="static", max_seqs=batch_size, max_context=256)
    results = llm.generate(prompts, [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in max_new])
    decode = [e for e in llm.last_step_log if e["kind"] == "decode"]
    measured = (len(decode), sum(e["idle_slots"] for e in decode))
    for i, r in enumerate(results):
        print(f"    request {i} ({max_new[i]} tokens): {r.text!r}")
    call = f"{getattr(static_decode_cost, '__name__', 'fn')}({list(max_new)}, {batch_size})"
    ok, got = call_learner(title, call, static_decode_cost, list(max_new), batch_size)
    if not ok:
        return False
    try:
        got = tuple(int(v) for v in got)
    except (TypeError, ValueError):
        got = None
    if got != measured:
        print(f"[x] {title}: {call} returned {got}, the engine ran {measured[0]} decode steps with "
              f"{measured[1]} idle seat-steps")
        return False
    print(f"[OK] {title}: {call} = {measured}: {measured[0]} decode steps, {measured[1]} idle seat-steps, "
          f"as engine.LLM's step log says")
    return True


# ----------------------------------------------------------------------------- build the static batcher

PAD = -1   # the token of a padding row: a seat whose request has finished but whose group has not


class _Verdict(BaseException):
    """Stops the learner's loop at its first mistake (a BaseException, so that an `except Exception`
    in the learner's code cannot swallow it)."""


class StaticBatchRunner:
    """The real model and a contiguous KV cache of `seats` slots, behind the two calls a static
    batcher makes. Greedy: each call returns the argmax token of every row.

      prefill(prompts) -> [first token of each]
          Start a new group: prompt s goes into seat s (its K/V into slot s, positions 0..len-1), all
          prompts packed into one forward pass. Every seat of the group before is emptied.
      decode(tokens) -> [next token of each seat]
          One decode step of the group: tokens[s] is seat s's newest token (fed at its next position),
          or PAD for a seat whose request has finished; a PAD row computes nothing and returns PAD.
          One entry per seat of the group, finished or not: a finished row keeps its place.

    The runner also checks what a static batcher must do (the checker's verdicts come from here).
    """

    PAD = PAD

    def __init__(self, model, prompts, max_new, seats: int, max_steps: int):
        from engine.model.kv_cache import KVCache
        self.model, self.seats, self.max_steps = model, seats, max_steps
        self._prompts = [list(map(int, p)) for p in prompts]
        self._max_new = list(max_new)
        self._context = max(len(p) + m for p, m in zip(self._prompts, self._max_new))
        self.cache = KVCache.contiguous(model.config, seats, self._context, model.backend)
        self.trace: list[dict] = []       # one entry per step, in the shape of the engine's step log
        self.mistake: str | None = None
        self._next = 0                    # the next request in FIFO order
        self._group: list[int] = []       # request id of each seat
        self._produced: list[int] = []    # tokens produced so far by each seat's request
        self._last: list[int] = []        # each seat's newest token

    # ---- the learner's two calls ---------------------------------------------------------------
    def prefill(self, prompts) -> list[int]:
        self._step_allowed()
        try:
            prompts = [[int(t) for t in p] for p in prompts]
        except (TypeError, ValueError):
            self._fail("prefill(prompts) takes a list of prompts, each a list of token ids")
        live = [self._group[s] for s in range(len(self._group)) if self._live(s)]
        if live:
            self._fail(f"step {len(self.trace)}: prefill of a new group while request(s) {live} of the "
                       f"current group still had tokens to generate -- a static batch finishes before "
                       f"anything new is admitted (admitting into a free seat mid-batch is continuous "
                       f"batching, chapter 10)")
        if not 1 <= len(prompts) <= self.seats:
            self._fail(f"step {len(self.trace)}: a group of {len(prompts)} prompts for {self.seats} seats")
        ids = []
        for k, p in enumerate(prompts):
            rid = self._next + k
            if rid >= len(self._prompts) or p != self._prompts[rid]:
                which = next((i for i, q in enumerate(self._prompts) if q == p), None)
                where = "not one of the requests" if which is None else f"request {which}'s prompt"
                self._fail(f"step {len(self.trace)}: seat {k} of the new group got {where}, expected "
                           f"request {rid} -- groups are taken first-in first-out: requests "
                           f"{self._next}..{self._next + len(prompts) - 1}, in order")
            ids.append(rid)
        self._next += len(prompts)
        lens = [len(p) for p in prompts]
        cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        pos = np.concatenate([np.arange(n) for n in lens]).astype(np.int32)
        seat = np.repeat(np.arange(len(prompts)), lens).astype(np.int32)
        fb = ForwardBatch(np.concatenate(prompts).astype(np.int32), pos, cu,
                          np.arange(len(prompts), dtype=np.int32)[:, None],
                          (seat * self._context + pos).astype(np.int32), (cu[1:] - 1).astype(np.int32))
        tokens = self._greedy(fb)
        self._group, self._produced, self._last = ids, [1] * len(ids), tokens
        self._log("prefill", ids, ids, 0)
        return list(tokens)

    def decode(self, tokens) -> list[int]:
        self._step_allowed()
        step = len(self.trace)
        try:
            tokens = [int(t) for t in tokens]
        except (TypeError, ValueError):
            self._fail("decode(tokens) takes one token id (or PAD) per seat of the group")
        if not self._group:
            self._fail(f"step {step}: decode before any prefill: a group starts with the prefill of its prompts")
        if len(tokens) != len(self._group):
            self._fail(f"step {step}: decode got {len(tokens)} tokens for a group of {len(self._group)} seats -- "
                       f"a finished request keeps its seat until the group ends: pass PAD for its row "
                       f"rather than leaving it out (the rows after it would shift into the wrong seats)")
        live = [s for s in range(len(self._group)) if self._live(s)]
        if not live:
            self._fail(f"step {step}: a decode step after every request of the group "
                       f"{self._group} had all its tokens -- off by one: the first token of each comes "
                       f"from the prefill, so a group whose longest request wants n tokens needs n - 1 "
                       f"decode steps")
        for s, t in enumerate(tokens):
            rid = self._group[s]
            if s in live and t == PAD:
                self._fail(f"step {step}: seat {s} (request {rid}) was padded after {self._produced[s]} of "
                           f"its {self._max_new[rid]} tokens -- only a request that has all its tokens "
                           f"becomes padding")
            if s not in live and t != PAD:
                self._fail(f"step {step}: seat {s} (request {rid}) already had its {self._max_new[rid]} "
                           f"tokens, but its row was fed token {t} -- a finished request's row is padding "
                           f"(pass PAD): decoding it again generates tokens nobody asked for")
            if s in live and t != self._last[s]:
                self._fail(f"step {step}: seat {s} (request {rid}) was fed token {t}, but its newest token "
                           f"is {self._last[s]} -- feed each seat the token it produced last")
        rows = [s for s in live]
        pos = np.array([len(self._prompts[self._group[s]]) + self._produced[s] - 1 for s in rows], dtype=np.int32)
        seat = np.array(rows, dtype=np.int32)
        fb = ForwardBatch(np.array([tokens[s] for s in rows], dtype=np.int32), pos,
                          np.arange(len(rows) + 1, dtype=np.int32), seat[:, None],
                          (seat * self._context + pos).astype(np.int32))
        new = self._greedy(fb)
        out = [PAD] * len(self._group)
        for s, t in zip(rows, new):
            out[s] = t
            self._last[s] = t
            self._produced[s] += 1
        self._log("decode", [self._group[s] for s in rows], [], len(self._group) - len(rows))
        return out

    # ---- bookkeeping ---------------------------------------------------------------------------
    def _live(self, s: int) -> bool:
        return self._produced[s] < self._max_new[self._group[s]]

    def _step_allowed(self) -> None:
        if self.mistake is not None:       # a loop that caught the verdict and went on: stop it again
            raise _Verdict(self.mistake)
        if len(self.trace) >= self.max_steps:
            self._fail(f"no end after {len(self.trace)} steps (the engine serves this workload in fewer): the "
                       f"loop makes no progress -- does it stop decoding a group once every member has its "
                       f"max_new tokens, and move on to the next group?")

    def _greedy(self, fb) -> list[int]:
        logits = self.model.forward(fb, self.cache)          # the checker runs the NumPy backend
        return [int(t) for t in np.asarray(logits).argmax(axis=-1)]

    def _log(self, kind: str, rows: list[int], admitted: list[int], idle: int) -> None:
        finished = [self._group[s] for s in range(len(self._group))
                    if self._group[s] in rows and not self._live(s)]
        self.trace.append(dict(step=len(self.trace), kind=kind, request_ids=rows, admitted=admitted,
                               finished=finished, idle_slots=idle))

    def _fail(self, why: str):
        self.mistake = self.mistake or why
        raise _Verdict(self.mistake)


def static_batcher_ref(runner: StaticBatchRunner, prompts, max_new, batch_size: int) -> list[list[int]]:
    """Static batching through a StaticBatchRunner: FIFO groups of batch_size, each decoded until its
    longest request is done (finished seats padded), then the next group."""
    outputs: list[list[int]] = [[] for _ in prompts]
    for start in range(0, len(prompts), batch_size):
        group = list(range(start, min(start + batch_size, len(prompts))))
        last = runner.prefill([prompts[i] for i in group])
        for i, t in zip(group, last):
            outputs[i].append(t)
        while any(len(outputs[i]) < max_new[i] for i in group):
            feed = [last[s] if len(outputs[i]) < max_new[i] else PAD for s, i in enumerate(group)]
            last = runner.decode(feed)
            for s, i in enumerate(group):
                if feed[s] != PAD:
                    outputs[i].append(last[s])
    return outputs


def _engine_static(model_dir, prompts, max_new, batch_size):
    """The engine's static batching on the same requests: (greedy tokens of each, its step log)."""
    import engine
    llm = engine.LLM(model_dir, backend="numpy", batching="static", kv_cache="contiguous", max_seqs=batch_size,
                     max_context=max(len(p) + m for p, m in zip(prompts, max_new)) + 1, chunked_prefill=False)
    results = llm.generate(prompts, [SamplingParams(max_new_tokens=m, ignore_eos=True) for m in max_new])
    return [r.token_ids for r in results], llm.last_step_log


def timeline_of(step_log) -> list[tuple[str, list[int]]]:
    """[(kind, request ids in the batch), ...], one entry per step."""
    return [(e["kind"], list(e["request_ids"])) for e in step_log]


def _run_static_case(title: str, fn: Callable, model, model_dir, prompts, max_new, batch_size, context: str):
    """One workload: the engine's static run, then yours through a StaticBatchRunner on the same model.
    (ok, your outputs, the runner)."""
    want, log = _engine_static(model_dir, prompts, max_new, batch_size)
    runner = StaticBatchRunner(model, prompts, max_new, batch_size, max_steps=2 * len(log) + 8)
    name = getattr(fn, "__name__", "fn")
    try:
        got = fn(runner, [list(p) for p in prompts], list(max_new), batch_size)
    except _Verdict:
        print(f"[x] {title}{context}: {runner.mistake}")
        return False, None, runner
    except NotImplementedError:
        print(f"[ ] {title}: not attempted yet (the function still raises NotImplementedError)")
        return False, None, runner
    except Exception as e:  # the learner's bug, shown rather than raised
        print(f"[x] {title}{context}: {name}(...) raised {type(e).__name__}: {e}")
        return False, None, runner
    try:
        got = [[int(t) for t in out] for out in got]
    except (TypeError, ValueError):
        print(f"[x] {title}{context}: return one list of token ids per request, got {got!r:.120}")
        return False, None, runner
    if len(got) != len(prompts):
        print(f"[x] {title}{context}: returned {len(got)} outputs for {len(prompts)} requests")
        return False, None, runner
    never = list(range(runner._next, len(prompts)))
    if never:
        hint = " -- the last, partial group was left out" if len(prompts) % batch_size and \
            runner._next == len(prompts) - len(prompts) % batch_size else ""
        print(f"[x] {title}{context}: requests {never} never ran (no prefill){hint}")
        return False, None, runner
    for i, (mine, real) in enumerate(zip(got, want)):
        if PAD in mine:
            k = mine.index(PAD)
            print(f"[x] {title}{context}: request {i}'s output holds PAD at index {k} -- the rows of a finished "
                  f"request are padding: keep only the tokens a seat produced while its request was live")
            return False, None, runner
        if len(mine) != len(real):
            off = {len(real) - 1: " -- one short: the prefill's token is the request's first output token",
                   len(real) + 1: " -- one too many: max_new counts the prefill's token too"}.get(len(mine), "")
            print(f"[x] {title}{context}: request {i} got {len(mine)} tokens, it asked for {len(real)}{off}")
            return False, None, runner
        if mine != real:
            k = next(j for j, (a, b) in enumerate(zip(mine, real)) if a != b)
            print(f"[x] {title}{context}: request {i} differs first at its token {k}: yours {mine[k]}, the "
                  f"engine's {real[k]} (the runner's step gave {mine[k]}: was it appended to the right request?)")
            return False, None, runner
    mine_t, real_t = timeline_of(runner.trace), timeline_of(log)
    for s, (a, b) in enumerate(zip(mine_t, real_t)):
        if a != b or runner.trace[s]["idle_slots"] != log[s]["idle_slots"]:
            print(f"[x] {title}{context}: step {s}: you ran {a[0]} of {a[1]} ({runner.trace[s]['idle_slots']} "
                  f"padded seats), the engine {b[0]} of {b[1]} ({log[s]['idle_slots']} idle seats)")
            return False, None, runner
    if len(mine_t) != len(real_t):
        print(f"[x] {title}{context}: your run took {len(mine_t)} steps, the engine's {len(real_t)}")
        return False, None, runner
    return True, got, runner


def static_workloads(seed: int = 3):
    """(prompts, max_new, batch_size) cases on the tiny model: partial last groups, a request that ends
    at its prefill, one seat, groups with one long member."""
    rng = np.random.default_rng(seed)
    def prompts(n):
        return [rng.integers(3, 390, int(k)).tolist() for k in rng.integers(2, 14, n)]
    yield prompts(3), [3, 1, 2], 3
    yield prompts(5), [4, 2, 6, 1, 3], 2
    yield prompts(4), [2, 5, 5, 2], 4
    yield prompts(3), [1, 1, 1], 2
    yield prompts(2), [3, 2], 1
    yield prompts(7), rng.integers(1, 12, 7).tolist(), 3


def check_static_batcher(fn: Callable) -> bool:
    """fn(runner, prompts, max_new, batch_size) -> the generated tokens of each request (exactly max_new[i]
    each, eos ignored), served with static batching through runner (a StaticBatchRunner): FIFO groups of
    batch_size; each group is prefilled in one call, then decoded one step at a time until its longest
    request is done, a finished request's seat padded with runner.PAD; then the next group. The tokens
    must be the engine's static batching's, and every step the engine's."""
    from engine.exercises.ch08 import tiny_model
    from engine.exercises.serving_check import tiny_model_dir
    title = "static_batcher"
    model, model_dir = tiny_model("tiny"), tiny_model_dir()
    count = 0
    for prompts, max_new, b in static_workloads():
        context = f" (max_new={max_new}, batch_size={b})"
        ok, _, _ = _run_static_case(title, fn, model, model_dir, prompts, max_new, b, context)
        if not ok:
            return False
        count += 1
    print(f"[OK] {title}: all {count} workloads give the engine's tokens and the engine's steps (tiny model)")
    return True


def check_static_batcher_in_model(fn: Callable, max_new=(16, 5, 12, 3), batch_size: int = 2) -> bool:
    """The default model (SmolLM2, NumPy backend) answers four chat prompts through your static batcher:
    the same greedy tokens and the same steps as engine.LLM(batching="static")."""
    import engine
    from engine.exercises.serving_check import default_chat_prompts
    title = "static batcher in the model"
    questions = ("What is the capital of France?", "Name a color.", "Why is the sky blue?", "Say hi.")
    model_dir, prompts = default_chat_prompts(questions)
    model = engine.load_model(model_dir, backend="numpy")
    ok, got, runner = _run_static_case(title, fn, model, model_dir, prompts, list(max_new), batch_size,
                                       f" (SmolLM2, max_new={list(max_new)}, batch_size={batch_size})")
    if not ok:
        return False
    tok = engine.load_tokenizer(model_dir)
    for q, out in zip(questions, got):
        print(f"    {q!r:34} -> {tok.decode(out, skip_special_tokens=True)!r}")
    idle = sum(e["idle_slots"] for e in runner.trace)
    print(f"[OK] {title}: SmolLM2 answered through your batcher, {len(runner.trace)} steps ({idle} padded "
          f"seat-steps), the same tokens and steps as engine.LLM(batching='static')")
    return True
