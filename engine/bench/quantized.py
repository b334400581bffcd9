"""`python -m engine.bench --scenario quantized`: the model in bf16 and quantized on load, in the same run.

For the checkpoint's own weights and each of --quantization (int8, int4; weight-only, group-wise with
--group-size inputs per scale, chapter 18), one record: batch-1 decode tok/s through LLM (graphs and
async scheduling as served), the bytes one decode step reads (weights + the K/V at mid-answer) and the
floor they set at the measured copy bandwidth, the prefill of --prefill-len tokens (one forward pass,
last logits only), and the speedup over the checkpoint's weights measured in the same run. Random
weights show speed only; quality (perplexity, greedy agreement) needs real weights: chapter 18.
"""
from __future__ import annotations

import numpy as np

from engine.bench.workload import emit, forward_seconds, llm_decode_tok_per_s, random_prompt


def weight_bytes(model) -> int:
    """Bytes a decode step reads of the model's weights: every projection (packed, with its scales and
    zero points when quantized) and the lm_head; the embedding reads one row per token."""
    total = int(model.weights.lm_head.nbytes)
    for lw in model.weights.layers:
        total += sum(int(w.nbytes) for w in (lw.qkv, lw.o, lw.gate_up, lw.down))
    return total


def scenario_quantized(args, setup, model_dir, backend, ceiling_gbps: float) -> None:
    from engine.model.forward_pass import ForwardBatch
    from engine.runtime.llm import LLM
    base = None
    for quantization in [None, *args.quantization]:
        llm = LLM(model_dir, backend, max_seqs=1, max_context=max(args.prefill_len, args.prompt_len + args.new_tokens) + 8,
                  quantization=quantization, group_size=args.group_size)
        cfg, model = llm.config, llm.model
        rng = np.random.default_rng(3)
        tok_s = llm_decode_tok_per_s(llm, random_prompt(rng, args.prompt_len, cfg.vocab_size), args.new_tokens)
        read = weight_bytes(model)
        step_bytes = read + (args.prompt_len + args.new_tokens / 2) * cfg.kv_bytes_per_token(2)
        prompt = ForwardBatch.single(random_prompt(rng, args.prefill_len, cfg.vocab_size),
                                     logits_rows=[args.prefill_len - 1])
        prefill_ms = forward_seconds(model, prompt) * 1e3
        rec = {**setup, "scenario": "quantized", "quantization": quantization or "none",
               "group_size": model.weights.layers[0].down.group_size if quantization else None,
               "decode_tok_per_s": round(tok_s, 1),
               "weight_bytes": read, "weight_gb": round(read / 1e9, 3), "step_gb": round(step_bytes / 1e9, 3),
               "floor_tok_per_s": round(ceiling_gbps * 1e9 / step_bytes, 1),
               "of_floor": round(tok_s * step_bytes / (ceiling_gbps * 1e9), 3),
               "prefill_len": args.prefill_len, "prefill_ms": round(prefill_ms, 2)}
        if base is None:
            base = rec
        else:
            rec["decode_speedup"] = round(tok_s / base["decode_tok_per_s"], 2)
            rec["prefill_ratio"] = round(prefill_ms / base["prefill_ms"], 2)
        emit(rec)
        llm.close()
