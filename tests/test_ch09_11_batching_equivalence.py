"""Every cache and batching path gives the same greedy tokens (NumPy backend, exactly).

For seeded random workloads (random prompt lengths, output lengths, ignore_eos, and an eos id that
the model really emits), each request's tokens and finish reason must be identical across:
no cache (full recomputation, the oracle), ChatSession (contiguous cache), LLM static/continuous x
contiguous/paged, with and without chunked prefill (token budgets smaller than most prompts, so a
prompt is prefilled over several steps, mixed with running decodes), with all prompts submitted at
once or arriving between steps, and pools so small that requests must wait (conservative admission)
or be preempted and recomputed (on-demand).
Each model family runs the workloads: Llama, Qwen2 (q/k/v biases), Qwen3 (q/k norms) and Qwen3-MoE
(experts on its sparse layers: a token's routing must not depend on what else is in its batch).
"""
import numpy as np
import pytest
from helpers.oracle import GEN_CONFIG, GEN_CONFIGS, ForwardCounter, gen_model_dir, greedy_no_cache

from engine.formats.config import config_from_dict
from engine.model.forward_pass import load_model
from engine.runtime.chat_session import ChatSession
from engine.runtime.llm import LLM
from engine.runtime.sampling_params import SamplingParams

MAX_CONTEXT = 32                 # prompts up to 20 + outputs up to 12: some requests reach the end
# (family, seed): every seed on Llama, two on each Qwen family
WORKLOADS = [("llama", 0), ("llama", 1), ("llama", 2), ("llama", 3),
             ("qwen2", 1), ("qwen2", 2), ("qwen3", 0), ("qwen3", 1), ("qwen3_moe", 0), ("qwen3_moe", 1)]

# (batching, kv_cache, extra LLM arguments); LLM chunks prefills by default
ROOMY = [
    ("static", "contiguous", dict(max_seqs=3, chunked_prefill=False)),
    ("continuous", "contiguous", dict(max_seqs=3, chunked_prefill=False)),
    ("continuous", "paged", dict(chunked_prefill=False)),
    ("static", "paged", dict(max_seqs=4, max_batch_tokens=24, chunked_prefill=False)),
    ("continuous", "paged", dict(max_seqs=3, max_batch_tokens=20, page_size=4, chunked_prefill=False)),
    ("continuous", "paged", {}),
    # budgets of 3-6 tokens against prompts of up to 20: most prompts take several chunks
    ("continuous", "paged", dict(max_seqs=3, max_batch_tokens=5, page_size=4)),
    ("continuous", "contiguous", dict(max_seqs=3, max_batch_tokens=4)),
    ("static", "paged", dict(max_seqs=3, max_batch_tokens=6, page_size=4)),
    ("static", "contiguous", dict(max_seqs=2, max_batch_tokens=3)),
]


def pool_mib(pages: int, page_size: int, config: dict = GEN_CONFIG) -> float:
    """The kv_cache_mib of a pool of `pages` pages (K and V, fp32 on the CPU)."""
    return pages * page_size * config_from_dict(config).kv_bytes_per_token(4) / 2**20


# Pools of 8 pages of 4 tokens (32 tokens: one worst-case request) force waiting or preemption.
TIGHT = [
    ("continuous", "paged", dict(page_size=4, pool_pages=8), "waits"),
    ("continuous", "paged", dict(page_size=4, pool_pages=8, admission="on_demand"), "preempts"),
    ("static", "paged", dict(page_size=4, pool_pages=8, admission="on_demand"), "preempts"),
    ("continuous", "paged", dict(page_size=4, pool_pages=8, admission="on_demand",
                                 max_seqs=4, max_batch_tokens=6), "preempts"),
    ("static", "paged", dict(page_size=4, pool_pages=8, admission="on_demand",
                             chunked_prefill=False), "preempts"),
]


