"""`python -m engine.bench --scenario spec-decode`: batch-1 decode with and without speculation.

One request at a time (max_seqs=1), greedy, the same prompt for every mode, in the same run:
plain decoding, then n-gram speculation with each of --spec-k guesses per verify row, and with
--spec-draft DIR a draft model's guesses ("draft:k" records; engine/runtime/draft_model.py). Two prompts:

  repeat   an answer that quotes its input: with a tokenizer, a paragraph with misspelt words and
           "correct the spelling" in the model's chat template, answered until the model ends it (the
           answer repeats the paragraph); without one, a random motif repeated
  plain    --prompt-len random token ids (nothing to look up, beyond what the model repeats itself)

The record gives decode tok/s (generated tokens after the first, over the seconds of the steps
that produced them, from the step log), the speedup over plain decoding in the same run, the
acceptance rate, the mean tokens per verify row, and how many leading tokens equal plain decoding's
(on the GPU a verify row's positions run in a wider decode bucket, which may flip a bf16 near-tie).
A random-weight model cannot follow "rewrite": its greedy output falls into loops of its own, which
the lookup finds just as well; the default model (real weights) shows the case the scenario is for.
"""
from __future__ import annotations

import numpy as np

from engine.bench.workload import emit, random_prompt
from engine.runtime.scheduler import common_prefix

TEXT = ("The quick brown fox jumps over the lazy dog. Teh dog did not move, because it was sleeping in the warm "
        "sun. Later that day, the fox came back and jumped agian, and this time the dog woke up and barked loudly. "
        "The farmer heard the noise and walked out of the house to see what was hapening. He saw the fox running "
        "across the feild and the dog chasing it, and he laughed, because the dog had never caught anything in its life.")
REQUEST = "Correct the spelling mistakes in this text. Reply with the corrected text only.\n\n"


def repeat_prompt(llm, vocab_size: int) -> tuple[list[int], bool]:
    """(prompt, stops at eos): the editing prompt through the chat template, answered until the model
    ends it; or (no tokenizer) a random motif repeated, run for --new-tokens."""
    tok = llm.tokenizer
    if tok is not None and tok.chat_template:
        return tok.encode(tok.apply_chat_template([{"role": "user", "content": REQUEST + TEXT}],
                                                  add_generation_prompt=True)), True
    motif = random_prompt(np.random.default_rng(5), 48, vocab_size)
    return (motif * 6)[:min(256, llm.max_context // 2)], False


def decode_rate(log) -> tuple[float, int]:
    """(tok/s after the first token, tokens): the steps after the one that sampled the first token."""
    first = next(i for i, e in enumerate(log) if e["sampled_tokens"])
    later = log[first + 1:]
    tokens = sum(len(e["sampled_tokens"]) for e in later)
    seconds = sum(e["seconds"] for e in later)
    return (tokens / seconds if seconds else 0.0), tokens


def scenario_spec_decode(args, setup, model_dir, backend) -> None:
    from engine.formats.config import load_config
    from engine.runtime.llm import LLM
    from engine.runtime.sampling_params import SamplingParams
    max_context = args.max_context or min(4096, load_config(model_dir).max_position_embeddings)
    modes = [None] + [{"method": "ngram", "num_tokens": k} for k in args.spec_k]
    if args.spec_draft:
        modes += [{"method": "draft", "model": args.spec_draft, "num_tokens": k} for k in args.spec_k]
    baseline: dict[str, tuple[float, list[int]]] = {}
    for spec in modes:
        llm = LLM(model_dir, backend, max_seqs=1, max_context=max_context, speculative=spec)
        prompts = {"repeat": repeat_prompt(llm, llm.config.vocab_size),
                   "plain": (random_prompt(np.random.default_rng(2), args.prompt_len, llm.config.vocab_size), False)}
        llm.generate([prompts["plain"][0][:16]], SamplingParams(max_new_tokens=16, ignore_eos=True))   # warm-up
        for name, (ids, stops) in prompts.items():
            params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=not stops)
            before = llm.stats()["speculative"]
            llm.generate([ids], SamplingParams(max_new_tokens=8, ignore_eos=True))   # this prompt's shapes, untimed
            out = llm.generate([ids], params)[0]
            rate, tokens = decode_rate(llm.last_step_log)
            after = llm.stats()["speculative"]
            drafted = after["draft_tokens"] - before["draft_tokens"]
            accepted = after["accepted_tokens"] - before["accepted_tokens"]
            rows = after["verify_rows"] - before["verify_rows"]
            label = "off" if spec is None else f"{spec['method']}:{spec['num_tokens']}"
            rec = {**setup, "scenario": "spec-decode", "prompt": name, "prompt_len": len(ids),
                   "new_tokens": len(out.token_ids), "speculative": label,
                   "decode_tok_per_s": round(rate, 1), "steps": len(llm.last_step_log),
                   "async_scheduling": llm.async_scheduling}
            if spec is None:
                baseline[name] = (rate, out.token_ids)
            else:
                rec.update({"speedup": round(rate / baseline[name][0], 3),
                            "acceptance_rate": round(accepted / drafted, 3) if drafted else 0.0,
                            "mean_tokens_per_verify_row": round((accepted + rows) / rows, 3) if rows else 0.0,
                            "verify_rows": rows, "same_tokens_as_plain": out.token_ids == baseline[name][1],
                            "same_leading_tokens": common_prefix(out.token_ids, baseline[name][1])})
            emit(rec)
        llm.close()
        del llm
        if backend.is_gpu:
            backend.xp.get_default_memory_pool().free_all_blocks()
