"""The chapter 08 and 12 checkers accept a correct solution, reject the usual mistakes with the right
hint, and report an unattempted exercise as such. The solutions here are written the way a learner
would write them, not imported from the engine's references."""
from __future__ import annotations

import math

import numpy as np
from helpers.exercises import accepts, not_attempted, rejects, verdict  # noqa: E402

from engine.exercises import ch08, ch12
from engine.model.forward_pass import ForwardBatch
from engine.model.kv_cache import KVCache

# ----------------------------------------------------------------------------- chapter 08 solutions

def kv_append(k_cache, v_cache, k, v, start):
    for i in range(len(k)):
        k_cache[start + i] = k[i]
        v_cache[start + i] = v[i]


def greedy_decode(model, prompt_ids, n_new, shift=0, extra_step=False):
    ctx = model.max_context
    cache = KVCache.contiguous(model.config, 1, ctx)
    logits = model.forward(ForwardBatch.single(prompt_ids, 0, page_table=[0], page_size=ctx,
                                               logits_rows=[len(prompt_ids) - 1]), cache)
    out = []
    while len(out) < n_new:
        out.append(int(logits[-1].argmax()))
        if len(out) < n_new or extra_step:
            pos = len(prompt_ids) + len(out) - 1 + shift
            logits = model.forward(ForwardBatch.single([out[-1]], pos, page_table=[0], page_size=ctx), cache)
    return out


def top_p_keep(probs, top_p):
    order = np.argsort(-probs)
    cum = np.cumsum(probs[order])
    n_keep = int(np.argmax(cum >= top_p - 1e-12)) + 1 if cum[-1] >= top_p - 1e-12 else len(probs)
    threshold = probs[order[n_keep - 1]]
    return probs >= threshold


def inverse_cdf(probs, u):
    target, running = u * sum(probs), 0.0
    for i, p in enumerate(probs):
        running += p
        if running > target:
            return i
    return len(probs) - 1


def kv_cache_bytes(config, num_seqs, max_context, bytes_per_value):
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * bytes_per_value
    return num_seqs * max_context * per_token


def test_ch08_kv_append(capsys):
    accepts(ch08.check_kv_append, kv_append, capsys)
    rejects(ch08.check_kv_append, lambda kc, vc, k, v, s: kv_append(kc, vc, k, v, s + 1), capsys, "start + 1")
    rejects(ch08.check_kv_append, lambda kc, vc, k, v, s: kv_append(kc, vc, v, k, s), capsys, "swapped")

    def rebinds(kc, vc, k, v, s):
        kc = np.concatenate([kc[:s], k, kc[s + len(k):]])   # a new array: the caller's cache is untouched
        vc = np.concatenate([vc[:s], v, vc[s + len(v):]])
    rejects(ch08.check_kv_append, rebinds, capsys, "in place")


def test_ch08_decode_loop(capsys):
    accepts(ch08.check_decode_loop, greedy_decode, capsys)
    rejects(ch08.check_decode_loop, lambda m, p, n: greedy_decode(m, p, n, shift=-1), capsys, "position")
    rejects(ch08.check_decode_loop, lambda m, p, n: greedy_decode(m, p, n, shift=+1), capsys, "position")
    rejects(ch08.check_decode_loop, lambda m, p, n: greedy_decode(m, p, n, extra_step=True), capsys, "never fed")
    rejects(ch08.check_decode_loop, ch08.greedy_by_recomputation, capsys, "without a cache")
    rejects(ch08.check_decode_loop, lambda m, p, n: greedy_decode(m, p, n)[:-1], capsys, "tokens, expected")

    def always_position_zero(model, prompt_ids, n_new):
        # every step alone at position 0 with the cache: it attends to nothing but itself
        ctx = model.max_context
        cache = KVCache.contiguous(model.config, 1, ctx)
        out = []
        ids = list(prompt_ids)
        logits = model.forward(ForwardBatch.single(ids, 0, page_table=[0], page_size=ctx, logits_rows=[len(ids) - 1]), cache)
        for i in range(n_new):
            out.append(int(logits[-1].argmax()))
            if i + 1 < n_new:
                logits = model.forward(ForwardBatch.single([out[-1]], 0, page_table=[0], page_size=ctx), cache)
        return out
    rejects(ch08.check_decode_loop, always_position_zero, capsys)


def test_ch08_sampling(capsys):
    accepts(ch08.check_top_p_keep, top_p_keep, capsys)
    rejects(ch08.check_top_p_keep, ch08._top_p_exclusive, capsys, "crosses top_p")
    rejects(ch08.check_top_p_keep, lambda p, tp: p >= tp, capsys, "cumulative")

    def ascending(probs, top_p):
        order = np.argsort(probs)
        n_keep = int(np.argmax(np.cumsum(probs[order]) >= top_p)) + 1
        keep = np.zeros(len(probs), dtype=bool)
        keep[order[:n_keep]] = True
        return keep
    rejects(ch08.check_top_p_keep, ascending, capsys, "most likely down")
    accepts(ch08.check_inverse_cdf, inverse_cdf, capsys)
    rejects(ch08.check_inverse_cdf, lambda p, u: int(np.searchsorted(np.cumsum(p), u * np.sum(p))), capsys)
    rejects(ch08.check_inverse_cdf, lambda p, u: int(np.argmax(p)), capsys)