class Workload:
    """Requests, the eos id, and the oracle's (tokens, finish_reason) for each request."""

    def __init__(self, family: str, seed: int, n: int = 6):
        rng = np.random.default_rng(seed)
        self.family, self.config = family, GEN_CONFIGS[family]
        vocab = self.config["vocab_size"]
        self.prompts = [rng.integers(0, vocab, size=int(rng.integers(1, 21))).tolist() for _ in range(n)]
        self.params = [SamplingParams(max_new_tokens=int(rng.integers(1, 13)), ignore_eos=bool(rng.random() < 0.3))
                       for _ in range(n)]
        self.params[0] = SamplingParams(max_new_tokens=12)               # the request that meets the eos
        self.prompts[0] = self.prompts[0][:8]
        plain = load_model(gen_model_dir(family=family), backend="numpy", max_context=MAX_CONTEXT)
        free_run, _ = greedy_no_cache(plain, self.prompts[0], 12, ignore_eos=True)
        self.eos = free_run[4]                                            # emitted by request 0 at step <= 4
        self.model_dir = gen_model_dir(eos=self.eos, family=family)
        self.model = load_model(self.model_dir, backend="numpy", max_context=MAX_CONTEXT)
        self.expected = [greedy_no_cache(self.model, p, sp.max_new_tokens, eos=(self.eos,), ignore_eos=sp.ignore_eos)
                         for p, sp in zip(self.prompts, self.params)]
        assert self.expected[0][1] == "stop"

    def llm(self, batching, kv_cache, **kwargs) -> LLM:
        if "pool_pages" in kwargs:
            kwargs["kv_cache_mib"] = pool_mib(kwargs.pop("pool_pages"), kwargs["page_size"], self.config)
        return LLM(self.model_dir, backend="numpy", batching=batching, kv_cache=kv_cache,
                   max_context=MAX_CONTEXT, **kwargs)


@pytest.fixture(scope="module", params=WORKLOADS, ids=lambda fs: f"{fs[0]}-workload{fs[1]}")
def workload(request):
    return Workload(*request.param)


def outputs(results):
    return [(r.token_ids, r.finish_reason) for r in results]


def generate_with_arrivals(llm: LLM, workload: Workload, seed: int):
    """Drive the runner step by step with our own scheduler; requests arrive at random steps."""
    rng = np.random.default_rng(seed)
    sched = llm.new_scheduler()
    pending = list(range(len(workload.prompts)))
    index_of, results = {}, {}

    def submit():
        i = pending.pop(0)
        index_of[sched.submit(workload.prompts[i], workload.params[i])] = i

    for _ in range(2):
        submit()
    while pending or sched.has_unfinished():
        if pending and (not sched.has_unfinished() or rng.random() < 0.35):
            submit()
            continue
        out = llm.step(sched, {rid: 0 for rid in index_of})
        results.update((index_of[r.request_id], (r.token_ids, r.finish_reason)) for r in out.finished)
    return [results[i] for i in range(len(workload.prompts))], sched


def llm_chunks(kwargs) -> bool:
    return kwargs.get("chunked_prefill", True)


def test_workload_is_not_degenerate(workload):
    reasons = [reason for _, reason in workload.expected]
    assert "stop" in reasons and "length" in reasons
    assert len({t for tokens, _ in workload.expected for t in tokens}) > 8


def test_chat_session_equals_no_cache(workload):
    session = ChatSession(workload.model)                                # one session, request after request
    got = []
    for prompt, params in zip(workload.prompts, workload.params):
        got.append((list(session.stream(prompt, params)), session.finish_reason))
    assert got == workload.expected


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("batching,kv_cache,kwargs", ROOMY, ids=[f"{b}-{k}-{i}" for i, (b, k, _) in enumerate(ROOMY)])
def test_llm_generate_equals_no_cache(workload, batching, kv_cache, kwargs, async_scheduling):
    llm = workload.llm(batching, kv_cache, async_scheduling=async_scheduling, **kwargs)
    assert outputs(llm.generate(workload.prompts, workload.params)) == workload.expected
    assert not any(entry["preempted"] for entry in llm.last_step_log)     # conservative: never
    if llm.max_batch_tokens < max(map(len, workload.prompts)):            # chunked, and it shows
        assert any(not chunk[3] for entry in llm.last_step_log for chunk in entry["chunks"])
        assert all(entry["tokens"] <= llm.max_batch_tokens for entry in llm.last_step_log)
    if not llm.chunked_prefill:
        assert not any(entry["chunks"] or entry["kind"] == "mixed" for entry in llm.last_step_log)


