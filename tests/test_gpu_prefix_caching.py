"""Prefix caching on the GPU (chapter 15): the page copy, and engine.LLM with shared prefixes through
the decode graphs and async scheduling. Skipped without a GPU."""
import numpy as np
import pytest

pytestmark = pytest.mark.gpu   # skipped without a usable GPU (tests/conftest.py)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from engine.model.random_model import write_random_model
    return write_random_model(tmp_path_factory.mktemp("smol"), "smollm2-135m", seed=4)


def test_copy_pages_copies_every_layer_of_k_and_v(model_dir):
    from engine.formats.config import load_config
    from engine.model.kv_cache import KVCache
    cache = KVCache(load_config(model_dir), num_pages=6, page_size=4, backend="cupy")
    xp = cache.backend.xp
    rng = np.random.default_rng(0)
    for array in (cache.k, cache.v):
        array[...] = xp.asarray(rng.standard_normal(array.shape).astype(np.float32)).astype(array.dtype)
    k, v = cache.k.get(), cache.v.get()
    cache.copy_pages([(1, 4), (3, 0)])
    for before, after in ((k, cache.k.get()), (v, cache.v.get())):
        want = before.copy()
        want[:, 4], want[:, 0] = before[:, 1], before[:, 3]
        assert np.array_equal(after.view(np.uint16), want.view(np.uint16))


def shared_prefix_prompts(seed=7):
    rng = np.random.default_rng(seed)
    system = rng.integers(3, 200, 80).tolist()                 # five full pages
    prompts = [system + rng.integers(3, 200, int(rng.integers(1, 30))).tolist() for _ in range(20)]
    return prompts + [prompts[2], system[:64], system[:64]]     # a repeat; a page-aligned prefix twice


def test_the_cache_gives_async_and_serial_serving_the_same_tokens(model_dir):
    """Async scheduling and the serial loop, both with the cache (shared pages, same-step sharing,
    copies, decode graphs): exactly the same tokens, greedy and seeded sampling. Without the cache
    (other batches, other kernels for the prefix) greedy tokens agree but for bf16 near-ties."""
    import engine
    from engine.runtime.llm import LLM
    prompts = shared_prefix_prompts()
    params = [engine.SamplingParams(max_new_tokens=24, ignore_eos=True,
                                    **({"temperature": 0.8, "top_p": 0.9, "seed": i} if i % 3 == 0 else {}))
              for i in range(len(prompts))]
    kw = dict(backend="cupy", max_context=256, max_seqs=8, max_batch_tokens=128)
    overlapped, serial = LLM(model_dir, **kw), LLM(model_dir, async_scheduling=False, **kw)
    assert overlapped.prefix_caching and overlapped.async_scheduling and not serial.async_scheduling
    got = [r.token_ids for r in overlapped.generate(prompts, params)]
    assert got == [r.token_ids for r in serial.generate(prompts, params)]
    assert overlapped.decode_graphs.replays > 0
    stats = overlapped.stats()
    assert stats["prefix_cache"]["hit_tokens"] > 64 * 18, stats["prefix_cache"]
    plain = LLM(model_dir, prefix_caching=False, **kw)
    want = [r.token_ids for r in plain.generate(prompts, params)]
    agree = np.mean([a == b for a, b in zip(got, want, strict=True)])
    assert agree >= 0.8, (got, want)      # bf16: another kernel for the prefix may flip a near-tie


def test_a_repeated_page_aligned_prompt_copies_its_last_page_on_the_device(model_dir):
    import engine
    from engine.runtime.llm import LLM
    llm = LLM(model_dir, backend="cupy", max_context=256, max_seqs=2)
    prompt = np.random.default_rng(3).integers(3, 200, 48).tolist()   # three full pages
    params = engine.SamplingParams(max_new_tokens=16, ignore_eos=True)
    first = llm.generate([prompt], params)[0].token_ids
    again = llm.generate([prompt], params)[0].token_ids
    assert llm.last_step_log[0]["reused_tokens"] == 47               # all but the last token: a copy
    assert again[:8] == first[:8]
