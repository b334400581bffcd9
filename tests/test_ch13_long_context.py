"""The model's whole context: what LLM picks by default, and prompts far longer than a step's budget.

Paged: max_context defaults to max_position_embeddings and the pool decides what fits (a request
that never could is refused at submit). Contiguous: a smaller default, each slot reserving it whole.
"""
import json

import numpy as np
import pytest
from helpers.oracle import GEN_CONFIG, gen_model_dir, greedy_no_cache

from engine.model.forward_pass import load_model
from engine.runtime.engine_config import DEFAULT_MAX_CONTEXT, default_max_context
from engine.runtime.llm import LLM
from engine.runtime.model_runner import CPU_KV_MIB, default_kv_mib
from engine.runtime.sampling_params import SamplingParams

MODEL_MAX = GEN_CONFIG["max_position_embeddings"]        # 256


def test_default_max_context_is_the_whole_context_only_when_paged():
    assert default_max_context(131072, "paged") == 131072
    assert default_max_context(131072, "contiguous") == DEFAULT_MAX_CONTEXT
    assert default_max_context(131072) == DEFAULT_MAX_CONTEXT          # ChatSession's contiguous cache
    assert default_max_context(2048, "contiguous") == 2048


def test_default_kv_pool_is_capped_by_what_the_device_can_spare():
    assert default_kv_mib(10.0, None) == 10.0
    assert default_kv_mib(1e9, None) == CPU_KV_MIB
    assert default_kv_mib(1e9, 80 * 2**30) == 40 * 1024               # half of 80 GiB free


def test_llm_defaults_follow_the_cache_kind():
    paged = LLM(gen_model_dir(), backend="numpy", kv_cache="paged")
    assert paged.max_context == paged.model.max_context == MODEL_MAX
    contiguous = LLM(gen_model_dir(), backend="numpy", kv_cache="contiguous")
    assert contiguous.max_context == min(MODEL_MAX, DEFAULT_MAX_CONTEXT)


def test_a_request_the_pool_can_never_hold_is_refused_at_submit():
    # 6 pages of 16 tokens = 96 positions, far below the 256 of the context
    per_token = 2 * GEN_CONFIG["num_hidden_layers"] * GEN_CONFIG["num_key_value_heads"] * GEN_CONFIG["head_dim"] * 4
    llm = LLM(gen_model_dir(), backend="numpy", kv_cache_mib=6 * 16 * per_token / 2**20)
    assert llm.max_context == MODEL_MAX and llm.cache.num_pages == 6
    with pytest.raises(ValueError, match="larger than the whole KV pool"):
        llm.generate([list(range(1, 101))], SamplingParams(max_new_tokens=4))
    [ok] = llm.generate([list(range(1, 81))], SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert len(ok.token_ids) == 4


@pytest.mark.slow
@pytest.mark.parametrize("batching", ["continuous", "static"])
def test_prompts_of_many_budgets_match_the_no_cache_oracle(batching):
    """Prompts of 150-230 tokens through a 32-token budget: 5-8 chunks each, next to running decodes."""
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, GEN_CONFIG["vocab_size"], n).tolist() for n in (230, 12, 150, 5)]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (6, 20, 5, 9)]
    llm = LLM(gen_model_dir(), backend="numpy", batching=batching, max_seqs=4, max_batch_tokens=32)
    got = [r.token_ids for r in llm.generate(prompts, params)]
    model = load_model(gen_model_dir(), backend="numpy")
    assert got == [greedy_no_cache(model, p, sp.max_new_tokens, ignore_eos=True)[0]
                   for p, sp in zip(prompts, params, strict=True)]
    log = llm.last_step_log
    assert max(entry["tokens"] for entry in log) <= 32
    assert sum(1 for entry in log for chunk in entry["chunks"] if chunk[0] == 0) >= 230 // 32
    if batching == "continuous":     # the short requests kept decoding while the long ones prefilled
        assert any(entry["kind"] == "mixed" for entry in log)


@pytest.mark.slow
def test_bench_long_context_scenarios_run_on_the_cpu(capsys):
    from engine.bench import run as bench
    bench.main(["--preset", "tiny", "--backend", "numpy", "--scenario", "long-prefill", "chunked-itl",
                "--lengths", "40", "--long-new-tokens", "4", "--max-batch-tokens", "16", "--itl-requests", "3",
                "--itl-prompt-len", "8", "--long-prompt", "48"])
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    [prefill] = [r for r in records if r["scenario"] == "long-prefill"]
    assert prefill["prompt_len"] == 40 and prefill["llm_prefill_steps"] == 3 and prefill["forward_ms"] > 0
    assert prefill["llm_decode_ms_per_token"] > 0
    itl = {r["chunked_prefill"]: r for r in records if r["scenario"] == "chunked-itl"}
    assert itl[True]["steps_to_first_token"] == 4 and itl[False]["steps_to_first_token"] == 1
    assert all(itl[c]["itl_p99_ms"] >= itl[c]["itl_p50_ms"] > 0 for c in itl)


def test_inter_token_latencies_take_the_gaps_that_end_in_the_window():
    from engine.bench.run import inter_token_latencies
    times = {0: [1.0, 2.0, 4.0], 1: [1.5, 5.0]}
    assert sorted(inter_token_latencies(times, 1.9, 4.5)) == [1.0, 2.0]
