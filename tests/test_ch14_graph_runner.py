"""Decode steps replayed as CUDA graphs per batch-size bucket (engine/runtime/cuda_graphs.py).

CPU: the bucket rule, the packed input layout, and the padded decode step itself (run eagerly on the
NumPy backend): its real rows equal an ordinary forward pass, and padding rows change nothing in
the cache. GPU: the graph replay of every bucket against eager steps, padding rows that never
disturb real rows, plug-ins that turn replay off, and whole serving runs with graphs on and off.
"""
import numpy as np
import pytest

from engine.model.forward_pass import ForwardBatch, load_model
from engine.model.kv_cache import KVCache
from engine.model.random_model import write_random_model
from engine.runtime.cuda_graphs import (
    BUCKETS,
    DecodeGraphs,
    bucket_of,
    buckets_for,
    input_size,
    input_views,
    is_decode_batch,
    pack_decode_inputs,
    run_padded,
)

PAGE = 4
MAX_CONTEXT = 64


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_random_model(tmp_path_factory.mktemp("tiny"), "tiny", seed=5)


def test_buckets():
    assert buckets_for(1) == (1,)
    assert buckets_for(3) == (1, 2, 3)
    assert buckets_for(16) == (1, 2, 4, 8, 16)
    assert buckets_for(100) == (1, 2, 4, 8, 16, 32, 64, 100)
    assert buckets_for(1000) == BUCKETS
    assert [bucket_of(r, buckets_for(100)) for r in (1, 2, 3, 5, 64, 65, 100)] == [1, 2, 4, 8, 64, 100, 100]
    assert bucket_of(101, buckets_for(100)) is None


