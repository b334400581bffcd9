"""Chapters 10-11: your Scheduler or PageAllocator class runs engine.LLM, compared step by step with the engine's.

`compare_step_logs` names the first step whose log entry differs; `check_llm_with` runs the same
prompts through engine.LLM twice (the engine's classes, then yours) and compares the tokens of every
request and the step logs.
"""
from __future__ import annotations

import functools
import json
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from engine.runtime.sampling_params import SamplingParams
from engine.runtime.scheduler import Scheduler

# What a step log entry must agree on (timings and the entry's own counters are left out).
STEP_FIELDS = ("kind", "request_ids", "admitted", "preempted", "recomputed_tokens", "finished", "running",
               "waiting", "used_pages", "free_pages", "tokens")


def compare_step_logs(title: str, got: Sequence[Mapping[str, Any]], want: Sequence[Mapping[str, Any]],
                      context: str = "") -> bool:
    """Print the first step (and field) where `got` differs from `want` and return False, else True."""
    for step, (mine, real) in enumerate(zip(got, want, strict=False)):
        for name in STEP_FIELDS:
            if mine.get(name) != real.get(name):
                print(f"[x] {title}{context}: step {step} differs first, in {name!r}: yours {mine.get(name)!r}, "
                      f"the engine's {real.get(name)!r}\n    engine's step {step}: {real['kind']} of "
                      f"{real['request_ids']} (preempted {real['preempted']}, {real['free_pages']} pages free)")
                return False
    if len(got) != len(want):
        print(f"[x] {title}{context}: your run took {len(got)} steps, the engine's {len(want)}; the first "
              f"{min(len(got), len(want))} agree")
        return False
    return True


class StepCapReached(RuntimeError):
    """A learner's class kept engine.LLM stepping far past the steps the engine's classes need."""


def step_capped(cls: type[Scheduler], max_steps: int) -> type[Scheduler]:
    """`cls` with a bound on its steps: schedule() raises StepCapReached once max_steps batches ran, so
    that a scheduler (or allocator) that never finishes the workload fails engine.LLM.generate instead
    of running forever. (A scheduler that returns no batch while requests are unfinished is refused
    by the engine loop itself.)"""

    def schedule(self):
        steps = self.num_steps          # completed steps (the engine loop drains step_log as it goes)
        if steps >= max_steps:
            raise StepCapReached(f"{steps} steps ran and requests are still unfinished")
        return cls.schedule(self)
    return type(cls.__name__, (cls,), {"schedule": schedule, "__doc__": cls.__doc__})


def run_llm(model_dir, prompts, params, *, kv_cache_mib: float, admission: str, max_seqs: int,
            chunked_prefill: bool = True, **classes):
    """(token ids per request, step log, texts) of engine.LLM with the given classes."""
    import engine
    # Chapters 10-11's schedules compute every prompt whole: the prefix cache (chapter 15, on by default
    # with the engine's own classes) stays off in both runs, so that the two compare like with like.
    llm = engine.LLM(model_dir, backend="numpy", kv_cache_mib=kv_cache_mib, admission=admission,
                     max_seqs=max_seqs, max_context=256, chunked_prefill=chunked_prefill, prefix_caching=False,
                     **classes)
    results = llm.generate(prompts, params)
    return [r.token_ids for r in results], llm.last_step_log, [r.text for r in results]


