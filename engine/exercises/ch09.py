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
from engine.model.random_model import PRESETS
from engine.runtime.kv_allocator import KVAllocator, SlotAllocator
from engine.runtime.sampling_params import SamplingParams
from engine.runtime.scheduler import Scheduler
from engine.runtime.step_log import StepRecord

STAND_IN_TOKEN = 7


def run_scheduler(prompt_lens: Sequence[int], max_new: Sequence[int], *, policy: str, max_seqs: int,
                  max_batch_tokens: int | None = None, arrivals: Sequence[int] | None = None,
                  allocator: KVAllocator | None = None, admission: str = "conservative",
                  scheduler_cls: type[Scheduler] = Scheduler) -> list[StepRecord]:
    """The step log of a workload. Request i gets id i and is submitted once arrivals[i] steps have
    run (non-decreasing; default: all before the first step), or earlier when the engine would
    otherwise sit idle. Without an allocator: max_seqs contiguous slots of a context just long
    enough for the longest request. Without max_batch_tokens: no token limit. scheduler_cls: the
    Scheduler (sub)class that runs it."""
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
    submitted = 0
    while submitted < n or sched.has_unfinished():
        while submitted < n and (arrivals[submitted] <= len(sched.step_log) or not sched.has_unfinished()):
            params = SamplingParams(max_new_tokens=max_new[submitted], ignore_eos=True)
            sched.submit([STAND_IN_TOKEN] * prompt_lens[submitted], params)
            submitted += 1
        batch = sched.schedule()
        if batch is not None:   # None: every request so far had max_new_tokens == 0
            sched.complete(batch.batch_id, [STAND_IN_TOKEN] * len(batch.rows))
    return sched.step_log


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