def decode_batch(rng, num_seqs: int, page_size: int, num_pages: int, vocab: int, max_len: int = MAX_CONTEXT):
    """A decode ForwardBatch of num_seqs sequences with distinct random pages and random lengths >= 2."""
    lengths = rng.integers(2, max_len + 1, num_seqs)
    need = -(-lengths // page_size)
    pages = rng.permutation(num_pages)[:need.sum()]
    tables = np.full((num_seqs, need.max()), -1, dtype=np.int32)
    start = 0
    for s, n in enumerate(need):
        tables[s, :n] = pages[start:start + n]
        start += n
    pos = (lengths - 1).astype(np.int32)
    slots = (tables[np.arange(num_seqs), pos // page_size] * page_size + pos % page_size).astype(np.int32)
    ids = rng.integers(0, vocab, num_seqs).astype(np.int32)
    return ForwardBatch(ids, pos, np.arange(num_seqs + 1, dtype=np.int32), tables, slots,
                        np.arange(num_seqs, dtype=np.int32))


def test_is_decode_batch():
    rng = np.random.default_rng(0)
    fb = decode_batch(rng, 3, PAGE, 64, 100)
    assert is_decode_batch(fb)
    assert not is_decode_batch(ForwardBatch.single([1, 2, 3], page_table=[0], page_size=PAGE))   # a prefill
    assert not is_decode_batch(ForwardBatch(fb.token_ids, fb.positions, fb.cu_seqlens, fb.page_tables,
                                            fb.slot_mapping, np.array([0], dtype=np.int32)))      # some rows only
    assert not is_decode_batch(ForwardBatch(fb.token_ids, fb.positions, fb.cu_seqlens))          # no cache


def test_pack_layout():
    rng = np.random.default_rng(1)
    fb = decode_batch(rng, 3, PAGE, 64, 100)
    width = MAX_CONTEXT // PAGE
    flat = np.full(input_size(8, width) + 5, 77, dtype=np.int32)
    pack_decode_inputs(fb, 4, width, flat)
    ids, pos, slots, tables = input_views(flat, 4, width)
    assert ids.tolist() == fb.token_ids.tolist() + [0]
    assert pos.tolist() == fb.positions.tolist() + [0]
    assert slots.tolist() == fb.slot_mapping.tolist() + [-1]          # the padding row writes nothing
    tw = fb.page_tables.shape[1]
    assert np.array_equal(tables[:3, :tw], fb.page_tables) and (tables[:3, tw:] == -1).all()
    assert (tables[3] == 0).all()                                     # the padding row reads page 0
    assert (flat[input_size(4, width):] == 77).all()                  # nothing past the bucket's inputs


@pytest.mark.parametrize("rows,bucket", [(1, 1), (3, 4), (5, 8)])
def test_padded_step_matches_forward_on_cpu(tiny_dir, rows, bucket):
    """The padded step (what a graph records) on the NumPy backend: real rows equal a plain forward
    pass, and the cache after it equals the cache after the plain pass (padding wrote nothing)."""
    model = load_model(tiny_dir, backend="numpy", max_context=MAX_CONTEXT)
    rng = np.random.default_rng(rows)
    caches = []
    for _ in range(2):
        cache = KVCache(model.config, 64, PAGE, "numpy")
        fill = np.random.default_rng(9)
        cache.k[:] = fill.standard_normal(cache.k.shape, dtype=np.float32)
        cache.v[:] = fill.standard_normal(cache.v.shape, dtype=np.float32)
        caches.append(cache)
    fb = decode_batch(rng, rows, PAGE, 64, model.config.vocab_size)
    ref = model.forward(fb, caches[0])                                   # [R, V]
    width = MAX_CONTEXT // PAGE
    flat = np.zeros(input_size(bucket, width), dtype=np.int32)
    pack_decode_inputs(fb, bucket, width, flat)
    got = run_padded(model, caches[1], flat, np.arange(bucket, dtype=np.int32), bucket, width)
    assert got.shape == (bucket, model.config.vocab_size)
    np.testing.assert_allclose(got[:rows], ref, rtol=1e-5, atol=1e-5)
    assert np.array_equal(got[:rows].argmax(-1), ref.argmax(-1))
    # the same K/V written (up to BLAS blocking: the QKV product has `bucket` rows, not R) ...
    np.testing.assert_allclose(caches[1].k, caches[0].k, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(caches[1].v, caches[0].v, rtol=1e-5, atol=1e-5)
    # ... and nothing but the real rows' slots touched
    untouched = np.ones(cache.k.shape[1:3], dtype=bool)                 # [NB, BS]
    untouched.reshape(-1)[fb.slot_mapping] = False
    fresh = KVCache(model.config, 64, PAGE, "numpy")
    fill = np.random.default_rng(9)
    fresh.k[:] = fill.standard_normal(fresh.k.shape, dtype=np.float32)
    fresh.v[:] = fill.standard_normal(fresh.v.shape, dtype=np.float32)
    np.testing.assert_array_equal(caches[1].k[:, untouched], fresh.k[:, untouched])
    np.testing.assert_array_equal(caches[1].v[:, untouched], fresh.v[:, untouched])


def test_graphs_off_on_cpu_and_by_switch(tiny_dir, monkeypatch):
    model = load_model(tiny_dir, backend="numpy", max_context=MAX_CONTEXT)
    cache = KVCache(model.config, 16, PAGE, "numpy")
    graphs = DecodeGraphs(model, cache, 8)
    assert not graphs.enabled
    assert graphs.forward(decode_batch(np.random.default_rng(0), 2, PAGE, 16, 50, max_len=16)) is None
    monkeypatch.setenv("ENGINE_CUDA_GRAPHS", "0")
    from engine.runtime.cuda_graphs import graphs_enabled_by_env
    assert not graphs_enabled_by_env()
    monkeypatch.setenv("ENGINE_CUDA_GRAPHS", "1")
    assert graphs_enabled_by_env()


def test_llm_refuses_a_bad_cuda_graphs_value(tiny_dir):
    from engine.runtime.llm import LLM
    with pytest.raises(ValueError, match="cuda_graphs"):
        LLM(tiny_dir, backend="numpy", cuda_graphs="yes")


# ---------------------------------------------------------------------------------------------- GPU
def gpu_setup(model_dir, kind: str, max_rows: int):
    """A cupy model and a cache full of bf16 noise (so that every key a row reads matters)."""
    import cupy as cp

    from engine.backend import f32_to_bf16
    model = load_model(model_dir, backend="cupy", max_context=MAX_CONTEXT)
    if kind == "paged":
        cache = KVCache(model.config, 4 * max_rows * MAX_CONTEXT // PAGE, PAGE, "cupy")
    else:
        cache = KVCache.contiguous(model.config, max_rows, MAX_CONTEXT, "cupy")
    noise = np.random.default_rng(4)
    for arr in (cache.k, cache.v):
        arr[:] = cp.asarray(f32_to_bf16(noise.standard_normal(arr.shape, dtype=np.float32)))
    return model, cache


def gpu_batch(rng, rows, cache, vocab):
    if cache.page_size == MAX_CONTEXT:                                # contiguous: one slot per sequence
        slots_of = rng.permutation(cache.num_pages)[:rows]
        pos = rng.integers(1, MAX_CONTEXT, rows).astype(np.int32)
        tables = slots_of.reshape(rows, 1).astype(np.int32)
        return ForwardBatch(rng.integers(0, vocab, rows).astype(np.int32), pos,
                            np.arange(rows + 1, dtype=np.int32), tables,
                            (tables[:, 0] * MAX_CONTEXT + pos).astype(np.int32), np.arange(rows, dtype=np.int32))
    return decode_batch(rng, rows, PAGE, cache.num_pages, vocab)


def host_f32(bits):
    import cupy as cp

    from engine.backend import bf16_to_f32
    return bf16_to_f32(cp.asnumpy(bits))


def assert_only_slots_changed(cache, k0, v0, slots):
    """Every cache row outside `slots` is bit for bit what it was (padding rows wrote nothing)."""
    import cupy as cp
    changed = cp.asnumpy((cache.k != k0).any(axis=(0, 3, 4)) | (cache.v != v0).any(axis=(0, 3, 4)))  # [NB, BS]
    written = {(int(s) // cache.page_size, int(s) % cache.page_size) for s in slots}
    assert {tuple(int(i) for i in x) for x in np.argwhere(changed)} <= written


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["paged", "contiguous"])
def test_graph_replay_matches_eager_for_every_bucket(tiny_dir, kind):
    """Rows 1..20 through buckets 1, 2, 4, 8, 16, 20: the replay equals the same padded step run
    eagerly (same kernels, same shapes), and a plain eager forward pass within bf16 bounds; it writes
    the same K/V as the eager padded step and touches no other cache row."""
    import cupy as cp
    max_rows = 20
    model, cache = gpu_setup(tiny_dir, kind, max_rows)
    graphs = DecodeGraphs(model, cache, max_rows, enabled=True)
    assert graphs.enabled and graphs.buckets == (1, 2, 4, 8, 16, 20)
    rng = np.random.default_rng(7)
    for rows in list(range(1, 9)) + [13, 16, 17, 20]:
        fb = gpu_batch(rng, rows, cache, model.config.vocab_size)
        k0, v0 = cache.k.copy(), cache.v.copy()
        eager = cp.asnumpy(model.forward(fb, cache))                      # [R, V]
        cache.k[:], cache.v[:] = k0, v0
        bucket, width = bucket_of(rows, graphs.buckets), graphs.width
        flat = np.zeros(input_size(bucket, width), dtype=np.int32)
        pack_decode_inputs(fb, bucket, width, flat)
        padded = cp.asnumpy(run_padded(model, cache, cp.asarray(flat), cp.arange(bucket, dtype=cp.int32),
                                       bucket, width))[:rows]
        k_padded, v_padded = cache.k.copy(), cache.v.copy()
        cache.k[:], cache.v[:] = k0, v0
        got = graphs.forward(fb)
        assert got is not None and got.shape == (rows, model.config.vocab_size)
        got = cp.asnumpy(got)
        np.testing.assert_allclose(got, padded, rtol=1e-5, atol=1e-5)
        rel = np.linalg.norm(got - eager) / np.linalg.norm(eager)
        assert rel < 1e-2, (rows, rel)
        assert np.mean(got.argmax(-1) == eager.argmax(-1)) >= 0.9
        np.testing.assert_allclose(host_f32(cache.k), host_f32(k_padded), rtol=1e-2, atol=1e-2)
        np.testing.assert_allclose(host_f32(cache.v), host_f32(v_padded), rtol=1e-2, atol=1e-2)
        assert_only_slots_changed(cache, k0, v0, fb.slot_mapping)
    assert graphs.captured == [1, 2, 4, 8, 16, 20]
    assert graphs.disabled_reason is None


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["paged", "contiguous"])
def test_padding_rows_never_disturb_real_rows(tiny_dir, kind):
    """Five rows in the 8-row bucket: only their slots are written, and replaying them again after a
    full 8-row step in between (other data in every input row) gives the same logits bit for bit."""
    import cupy as cp
    model, cache = gpu_setup(tiny_dir, kind, 8)
    graphs = DecodeGraphs(model, cache, 8, enabled=True)
    rng = np.random.default_rng(11)
    fb = gpu_batch(rng, 5, cache, model.config.vocab_size)
    k0, v0 = cache.k.copy(), cache.v.copy()
    first = cp.asnumpy(graphs.forward(fb))
    assert graphs.captured == [8]
    assert_only_slots_changed(cache, k0, v0, fb.slot_mapping)
    graphs.forward(gpu_batch(rng, 8, cache, model.config.vocab_size))    # every row of the bucket real
    cache.k[:], cache.v[:] = k0, v0
    second = cp.asnumpy(graphs.forward(fb))
    np.testing.assert_array_equal(first, second)
    assert np.isfinite(first).all()


@pytest.mark.gpu
def test_plugin_turns_replay_off(tiny_dir):
    import engine
    from engine.ops.rmsnorm import rmsnorm_ref
    model, cache = gpu_setup(tiny_dir, "paged", 4)
    graphs = DecodeGraphs(model, cache, 4, enabled=True)
    fb = gpu_batch(np.random.default_rng(3), 3, cache, model.config.vocab_size)
    with engine.use_stage("rmsnorm", rmsnorm_ref):
        assert graphs.forward(fb) is None
    assert graphs.captured == []
    assert graphs.forward(fb) is not None and graphs.captured == [4]


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["paged", "contiguous"])
def test_serving_with_and_without_graphs(tiny_dir, kind):
    """Whole greedy runs (requests of different lengths: the batch shrinks through the buckets)."""
    from engine.runtime.llm import LLM
    from engine.runtime.sampling_params import SamplingParams
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, 300, int(n)).tolist() for n in rng.integers(2, 30, 11)]
    params = [SamplingParams(max_new_tokens=int(n), ignore_eos=True) for n in rng.integers(1, 25, 11)]
    outs = {}
    for graphs in (False, True):
        llm = LLM(tiny_dir, backend="cupy", kv_cache=kind, max_context=MAX_CONTEXT, max_seqs=6, cuda_graphs=graphs)
        outs[graphs] = [r.token_ids for r in llm.generate(prompts, params)]
        if graphs:
            assert llm.decode_graphs.replays > 0 and llm.decode_graphs.disabled_reason is None
            assert set(llm.decode_graphs.captured) <= {1, 2, 4, 6}
        llm.close()
    agree = np.mean([a == b for a, b in zip(outs[True], outs[False], strict=True)])
    assert agree >= 0.9, outs      # bf16: a different split of the context may flip a near-tie