def check_llm_with(title: str, model_dir, prompts, params, *, kv_cache_mib: float, admission: str = "on_demand",
                   max_seqs: int = 4, show_text: bool = False, chunked_prefill: bool = True, **classes) -> bool:
    """engine.LLM with your classes vs with the engine's: the same tokens for every request, the same step log."""
    want_tokens, want_log, _ = run_llm(model_dir, prompts, params, kv_cache_mib=kv_cache_mib,
                                       admission=admission, max_seqs=max_seqs, chunked_prefill=chunked_prefill)
    cap = 4 * len(want_log) + 20
    classes = dict(classes, scheduler_cls=step_capped(classes.get("scheduler_cls", Scheduler), cap))
    try:
        got_tokens, got_log, texts = run_llm(model_dir, prompts, params, kv_cache_mib=kv_cache_mib,
                                             admission=admission, max_seqs=max_seqs,
                                             chunked_prefill=chunked_prefill, **classes)
    except StepCapReached as e:
        print(f"[x] {title}: engine.LLM with your class makes no progress: {e} (the engine's classes "
              f"finish in {len(want_log)} steps)")
        return False
    except NotImplementedError:
        print(f"[ ] {title}: not attempted yet (a method still raises NotImplementedError)")
        return False
    except Exception as e:  # the learner's bug, shown rather than raised
        print(f"[x] {title}: engine.LLM with your class raised {type(e).__name__}: {e}")
        return False
    context = f" (engine.LLM, {len(prompts)} requests, {kv_cache_mib} MiB of KV pages, admission={admission!r})"
    if not compare_step_logs(title, got_log, want_log, context):
        return False
    for i, (mine, real) in enumerate(zip(got_tokens, want_tokens, strict=True)):
        if mine != real:
            print(f"[x] {title}{context}: request {i} generated {mine}, the engine {real}")
            return False
    preempted = sum(len(e["preempted"]) for e in want_log)
    print(f"[OK] {title}{context}: the same {len(want_log)} steps ({preempted} preemptions) and the same tokens")
    if show_text:
        for i, text in enumerate(texts):
            print(f"    request {i}: {text!r}")
    return True


def default_params(n: int, max_new_tokens: int = 16) -> list[SamplingParams]:
    return [SamplingParams(max_new_tokens=max_new_tokens)] * n


@functools.cache
def tiny_model_dir(preset: str = "tiny") -> str:
    """A tiny random-weight model directory (fp32), written once per process into a temporary folder."""
    from engine.model.random_model import write_random_model
    return str(write_random_model(tempfile.mkdtemp(prefix=f"engine_{preset}_"), preset, seed=8, dtype="F32"))


CHAT_PROMPTS = ("What is the capital of France?", "Name three colors.", "What is 2 + 2?")


def default_chat_prompts(texts=CHAT_PROMPTS) -> tuple:
    """(the default model's directory, the token ids of each text as a one-message chat)."""
    import engine
    model_dir = engine.ensure_default_model()
    tok = engine.load_tokenizer(model_dir)
    return model_dir, [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}]), add_special_tokens=False)
                       for t in texts]


def check_default_model_with(title: str, kv_cache_mib: float = 5.0, max_new_tokens: int = 16,
                             chunked_prefill: bool = True, **classes) -> bool:
    """The default model (SmolLM2, NumPy backend) answers three chat prompts through engine.LLM with your
    classes, in a KV pool too small for all three at once (on-demand admission); the same steps and tokens
    as with the engine's classes (both with or both without chunked prefill)."""
    model_dir, prompts = default_chat_prompts()
    return check_llm_with(title, model_dir, prompts, default_params(len(prompts), max_new_tokens),
                          kv_cache_mib=kv_cache_mib, show_text=True, chunked_prefill=chunked_prefill, **classes)


MEASUREMENTS = Path(__file__).resolve().parents[2] / "notes" / "measurements"


def recorded_measurements(series: str, file: str, **where) -> list[dict]:
    """The JSON records of notes/measurements/<series>/<file> (a recorded GPU run of `python -m
    engine.bench`) whose fields equal `where`, e.g. recorded_measurements("h200_2026-12-02_layout",
    "serve.jsonl", scenario="serve"). Lines that are not JSON objects (log lines) are skipped."""
    path = MEASUREMENTS / series / file
    if not path.is_file():
        raise FileNotFoundError(f"{path}: the recorded measurements live in the repository's notes/measurements/")
    records = []
    for line in path.read_text().splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            if all(record.get(k) == v for k, v in where.items()):
                records.append(record)
    return records
