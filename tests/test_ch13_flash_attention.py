"""Tiled prefill attention (engine/ops/flash_attention.py, kernels_cu/flash_attention.cu).

CPU: the tiled NumPy reference against the dense causal attention of chapter 06 on awkward shapes
(lengths that are not multiples of the tile, GQA 1/3/4/8, packed sequences, chunks after a cached
prefix in shuffled pages), its memory, its input errors, and the model prefilling a prompt in
chunks over the cache. GPU (marker `gpu`): the kernel against the NumPy reference on the same
shapes, outputs poisoned with NaN, head_dim 16/32/64/128, bf16 tolerance.
"""
import contextlib
import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.backend import bf16_to_f32, f32_to_bf16
from engine.formats.config import config_from_dict
from engine.model.random_model import PRESETS
from engine.ops.attention import causal_attention_ref
from engine.ops.flash_attention import FlashAttentionInputError, flash_attention, flash_attention_ref
from engine.ops.kv_write import kv_write_ref

GQA = [(4, 4), (9, 3), (8, 2), (8, 1)]           # group sizes 1, 3, 4, 8
BF16_TOL = 1e-2


def make_config(Hq, Hkv, D):
    return config_from_dict({**PRESETS["tiny"], "num_attention_heads": Hq, "num_key_value_heads": Hkv,
                             "head_dim": D, "hidden_size": 8 * Hq})


