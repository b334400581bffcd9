"""`python -m engine.bench --scenario spec-decode`: batch-1 decode with and without speculation.

One request at a time (max_seqs=1), greedy, the same prompt for every mode, in the same run:
plain decoding, then n-gram speculation with each of --spec-k guesses per verify row. Two prompts:

  repeat   an answer that quotes its input: with a tokenizer, a code snippet and "rewrite it with one
           name changed" in the model's chat template; the output repeats most of the prompt
  plain    --prompt-len random token ids (nothing to look up, beyond what the model repeats itself)

The record gives decode tok/s (generated tokens after the first, over the seconds of the steps
that produced them, from the step log), the speedup over plain decoding in the same run, the
acceptance rate, the mean tokens per verify row, and whether the tokens equal plain decoding's.
A random-weight model cannot follow "rewrite": its greedy output falls into loops of its own, which
the lookup finds just as well; the default model (real weights) shows the case the scenario is for.
"""
from __future__ import annotations

import numpy as np

from engine.bench.workload import emit, random_prompt

SNIPPET = '''def moving_average(values, window):
    """The mean of each run of `window` consecutive values."""
    if window <= 0:
        raise ValueError("window must be positive")
    sums, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            sums.append(total / window)
    return sums
'''
REQUEST = "Rewrite this Python function with the parameter `values` renamed to `series`. Reply with the code only.\n\n"


def repeat_prompt(llm, vocab_size: int) -> list[int]:
    """The code-editing prompt through the chat template, or (no tokenizer) a random prompt repeated."""
    tok = llm.tokenizer
    if tok is not None and tok.chat_template:
        return tok.encode(tok.apply_chat_template([{"role": "user", "content": REQUEST + SNIPPET}],
                                                  add_generation_prompt=True))
    motif = random_prompt(np.random.default_rng(5), 48, vocab_size)
    return (motif * 6)[:256]


def decode_rate(log) -> tuple[float, int]:
    """(tok/s after the first token, tokens): the steps after the one that sampled the first token."""
    first = next(i for i, e in enumerate(log) if e["sampled_tokens"])
    later = log[first + 1:]
    tokens = sum(len(e["sampled_tokens"]) for e in later)
    seconds = sum(e["seconds"] for e in later)
    return (tokens / seconds if seconds else 0.0), tokens


def scenario_spec_decode(args, setup, model_dir, backend) -> None:
    from engine.runtime.llm import LLM
    from engine.runtime.sampling_params import SamplingParams
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    modes = [None] + [{"method": "ngram", "num_tokens": k} for k in args.spec_k]
    baseline: dict[str, tuple[float, list[int]]] = {}
    for spec in modes:
        llm = LLM(model_dir, backend, max_seqs=1, max_context=args.max_context or 4096, speculative=spec)
        prompts = {"repeat": repeat_prompt(llm, llm.config.vocab_size),
                   "plain": random_prompt(np.random.default_rng(2), args.prompt_len, llm.config.vocab_size)}
        llm.generate([prompts["plain"][:16]], SamplingParams(max_new_tokens=16, ignore_eos=True))   # warm-up
        for name, ids in prompts.items():
            before = llm.stats()["speculative"]
            llm.generate([ids], SamplingParams(max_new_tokens=8, ignore_eos=True))   # this prompt's shapes, untimed
            out = llm.generate([ids], params)[0]
            rate, tokens = decode_rate(llm.last_step_log)
            after = llm.stats()["speculative"]
            drafted = after["draft_tokens"] - before["draft_tokens"]
            accepted = after["accepted_tokens"] - before["accepted_tokens"]
            rows = after["verify_rows"] - before["verify_rows"]
            rec = {**setup, "scenario": "spec-decode", "prompt": name, "prompt_len": len(ids),
                   "new_tokens": args.new_tokens, "speculative": "off" if spec is None else f"ngram:{spec['num_tokens']}",
                   "decode_tok_per_s": round(rate, 1), "steps": len(llm.last_step_log),
                   "async_scheduling": llm.async_scheduling}
            if spec is None:
                baseline[name] = (rate, out.token_ids)
            else:
                rec.update({"speedup": round(rate / baseline[name][0], 3),
                            "acceptance_rate": round(accepted / drafted, 3) if drafted else 0.0,
                            "mean_tokens_per_verify_row": round((accepted + rows) / rows, 3) if rows else 0.0,
                            "verify_rows": rows, "same_tokens_as_plain": out.token_ids == baseline[name][1]})
            emit(rec)
        llm.close()
        del llm
        if backend.is_gpu:
            backend.xp.get_default_memory_pool().free_all_blocks()