def test_ch08_kv_cache_bytes(capsys):
    accepts(ch08.check_kv_cache_bytes, kv_cache_bytes, capsys)
    rejects(ch08.check_kv_cache_bytes, lambda c, s, n, b: kv_cache_bytes(c, s, n, b) // 2, capsys, "factor 2")
    rejects(ch08.check_kv_cache_bytes,
            lambda c, s, n, b: 2 * s * n * c.num_hidden_layers * c.num_attention_heads * c.head_dim * b, capsys, "query heads")
    rejects(ch08.check_kv_cache_bytes, lambda c, s, n, b: 2 * s * n * c.num_key_value_heads * c.head_dim * b,
            capsys, "one layer")


# ----------------------------------------------------------------------------- chapter 12 solutions

def decode_floor(config, batch, context_len, bandwidth_gbps, bytes_per_value):
    weight_bytes = config.num_parameters() * bytes_per_value
    kv_bytes = batch * context_len * config.kv_bytes_per_token(bytes_per_value)
    steps_per_s = bandwidth_gbps * 1e9 / (weight_bytes + kv_bytes)
    return batch * steps_per_s


def contiguous_slots(config, pool_bytes, max_context, bytes_per_value):
    return int(pool_bytes // (max_context * config.kv_bytes_per_token(bytes_per_value)))


def paged_fit(config, pool_bytes, seq_lens, page_size, bytes_per_value):
    free_pages = pool_bytes // (page_size * config.kv_bytes_per_token(bytes_per_value))
    for i, n in enumerate(seq_lens):
        free_pages -= math.ceil(n / page_size)
        if free_pages < 0:
            return i
    return len(seq_lens)


def step_log_summary(step_log):
    decode = [s["rows"] for s in step_log if s["kind"] == "decode"]
    prefill = len(step_log) - len(decode)
    return prefill, len(decode), sum(decode) / len(decode) if decode else 0.0


def test_ch12_decode_floor(capsys):
    accepts(ch12.check_decode_floor, decode_floor, capsys)
    rejects(ch12.check_decode_floor, lambda c, b, n, bw, bpv: decode_floor(c, b, n, bw, bpv) / b, capsys, "batch")
    rejects(ch12.check_decode_floor, lambda c, b, n, bw, bpv: b * bw * 1e9 / (c.num_parameters() * bpv),
            capsys, "K/V reads are missing")
    # the floor the H200 figures quote: Llama-3.2-1B, batch 1, ~256 cached tokens, 4200 GB/s
    assert 1650 < decode_floor(ch08.preset_config("llama-3.2-1b"), 1, 256, 4200.0, 2) < 1720


def test_ch12_pools(capsys):
    accepts(ch12.check_contiguous_slots, contiguous_slots, capsys)
    rejects(ch12.check_contiguous_slots, lambda c, p, n, b: math.ceil(p / (n * c.kv_bytes_per_token(b))), capsys, "round down")
    # the figure of the H200 serving run: 127 slots of 2,056 tokens in 8 GiB
    assert contiguous_slots(ch08.preset_config("llama-3.2-1b"), 8 * 2**30, 2056, 2) == 127
    accepts(ch12.check_paged_fit, paged_fit, capsys)
    rejects(ch12.check_paged_fit,
            lambda c, p, lens, ps, b: int(np.searchsorted(np.cumsum(lens), p // c.kv_bytes_per_token(b), side="right")),
            capsys, "whole pages")


def test_ch12_step_log_summary(capsys):
    accepts(ch12.check_step_log_summary, step_log_summary, capsys)

    def mean_of_all_steps(log):
        rows = [s["rows"] for s in log]
        return step_log_summary(log)[:2] + ((sum(rows) / len(rows)) if rows else 0.0,)
    rejects(ch12.check_step_log_summary, mean_of_all_steps, capsys, "only decode steps")
    rejects(ch12.check_step_log_summary, lambda log: (len(log), 0, 0.0), capsys)


def test_unattempted_exercises_are_reported(capsys):
    for checker in (ch08.check_kv_append, ch08.check_decode_loop, ch08.check_top_p_keep, ch08.check_inverse_cdf,
                    ch08.check_kv_cache_bytes, ch12.check_decode_floor, ch12.check_contiguous_slots,
                    ch12.check_paged_fit, ch12.check_step_log_summary):
        assert checker(not_attempted) is False
        assert verdict(capsys).startswith("[ ]"), checker.__name__