def rel_err(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    if not np.all(np.isfinite(out)):
        return float("inf")
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def make_case(rng, Hq, Hkv, D, prefixes, chunks, page_size, round_bf16=False):
    """Sequences whose first `prefixes[s]` tokens are already cached and whose next `chunks[s]`
    tokens are the queries. K/V of every token sit in shuffled pages of a cache whose other slots
    are NaN (a read past the context shows up). Returns a dict with the packed queries, the cache,
    the page tables and the dense reference of each chunk."""
    rnd = (lambda x: bf16_to_f32(f32_to_bf16(x))) if round_bf16 else (lambda x: x)
    totals = [p + c for p, c in zip(prefixes, chunks, strict=True)]
    pages = [-(-n // page_size) for n in totals]
    order = rng.permutation(sum(pages) + 2)
    k_cache, v_cache = np.full((2, sum(pages) + 2, page_size, Hkv, D), np.nan, dtype=np.float32)
    tables = np.full((len(totals), max(pages)), -1, dtype=np.int32)
    queries, expected, positions, taken = [], [], [], 0
    for s, (p, n) in enumerate(zip(prefixes, totals, strict=True)):
        tables[s, :pages[s]] = order[taken:taken + pages[s]]
        taken += pages[s]
        q = rnd(rng.standard_normal((n, Hq, D), dtype=np.float32) * 2)
        k = rnd(rng.standard_normal((n, Hkv, D), dtype=np.float32) * 2)
        v = rnd(rng.standard_normal((n, Hkv, D), dtype=np.float32))
        pos = np.arange(n)
        kv_write_ref(k, v, k_cache, v_cache, tables[s][pos // page_size] * page_size + pos % page_size)
        queries.append(q[p:])
        expected.append(causal_attention_ref(q, k, v, D ** -0.5)[p:])
        positions.append(pos[p:])
    cu = np.concatenate([[0], np.cumsum(chunks)]).astype(np.int32)
    return dict(q=np.concatenate(queries), k_cache=k_cache, v_cache=v_cache, tables=tables, cu=cu,
                positions=np.concatenate(positions).astype(np.int32), expected=np.concatenate(expected))


def packed_prompts(rng, Hq, Hkv, D, lengths, round_bf16=False):
    """Fresh prompts packed one after another: q [T, Hq, D], k/v [T, Hkv, D], cu, positions, reference."""
    rnd = (lambda x: bf16_to_f32(f32_to_bf16(x))) if round_bf16 else (lambda x: x)
    T = sum(lengths)
    q = rnd(rng.standard_normal((T, Hq, D), dtype=np.float32) * 2)
    k = rnd(rng.standard_normal((T, Hkv, D), dtype=np.float32) * 2)
    v = rnd(rng.standard_normal((T, Hkv, D), dtype=np.float32))
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    positions = np.concatenate([np.arange(n) for n in lengths]).astype(np.int32)
    ref = np.concatenate([causal_attention_ref(q[a:b], k[a:b], v[a:b], D ** -0.5)
                          for a, b in zip(cu[:-1], cu[1:], strict=True) if b > a])
    return q, k, v, cu, positions, ref


# ---- NumPy: tiled reference == dense reference -------------------------------------------------

@pytest.mark.parametrize("Hq,Hkv", GQA)
@pytest.mark.parametrize("block_q,block_k", [(5, 7), (16, 3), (256, 512)])
def test_tiled_equals_dense_on_packed_prompts(Hq, Hkv, block_q, block_k):
    rng = np.random.default_rng(Hq * 10 + block_q)
    q, k, v, cu, positions, ref = packed_prompts(rng, Hq, Hkv, 12, [13, 1, 40, 7])
    out = flash_attention_ref(q, k, v, cu, positions, 12 ** -0.5, block_q=block_q, block_k=block_k)
    assert out.dtype == np.float32 and out.shape == ref.shape
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("Hq,Hkv", GQA)
@pytest.mark.parametrize("page_size", [1, 5, 16])
def test_tiled_chunks_over_a_cached_prefix(Hq, Hkv, page_size):
    """Chunks after prefixes of 0, 17, 64 and 100 cached tokens, read through shuffled pages."""
    rng = np.random.default_rng(page_size + Hkv)
    c = make_case(rng, Hq, Hkv, 8, prefixes=[0, 17, 64, 100], chunks=[5, 33, 1, 70], page_size=page_size)
    out = flash_attention_ref(c["q"], c["k_cache"], c["v_cache"], c["cu"], c["positions"], 8 ** -0.5,
                              page_tables=c["tables"], block_q=16, block_k=24)
    np.testing.assert_allclose(out, c["expected"], rtol=1e-5, atol=1e-5)


@settings(max_examples=25, deadline=None)
@given(heads=st.sampled_from(GQA), lengths=st.lists(st.integers(0, 45), min_size=1, max_size=4).filter(any),
       block_q=st.integers(1, 20), block_k=st.integers(1, 20), seed=st.integers(0, 2**16))
def test_tiled_equals_dense_for_any_tiles(heads, lengths, block_q, block_k, seed):
    """Any tile sizes, empty sequences in the pack, one-token prompts."""
    Hq, Hkv = heads
    q, k, v, cu, positions, ref = packed_prompts(np.random.default_rng(seed), Hq, Hkv, 4, lengths)
    out = flash_attention_ref(q, k, v, cu, positions, 0.5, block_q=block_q, block_k=block_k)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


def test_tiled_survives_huge_scores():
    rng = np.random.default_rng(3)
    q, k, v, cu, positions, ref = packed_prompts(rng, 4, 2, 16, [50])
    q, k = q * 40, k * 40
    ref = causal_attention_ref(q, k, v, 0.25)
    out = flash_attention_ref(q, k, v, cu, positions, 0.25, block_q=8, block_k=8)
    assert np.all(np.isfinite(out))
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4)


def test_dispatcher_reads_fused_qkv_and_the_cache():
    """flash_attention on the CPU: q from the fused QKV buffer; keys from its k/v columns (fresh)
    or from the cache (chunk; the buffer's k/v columns are then ignored)."""
    rng = np.random.default_rng(8)
    Hq, Hkv, D = 6, 2, 8
    cfg = make_config(Hq, Hkv, D)
    q, k, v, cu, positions, ref = packed_prompts(rng, Hq, Hkv, D, [9, 30])
    qkv = np.concatenate([q.reshape(len(q), -1), k.reshape(len(q), -1), v.reshape(len(q), -1)], axis=1)
    np.testing.assert_allclose(flash_attention(qkv, cu, positions, cfg), ref.reshape(len(q), -1), rtol=1e-5, atol=1e-5)
    c = make_case(rng, Hq, Hkv, D, prefixes=[40, 3], chunks=[11, 20], page_size=4)
    T = len(c["q"])
    qkv = np.concatenate([c["q"].reshape(T, -1), rng.standard_normal((T, 2 * Hkv * D), dtype=np.float32)], axis=1)
    out = flash_attention(qkv, c["cu"], c["positions"], cfg, c["k_cache"], c["v_cache"], c["tables"])
    np.testing.assert_allclose(out, c["expected"].reshape(T, -1), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_memory_is_linear_in_the_length():
    """4,096 tokens x 4 heads: the dense scores alone would be 4096^2 * 4 * 4 B = 256 MiB."""
    rng = np.random.default_rng(0)
    T, Hq, Hkv, D = 4096, 4, 2, 16
    q = rng.standard_normal((T, Hq, D), dtype=np.float32)
    k = rng.standard_normal((T, Hkv, D), dtype=np.float32)
    tracemalloc.start()
    flash_attention_ref(q, k, k, np.array([0, T]), np.arange(T), 0.25)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 12 * 2**20, f"peak {peak / 2**20:.1f} MiB"


@pytest.mark.parametrize("cu,positions,message", [
    ([0, 5, 3], np.arange(3), "cu_seqlens"),
    ([1, 3], np.arange(3), "cu_seqlens"),
    ([0, 3], np.arange(4), "one entry per row"),
    ([0, 3], np.array([2, 3, 4]), "start at position 0"),
    ([0, 3], np.array([-1, 0, 1]), ">= 0"),
])
def test_bad_layout_is_refused(cu, positions, message):
    q = np.zeros((3, 2, 4), np.float32)
    k = np.zeros((3, 1, 4), np.float32)
    with pytest.raises(FlashAttentionInputError, match=message):
        flash_attention_ref(q, k, k, np.array(cu), positions, 0.5)


def test_model_prefills_in_chunks_over_the_cache(tmp_path):
    """A prompt prefilled in three chunks into a paged cache gives the logits of one full pass."""
    import engine
    from engine.model.forward_pass import ForwardBatch
    from engine.model.kv_cache import KVCache
    from engine.model.random_model import write_random_model
    model = engine.load_model(write_random_model(tmp_path, "tiny", seed=4), backend="numpy")
    ids = np.random.default_rng(5).integers(3, 300, 90)
    full = model.logits(ids)
    cache = KVCache(model.config, num_pages=12, page_size=8)
    table = list(np.random.default_rng(6).permutation(12))
    start = 0
    for end in (31, 32, 90):
        batch = ForwardBatch.single(ids[start:end], start_pos=start, page_table=table, page_size=8)
        np.testing.assert_allclose(model.forward(batch, cache), full[start:end], rtol=1e-4, atol=1e-4)
        start = end


# ---- GPU: the kernel == the NumPy reference ----------------------------------------------------

@contextlib.contextmanager
def poisoned_allocations():
    """Every CuPy allocation inside starts as 0xFF bytes (NaN in bf16): an unwritten output fails."""
    import cupy as cp
    pool = cp.get_default_memory_pool()

    def alloc(size):
        mem = pool.malloc(size)
        cp.cuda.runtime.memsetAsync(mem.ptr, 0xFF, size, cp.cuda.get_current_stream().ptr)
        return mem
    cp.cuda.set_allocator(alloc)
    try:
        yield
    finally:
        cp.cuda.set_allocator(pool.malloc)


def to_device_bf16(x):
    import cupy as cp
    return cp.asarray(f32_to_bf16(x))


GPU_SHAPES = [(Hq, Hkv, D) for D in (64, 128) for Hq, Hkv in GQA] + [(6, 2, 16), (4, 1, 32)]


@pytest.mark.gpu(tensor_cores=True)   # the kernel needs sm_80+ (bf16 mma.sync)
@pytest.mark.parametrize("Hq,Hkv,D", GPU_SHAPES)
@pytest.mark.parametrize("lengths", [[1, 63, 64, 65, 130], [300]])
def test_kernel_matches_reference_on_fresh_prompts(Hq, Hkv, D, lengths):
    import cupy as cp
    cfg = make_config(Hq, Hkv, D)
    q, k, v, cu, positions, _ = packed_prompts(np.random.default_rng(D + Hq), Hq, Hkv, D, lengths, round_bf16=True)
    T = len(q)
    qkv = np.concatenate([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], axis=1)
    ref = flash_attention_ref(q, k, v, cu, positions, D ** -0.5).reshape(T, -1)
    with poisoned_allocations():
        out = flash_attention(to_device_bf16(qkv), cu, cp.asarray(positions), cfg)
    assert out.dtype == cp.uint16 and out.shape == (T, Hq * D)
    assert rel_err(bf16_to_f32(out.get()), ref) < BF16_TOL


@pytest.mark.gpu(tensor_cores=True)   # the kernel needs sm_80+ (bf16 mma.sync)
@pytest.mark.parametrize("Hq,Hkv,D", GPU_SHAPES)
@pytest.mark.parametrize("page_size", [16, 7])
def test_kernel_matches_reference_over_a_cached_prefix(Hq, Hkv, D, page_size):
    """Chunks after cached prefixes (0, 17, 64, 100 tokens), shuffled pages, NaN in unused slots."""
    import cupy as cp
    cfg = make_config(Hq, Hkv, D)
    c = make_case(np.random.default_rng(page_size * D + Hq), Hq, Hkv, D, prefixes=[0, 17, 64, 100],
                  chunks=[5, 64, 70, 1], page_size=page_size, round_bf16=True)
    T = len(c["q"])
    qkv = np.concatenate([c["q"].reshape(T, -1), np.full((T, 2 * Hkv * D), np.nan, np.float32)], axis=1)
    ref = flash_attention_ref(c["q"], c["k_cache"], c["v_cache"], c["cu"], c["positions"], D ** -0.5,
                              page_tables=c["tables"]).reshape(T, -1)
    with poisoned_allocations():
        out = flash_attention(to_device_bf16(qkv), c["cu"], cp.asarray(c["positions"]), cfg,
                              to_device_bf16(c["k_cache"]), to_device_bf16(c["v_cache"]), cp.asarray(c["tables"]))
    assert rel_err(bf16_to_f32(out.get()), ref) < BF16_TOL


@pytest.mark.gpu(tensor_cores=True)   # the kernel needs sm_80+ (bf16 mma.sync)
@pytest.mark.parametrize("preset", ["tiny", "smollm2-135m"])
def test_gpu_model_chunked_prefill_matches_one_pass(tmp_path, preset):
    """On the GPU: a prompt prefilled in chunks over the paged cache (flash kernel, PAGED 1) gives
    the logits of one full pass (flash kernel, PAGED 0), within bf16."""
    import engine
    from engine.model.forward_pass import ForwardBatch
    from engine.model.kv_cache import KVCache
    from engine.model.random_model import write_random_model
    model = engine.load_model(write_random_model(tmp_path, preset, seed=4), backend="cupy", max_context=256)
    ids = np.random.default_rng(5).integers(3, 300, 200)
    full = model.logits(ids)
    cache = KVCache(model.config, num_pages=16, page_size=16, backend=model.backend)
    table = list(np.random.default_rng(6).permutation(16))
    start = 0
    for end in (70, 71, 200):
        batch = ForwardBatch.single(ids[start:end], start_pos=start, page_table=table, page_size=16)
        got = model.backend.xp.asnumpy(model.forward(batch, cache))
        assert rel_err(got, full[start:end]) < 2e-2
        assert np.mean(got.argmax(-1) == full[start:end].argmax(-1)) > 0.95
        start = end

