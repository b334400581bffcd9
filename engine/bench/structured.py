"""`python -m engine.bench --scenario structured`: --requests chat requests at once, each asked for a
JSON record, unconstrained and constrained to a JSON schema (structured outputs), in the same run.

Modes, interleaved so that a drift of the machine falls on both alike: "free" (no constraint, async
scheduling), "free+sync" (no constraint, the host schedules between steps: the cost of leaving the
lookahead, which constrained requests no longer do), "schema" (every request constrained) and
"matched" (no constraint, each request exactly as long as its answer in the schema run before: the
same tokens and steps, so the tok/s ratio is the cost of the constraint alone; free answers run
longer, and a batch that shrinks later runs faster per token). The schema/matched pair runs three
times: one run of 256 short answers lasts well under a second.
Each record gives output tok/s, the tokens and steps, how many answers parse (and, constrained,
validate), and the host time spent on masks (advancing each request's automaton, building or reusing
each state's mask; engine/runtime/structured_outputs.py).
Needs a model directory with a tokenizer and a chat template (the default model).
"""
from __future__ import annotations

import json
import time

from engine.bench.workload import emit

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"},
    "city": {"type": "string", "maxLength": 24},
    "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3}},
    "required": ["name", "age", "city"]}
MODES = ["free", "free+sync"] + ["schema", "matched"] * 3
CITIES = ["Lisbon", "Osaka", "Lagos", "Quito", "Tromsø", "Hanoi", "Perth", "Cusco"]


def prompts(tokenizer, n: int) -> list[list[int]]:
    return [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": (
        f"Invent person number {i}, who lives in {CITIES[i % len(CITIES)]}. Reply with a JSON object with the "
        "keys name, age, city and hobbies.")}], add_generation_prompt=True)) for i in range(n)]


def conforms(value) -> bool:
    return (isinstance(value, dict) and {"name", "age", "city"} <= set(value) <= {"name", "age", "city", "hobbies"}
            and isinstance(value["name"], str) and len(value["name"]) <= 24 and type(value["age"]) is int
            and isinstance(value["city"], str) and len(value["city"]) <= 24
            and isinstance(value.get("hobbies", []), list) and len(value.get("hobbies", [])) <= 3)


def scenario_structured(args, setup, model_dir, backend) -> None:
    from engine.runtime.llm import LLM
    from engine.runtime.sampling_params import SamplingParams
    engines = {sync: LLM(model_dir, backend, max_seqs=args.max_seqs, kv_cache_mib=args.kv_cache_mib, max_context=1024,
                         async_scheduling=False if sync else None) for sync in (False, True)}
    tokenizer = engines[False].tokenizer
    if tokenizer is None or not tokenizer.chat_template:
        raise SystemExit("--scenario structured needs a model with a tokenizer and a chat template")
    warm = min(8, args.requests)
    ids = prompts(tokenizer, args.requests + warm)
    lengths: list[int] = []           # the last constrained run's answer lengths
    for mode in MODES:
        llm = engines[mode == "free+sync"]
        structured = ("json_schema", SCHEMA) if mode == "schema" else None
        params = [SamplingParams(max_new_tokens=args.new_tokens, temperature=0.7, seed=i, structured=structured)
                  for i in range(len(ids))]
        if mode == "matched":         # unconstrained, each request as long as its constrained answer
            params = [SamplingParams(max_new_tokens=n, temperature=0.7, seed=i, ignore_eos=True)
                      for i, n in enumerate(lengths + [args.new_tokens] * warm)]
        # warm-up on other requests: kernels, graphs, the schema's automaton and its first masks
        llm.generate(ids[-warm:], params[-warm:])
        llm.reset_prefix_cache()                  # the timed prompts are computed in every run
        s = llm.runner.structured
        before = (s.mask_seconds, s.masks_built, s.masks_reused)
        backend.synchronize()
        t = time.perf_counter()
        outs = llm.generate(ids[:-warm], params[:-warm])
        backend.synchronize()
        sec = time.perf_counter() - t
        tokens = sum(len(o.token_ids) for o in outs)
        if mode == "schema":
            lengths = [len(o.token_ids) for o in outs]
        parsed = []
        for o in outs:
            try:
                parsed.append(json.loads(o.text))
            except ValueError:
                parsed.append(None)
        emit({**setup, "scenario": "structured", "mode": mode, "requests": len(outs), "output_tokens": tokens,
              "seconds": round(sec, 2), "output_tok_per_s": round(tokens / sec, 1), "steps": len(llm.last_step_log),
              "stopped": sum(o.finish_reason == "stop" for o in outs),
              "parse": sum(p is not None for p in parsed), "conform": sum(conforms(p) for p in parsed),
              "mask_ms_per_step": round(1000 * (s.mask_seconds - before[0]) / max(1, len(llm.last_step_log)), 3),
              "masks_built": s.masks_built - before[1], "masks_reused": s.masks_reused - before[2],
              "async_scheduling": llm.async_scheduling})
    for llm in engines.values():
        llm.close()
