"""The online engine loop on the GPU: one sequence's decode steps replay a CUDA graph over the paged
(or contiguous) cache, threads share one LLM, the chat runs through the loop. Skipped without a GPU."""
import threading

import numpy as np
import pytest

pytestmark = pytest.mark.gpu   # skipped without a usable GPU (tests/conftest.py)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from engine.model.random_model import write_random_model
    return write_random_model(tmp_path_factory.mktemp("smol"), "smollm2-135m", seed=3)


@pytest.mark.parametrize("kv_cache", ["paged", "contiguous"])
def test_graph_decode_equals_eager_decode(model_dir, kv_cache):
    """A lone request decodes through a CUDA graph (the batch-of-one bucket; page tables are inputs
    of the graph): the same greedy tokens as eager steps, over several page boundaries and two
    requests in a row."""
    import engine
    from engine.runtime.llm import LLM
    params = engine.SamplingParams(max_new_tokens=40, ignore_eos=True)
    prompts = [list(np.random.default_rng(s).integers(3, 200, n)) for s, n in ((0, 7), (1, 30))]
    graph = LLM(model_dir, backend="cupy", kv_cache=kv_cache, max_context=256, max_seqs=4, cuda_graphs=True)
    eager = LLM(model_dir, backend="cupy", kv_cache=kv_cache, max_context=256, max_seqs=4, cuda_graphs=False)
    got = [graph.generate([p], params)[0].token_ids for p in prompts]
    assert graph.decode_graphs.replays >= 2 * (params.max_new_tokens - 2)
    assert eager.decode_graphs.replays == 0 and eager.decode_graphs.captured == []
    want = [eager.generate([p], params)[0].token_ids for p in prompts]
    assert got == want


def test_threads_share_one_llm_on_gpu(model_dir):
    import engine
    from engine.runtime.llm import LLM
    llm = LLM(model_dir, backend="cupy", max_context=256, max_seqs=8)
    params = engine.SamplingParams(max_new_tokens=16, ignore_eos=True)
    prompts = [list(np.random.default_rng(s).integers(3, 200, 5 + s)) for s in range(16)]
    batched = [r.token_ids for r in llm.generate(prompts, params)]
    got = [None] * len(prompts)

    def worker(k):
        for i in range(k, len(prompts), 8):
            got[i] = llm.generate([prompts[i]], params)[0].token_ids

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    agree = np.mean([a == b for a, b in zip(got, batched, strict=True)])
    assert agree >= 0.8, (got, batched)    # bf16: other batch shapes may flip a near-tie


def test_chat_on_gpu(default_model_dir):
    import io

    from engine.chat.local import Chat
    from engine.runtime.sampling_params import SamplingParams
    chat = Chat(default_model_dir, "cupy", SamplingParams(max_new_tokens=16), None, 512)
    out = io.StringIO()
    chat.answer("What is the capital of France?", out=out)
    assert "Paris" in out.getvalue()
    second = chat.answer("And of Italy?", out=io.StringIO())
    assert second.reused_tokens > 20
    assert chat.llm.decode_graphs.replays > 0           # its decode steps replayed a CUDA graph


@pytest.mark.parametrize("kv_cache,budget", [("paged", 8192), ("paged", 48), ("contiguous", 8192)])
def test_async_scheduling_gives_the_tokens_of_one_step_at_a_time(model_dir, kv_cache, budget):
    """The engine loop keeps a step in flight and feeds its sampled ids to the next step on the device
    (into the decode graphs' inputs, and into eager mixed steps when prompts are chunked, budget 48):
    greedy and seeded sampling give exactly the tokens of the loop that waits for every step. Every
    request has a seat from the start, so both loops run the same batches (with requests waiting
    for seats, a lookahead admits a newcomer one step later: other batches, other bf16 roundings)."""
    import engine
    from engine.runtime.llm import LLM
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 200, int(rng.integers(4, 90))).tolist() for _ in range(24)]
    params = [engine.SamplingParams(max_new_tokens=int(rng.integers(1, 40)), ignore_eos=True,
                                    **({"temperature": 0.8, "top_p": 0.9, "seed": i} if i % 3 == 0 else {}))
              for i in range(24)]
    kw = dict(backend="cupy", kv_cache=kv_cache, max_context=256, max_seqs=32, max_batch_tokens=budget)
    overlapped, serial = LLM(model_dir, **kw), LLM(model_dir, async_scheduling=False, **kw)
    assert overlapped.async_scheduling and not serial.async_scheduling
    got = [r.token_ids for r in overlapped.generate(prompts, params)]
    assert overlapped.decode_graphs.replays > 0
    assert got == [r.token_ids for r in serial.generate(prompts, params)]
    assert [e["request_ids"] for e in overlapped.last_step_log] == [e["request_ids"] for e in serial.last_step_log]
    if budget < 90:
        assert any(entry["kind"] == "mixed" for entry in overlapped.last_step_log)
