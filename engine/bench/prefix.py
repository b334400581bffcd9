"""Prefix caching under load (chapter 15), each with the cache off as the peer in the same run.

  shared-prefix  --requests requests (256) that share one --system-len-token system prompt (2,000),
                 each with its own question of --question-len tokens (50..200) and --shared-new-tokens
                 new tokens (128): output tok/s, prompt tokens computed, time to first token
  chat-turns     one conversation of --turns turns (10): each turn sends the whole conversation so
                 far plus a new question; time to first token per turn

Both start from a cache emptied after the warm-up (LLM.reset_prefix_cache), so the figures show what
the workload itself shares, not what the warm-up left behind.
"""
from __future__ import annotations

import time

import numpy as np

from engine.bench.workload import emit, random_prompt


def _llm(model_dir, backend, caching: bool, args, max_context: int):
    from engine.runtime.llm import LLM
    return LLM(model_dir, backend, kv_cache_mib=args.kv_cache_mib, max_context=max_context,
               max_seqs=args.max_seqs, cuda_graphs=not args.no_graphs, prefix_caching=caching)


def _warm_up(llm, vocab: int, lengths: list[int]) -> None:
    """Compile and capture on prompts the timed run never sends, then empty the cache."""
    from engine.runtime.sampling_params import SamplingParams
    rng = np.random.default_rng(12345)
    llm.generate([random_prompt(rng, n, vocab) for n in lengths],
                 [SamplingParams(max_new_tokens=2 + i % 40, ignore_eos=True) for i in range(len(lengths))])
    llm.reset_prefix_cache()


def scenario_shared_prefix(args, setup, model_dir, backend, vocab: int) -> None:
    from engine.runtime.sampling_params import SamplingParams
    rng = np.random.default_rng(args.seed)
    system = random_prompt(rng, args.system_len, vocab)
    low, high = args.question_len
    prompts = [system + random_prompt(rng, int(rng.integers(low, high + 1)), vocab) for _ in range(args.requests)]
    params = SamplingParams(max_new_tokens=args.shared_new_tokens, ignore_eos=True)
    base = {**setup, "scenario": "shared-prefix", "requests": args.requests, "system_len": args.system_len,
            "question_len": [low, high], "new_tokens": args.shared_new_tokens,
            "prompt_tokens": sum(len(p) for p in prompts), "output_tokens": args.requests * args.shared_new_tokens}
    results = {}
    for caching in (False, True):
        llm = _llm(model_dir, backend, caching, args, args.system_len + high + args.shared_new_tokens + 8)
        _warm_up(llm, vocab, [args.system_len + high] * 2 + [16] * max(1, llm.max_seqs - 2))
        backend.synchronize()
        t = time.perf_counter()
        outs = llm.generate(prompts, params)
        backend.synchronize()
        sec = time.perf_counter() - t
        log = llm.last_step_log
        # time to first token from the step log: the end of the step that sampled a request's first token
        ends = np.cumsum([entry["seconds"] for entry in log])
        first: dict[int, float] = {}
        last_first = 0                      # the step in which the last request got its first token
        for i, (end, entry) in enumerate(zip(ends, log, strict=True)):
            for rid in entry["sampled_ids"]:
                if rid not in first:
                    first[rid], last_first = float(end), i
        ttft = sorted(first.values())
        decode = [entry["seconds"] for entry in log[last_first + 1:]]
        stats = llm.stats()["prefix_cache"]
        results[caching] = [o.token_ids for o in outs]
        computed = sum(entry["prefill_tokens"] for entry in log)
        emit({**base, "prefix_caching": caching, "seconds": round(sec, 3),
              "output_tok_per_s": round(base["output_tokens"] / sec, 1),
              "prompt_tokens_computed": computed, "hit_tokens": stats["hit_tokens"],
              "hit_rate": round(stats["hit_rate"], 4),
              "ttft_p50_ms": round(1e3 * ttft[len(ttft) // 2], 1),
              "ttft_p99_ms": round(1e3 * ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))], 1),
              "steps": len(log), "prefill_phase_steps": last_first + 1,
              "prefill_phase_s": round(float(ends[last_first]), 3),
              "decode_step_ms": round(1e3 * float(np.mean(decode)), 2) if decode else None,
              "max_seqs": llm.max_seqs, "kv_cache_mib": round(llm.cache.nbytes / 2**20, 1)})
        llm.close()
        del llm
        if backend.is_gpu:
            backend.xp.get_default_memory_pool().free_all_blocks()
    emit({**base, "scenario": "shared-prefix-check", "same_tokens": results[True] == results[False]})


def scenario_chat_turns(args, setup, model_dir, backend, vocab: int) -> None:
    from engine.runtime.sampling_params import SamplingParams
    rng = np.random.default_rng(args.seed)
    system = random_prompt(rng, args.chat_system_len, vocab)
    questions = [random_prompt(rng, args.chat_question_len, vocab) for _ in range(args.turns)]
    params = SamplingParams(max_new_tokens=args.chat_answer_len, ignore_eos=True)
    longest = args.chat_system_len + args.turns * (args.chat_question_len + args.chat_answer_len) + 8
    for caching in (False, True):
        llm = _llm(model_dir, backend, caching, args, longest)
        _warm_up(llm, vocab, [longest - args.chat_answer_len, 16])
        history, turns = list(system), []
        for turn, question in enumerate(questions, 1):
            prompt = history + question
            handle = llm.submit(prompt, params)
            out = handle.result()
            turns.append({"turn": turn, "prompt_len": len(prompt), "reused_tokens": handle.reused_tokens,
                          "ttft_ms": round(1e3 * (handle.first_token_at - handle.submitted_at), 2)})
            history = prompt + out.token_ids
        emit({**setup, "scenario": "chat-turns", "prefix_caching": caching, "system_len": args.chat_system_len,
              "question_len": args.chat_question_len, "answer_len": args.chat_answer_len, "turns": turns})
        llm.close()
        del llm
        if backend.is_gpu:
            backend.xp.get_default_memory_pool().free_all_blocks()


def add_arguments(ap) -> None:
    ap.add_argument("--system-len", type=int, default=2000, help="shared-prefix: the system prompt's tokens")
    ap.add_argument("--question-len", type=int, nargs=2, default=[50, 200], metavar=("MIN", "MAX"),
                    help="shared-prefix: each request's own question")
    ap.add_argument("--shared-new-tokens", type=int, default=128, help="shared-prefix: tokens generated")
    ap.add_argument("--turns", type=int, default=10, help="chat-turns: turns of the conversation")
    ap.add_argument("--chat-system-len", type=int, default=500)
    ap.add_argument("--chat-question-len", type=int, default=200)
    ap.add_argument("--chat-answer-len", type=int, default=200)
