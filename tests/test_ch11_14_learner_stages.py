"""The learner-built stages of chapters 11, 13 and 14: paged attention in NumPy, FlashAttention's
key-tiled loop and the add+RMSNorm fusion. Each checker accepts a solution written the way a learner
would, names the classic mistakes, gives one verdict, and the model answers through the learner's code."""
from __future__ import annotations

import numpy as np
import pytest
from helpers.exercises import accepts, not_attempted, rejects, verdict

from engine.exercises import ch11, ch13, ch14
from engine.ops.attention import causal_attention_ref

# ----------------------------------------------------------------------------- chapter 11


def paged_attention(q, k_cache, v_cache, page_tables, seq_idx, positions, scale, *, swap=False, past_end=False,
                    modulo_heads=False, exclusive=False):
    """A learner's paged attention; each keyword makes one classic mistake."""
    R, Hq, D = q.shape
    page_size, Hkv = k_cache.shape[1], k_cache.shape[2]
    out = np.empty((R, Hq, D), dtype=np.float32)
    for r in range(R):
        n = int(positions[r]) + (0 if exclusive else 1)
        if past_end:
            n = -(-n // page_size) * page_size
        j = np.arange(n)
        table = page_tables[seq_idx[r]]
        pages, offsets = (table[j % page_size], j // page_size) if swap else (table[j // page_size], j % page_size)
        keys, values = k_cache[pages, offsets], v_cache[pages, offsets]
        for h in range(Hq):
            g = h % Hkv if modulo_heads else h // (Hq // Hkv)
            s = keys[:, g] @ q[r, h] * np.float32(scale)
            p = np.exp(s - s.max())
            out[r, h] = p @ values[:, g] / p.sum()
    return out


def _mistake(**kw):
    return lambda *a: paged_attention(*a, **kw)


def test_paged_attention_checker(capsys):
    accepts(ch11.check_paged_attention, paged_attention, capsys)
    rejects(ch11.check_paged_attention, _mistake(swap=True), capsys, "page index and the token offset were swapped")
    rejects(ch11.check_paged_attention, _mistake(past_end=True), capsys, "read past its sequence's length")
    rejects(ch11.check_paged_attention, _mistake(modulo_heads=True), capsys, "h % n_kv")
    rejects(ch11.check_paged_attention, _mistake(exclusive=True), capsys, "own position was left out")
    ch11.check_paged_attention(not_attempted)
    assert verdict(capsys).startswith("[ ]")


def test_paged_attention_cases_are_the_engines():
    from engine.ops.paged_attention import paged_attention_ref
    for args, want in ch11._paged_cases():
        np.testing.assert_allclose(paged_attention_ref(*args), want, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_paged_attention_inside_llm(capsys):
    assert ch11.check_paged_attention_in_llm(paged_attention, max_new_tokens=6)
    out = capsys.readouterr().out
    assert "[OK] your paged_attention inside engine.LLM" in out and "Paris" in out
    assert not ch11.check_paged_attention_in_llm(_mistake(modulo_heads=True), max_new_tokens=6)
    assert "first differs" in capsys.readouterr().out
    assert not ch11.check_paged_attention_in_llm(not_attempted)
    assert verdict(capsys).startswith("[ ]")

# ----------------------------------------------------------------------------- chapter 13


def flash_attention(q, k, v, scale, block_q, block_k, *, rescale=True, guard=True, reverse=False):
    """A learner's key-tiled loop (per GQA group); rescale=False (acc not rescaled) and guard=False are
    classic mistakes, reverse walks
    the key tiles from the diagonal back to key 0 (legal with the -inf guard, NaN without it)."""
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    r = Hq // Hkv
    out = np.empty((T, Hq, D), dtype=np.float32)
    for g in range(Hkv):
        for q0 in range(0, T, block_q):
            q1 = min(q0 + block_q, T)
            qg = (q[q0:q1, g * r:(g + 1) * r] * np.float32(scale)).reshape((q1 - q0) * r, D)
            row_pos = np.repeat(np.arange(q0, q1), r)
            m = np.full(len(qg), -np.inf, np.float32)
            l = np.zeros(len(qg), np.float32)
            acc = np.zeros((len(qg), D), np.float32)
            starts = list(range(0, q1, block_k))
            for k0 in reversed(starts) if reverse else starts:
                k1 = min(k0 + block_k, q1)
                s = qg @ k[k0:k1, g].T
                s[np.arange(k0, k1)[None, :] > row_pos[:, None]] = -np.inf
                m_new = np.maximum(m, s.max(axis=1))
                ref = np.where(np.isneginf(m_new), 0, m_new) if guard else m_new
                with np.errstate(invalid="ignore"):
                    alpha = np.exp(m - ref)
                    p = np.exp(s - ref[:, None])
                l = alpha * l + p.sum(axis=1)
                acc = (alpha[:, None] * acc if rescale else acc) + p @ v[k0:k1, g]
                m = m_new
            out[q0:q1, g * r:(g + 1) * r] = (acc / l[:, None]).reshape(q1 - q0, r, D)
    return out


def strip_attention(q, k, v, scale, block_q, block_k):
    """Right answer, but query tiles against every key: a [block_q, T] strip of scores."""
    T = q.shape[0]
    out = np.empty_like(q)
    for a in range(0, T, block_q):
        b = min(a + block_q, T)
        pad = np.zeros((a,) + q.shape[1:], np.float32)
        out[a:b] = causal_attention_ref(np.concatenate([pad, q[a:b]]), k[:b], v[:b], scale)[a:]
    return out


def test_flash_attention_checker(capsys):
    accepts(ch13.check_flash_attention, flash_attention, capsys)
    accepts(ch13.check_flash_attention, lambda *a: flash_attention(*a, reverse=True), capsys)   # guarded
    rejects(ch13.check_flash_attention, lambda *a: flash_attention(*a, rescale=False), capsys,
            "acc was not rescaled")
    rejects(ch13.check_flash_attention, lambda *a: flash_attention(*a, reverse=True, guard=False), capsys,
            "the -inf guard")
    ch13.check_flash_attention(strip_attention)
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("[x]") and "strip of scores" in lines[0], lines
    rejects(ch13.check_flash_attention, lambda q, k, v, s, bq, bk: ch13._flash_variant(q, k, v, s, bq, bk, mask="none"),
            capsys, "diagonal tile was not masked")
    ch13.check_flash_attention(not_attempted)
    assert verdict(capsys).startswith("[ ]")


def test_masked_diagonal_is_named(capsys):
    def strict(q, k, v, scale, bq, bk):            # key < query: row 0 sees nothing
        T, Hq, _ = q.shape
        r = Hq // k.shape[1]
        s = np.einsum("thd,shd->hts", q, np.repeat(k, r, axis=1)) * scale
        s = np.where(np.arange(T)[None, :] < np.arange(T)[:, None], s, -np.inf)
        with np.errstate(invalid="ignore"):
            p = np.exp(s - s.max(-1, keepdims=True))
            return np.einsum("hts,shd->thd", p / p.sum(-1, keepdims=True), np.repeat(v, r, axis=1))
    rejects(ch13.check_flash_attention, strict, capsys, "the diagonal was masked too")
    rejects(ch13.check_blockwise_attention, lambda q, k, v, s, t: strict(q, k, v, s, t, t), capsys,
            "the diagonal was masked too")


@pytest.mark.slow
def test_smollm2_answers_through_the_learners_tiles(capsys):
    assert ch13.answer_through_flash_attention(flash_attention, max_new_tokens=6)
    assert "[OK] your flash_attention inside SmolLM2" in capsys.readouterr().out
    def modulo_heads(q, k, v, s, bq, bk):          # query head h reads KV head h % Hkv
        return ch13._flash_variant(q, k, v, s, bq, bk, head_of=lambda h: h % k.shape[1])
    assert not ch13.answer_through_flash_attention(modulo_heads, max_new_tokens=6)
    assert "differs from the engine's" in capsys.readouterr().out

# ----------------------------------------------------------------------------- chapter 14


def fused_add_rmsnorm(residual, delta, w, eps):
    np.add(residual, delta, out=residual)
    inv = (1.0 / np.sqrt(np.einsum("th,th->t", residual, residual) / residual.shape[1] + eps)).astype(np.float32)
    out = np.multiply(residual, w)
    out *= inv[:, None]
    return out


def test_fused_add_rmsnorm_checker(capsys):
    from engine.ops.rmsnorm import rmsnorm_ref
    accepts(ch14.check_fused_add_rmsnorm, fused_add_rmsnorm, capsys)
    rejects(ch14.check_fused_add_rmsnorm, lambda r, d, w, eps: rmsnorm_ref(r, w, eps), capsys,
            "the norm was taken before the add")

    def not_in_place(r, d, w, eps):
        return fused_add_rmsnorm(r.copy(), d, w, eps)
    rejects(ch14.check_fused_add_rmsnorm, not_in_place, capsys, "did not update the residual in place")
    ch14.check_fused_add_rmsnorm(ch14.unfused_add_rmsnorm)      # right, but temporaries: one [x] line
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("[x]") and "temporary" in lines[0], lines
    ch14.check_fused_add_rmsnorm(not_attempted)
    assert verdict(capsys).startswith("[ ]")


@pytest.mark.slow
def test_fusion_timed_inside_the_model(capsys):
    got = ch14.time_add_rmsnorm_in_model(fused_add_rmsnorm, prompt_tokens=32, reps=1)
    assert set(got) == {"the engine's add_rmsnorm", "your fused_add_rmsnorm"}
    assert all(r["calls"] == 60 and 0 < r["add_rmsnorm_ms"] < r["pass_ms"] for r in got.values())
    assert ch14.time_add_rmsnorm_in_model(not_attempted) == {}
    assert verdict(capsys).startswith("[ ]")