@pytest.mark.parametrize("batching,kv_cache,kwargs", ROOMY, ids=[f"{b}-{k}-{i}" for i, (b, k, _) in enumerate(ROOMY)])
def test_llm_with_random_arrivals_equals_no_cache(workload, batching, kv_cache, kwargs):
    got, sched = generate_with_arrivals(workload.llm(batching, kv_cache, **kwargs), workload, seed=len(kwargs))
    assert got == workload.expected
    assert any(entry["prefill_ids"] and entry["step"] > 0 for entry in sched.step_log)
    if batching == "continuous" and llm_chunks(kwargs):
        assert any(entry["kind"] == "mixed" for entry in sched.step_log)   # newcomers joined decodes


@pytest.mark.parametrize("batching,kv_cache,kwargs,pressure", TIGHT,
                         ids=[f"{b}-{t}-{i}" for i, (b, _, _, t) in enumerate(TIGHT)])
def test_tight_pool_equals_no_cache(workload, batching, kv_cache, kwargs, pressure):
    llm = workload.llm(batching, kv_cache, **kwargs)
    assert llm.cache.num_pages == 8
    assert outputs(llm.generate(workload.prompts, workload.params)) == workload.expected
    # async scheduling: the same tokens; a lookahead that would preempt waits for the step in flight
    overlapped = workload.llm(batching, kv_cache, async_scheduling=True, **kwargs)
    assert outputs(overlapped.generate(workload.prompts, workload.params)) == workload.expected
    log = llm.last_step_log
    if pressure == "waits":
        assert any(entry["waiting"] > 0 for entry in log), "the pool was meant to make requests wait"
        assert not any(entry["preempted"] for entry in log)
    else:
        assert any(entry["preempted"] for entry in log), "the pool was meant to force preemption"
        assert sum(entry["recomputed_tokens"] for entry in log) > 0
    # the same runner again, requests arriving between steps (preemption may or may not recur)
    assert generate_with_arrivals(llm, workload, seed=7)[0] == workload.expected


def test_request_larger_than_the_pool_is_refused_before_anything_runs(monkeypatch):
    model_dir = gen_model_dir()
    fits = [list(range(1, 11)), SamplingParams(max_new_tokens=5)]          # 14 cached tokens: 4 pages
    too_big = [list(range(1, 21)), SamplingParams(max_new_tokens=20)]      # 39 cached tokens: 10 pages
    for admission in ("conservative", "on_demand"):
        llm = LLM(model_dir, backend="numpy", max_context=64, page_size=4, kv_cache_mib=pool_mib(8, 4),
                  admission=admission)
        counter = ForwardCounter(llm.model)
        monkeypatch.setattr(llm.model, "forward", counter)
        with pytest.raises(ValueError, match="larger than the whole KV pool"):
            llm.generate([fits[0], too_big[0]], [fits[1], too_big[1]])
        assert counter.tokens == []
        # nothing was left behind: the same runner still serves a request that fits
        [result] = llm.generate([fits[0]], fits[1])
        assert len(result.token_ids) == 5 and counter.tokens
        llm.close()


def test_pool_smaller_than_one_page_is_refused():
    with pytest.raises(ValueError):
        LLM(gen_model_dir(), backend="numpy", max_context=64, page_size=16, kv_cache_mib=pool_mib(1, 8))
