"""The per-op profile of one decode step (engine/bench/step_profile.py) and the bench entries that use it."""
import json

import numpy as np
import pytest

import engine.model.forward_pass as model_module
from engine.bench.step_profile import TIMED, OpTimer, decode_batch_for, profile_decode, profile_records
from engine.model.forward_pass import load_model
from engine.model.kv_cache import KVCache
from engine.model.random_model import write_random_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_random_model(tmp_path_factory.mktemp("tiny"), "tiny", seed=2)


def test_timed_ops_change_nothing_and_restore(tiny_dir):
    model = load_model(tiny_dir, backend="numpy", max_context=64)
    cfg = model.config
    fb = decode_batch_for(3, 20, 4, cfg.vocab_size)
    before = {name: getattr(model_module, name) for name in TIMED}
    ref = model.forward(fb, KVCache(cfg, 15, 4, "numpy"))
    timer = OpTimer(model, context_tokens=3 * 20)
    with timer.timed_ops():
        got = model.forward(fb, KVCache(cfg, 15, 4, "numpy"))
    np.testing.assert_array_equal(got, ref)
    assert {name: getattr(model_module, name) for name in TIMED} == before
    table, total = timer.table()
    calls = {row["kernel"]: row["calls"] for row in table}
    L = cfg.num_hidden_layers
    assert calls == {"embedding": 1, "rmsnorm": 1, "linear qkv": L, "rope_qkv": L, "kv_write": L,
                     "paged_attention": L, "linear o": L, "add_rmsnorm": 2 * L, "linear gate_up": L,
                     "swiglu": L, "linear down": L, "lm_head": 1}
    qkv = next(row for row in table if row["kernel"] == "linear qkv")
    H = cfg.hidden_size
    assert qkv["bytes"] == L * (cfg.qkv_dim * H * 4 + 3 * H * 4 + 3 * cfg.qkv_dim * 4)
    assert total == pytest.approx(sum(row["ms"] for row in table))
    timeline = timer.timeline()
    assert len(timeline) == sum(calls.values()) and timeline[0][1] == 0
    assert all(start <= end for _, start, end in timeline)
    assert all(a[2] <= b[1] + 1e-9 for a, b in zip(timeline, timeline[1:], strict=False))   # one op after the other


def test_profile_records(tiny_dir):
    model = load_model(tiny_dir, backend="numpy", max_context=64)
    result = profile_decode(model, rows=2, context=30, page_size=4, reps=3)
    records = profile_records(result, copy_gbps=10.0)
    ops, total = records[:-1], records[-1]
    assert [r["ms"] for r in ops] == sorted((r["ms"] for r in ops), reverse=True)
    assert sum(r["pct_of_step"] for r in ops) == pytest.approx(100, abs=1)
    assert total["bytes"] == sum(r["bytes"] for r in ops)
    assert total["floor_ms"] == pytest.approx(total["bytes"] / 10e9 * 1e3, rel=1e-3)
    assert total["eager_step_ms"] > 0 and "graph_step_ms" not in total      # no graphs on the CPU
    for r in ops:
        assert r["gbps"] == pytest.approx(r["bytes"] / (r["ms"] * 1e-3) / 1e9, rel=0.02, abs=0.1)


@pytest.mark.slow
def test_bench_profile_and_oversubscribed(tiny_dir, tmp_path, capsys):
    from engine.bench.run import main
    out = tmp_path / "profile.json"
    assert main(["--model", str(tiny_dir), "--backend", "numpy", "--scenario", "serve-oversubscribed",
                 "--max-context", "64", "--profile", "--profile-batches", "1", "3", "--profile-context", "20",
                 "--profile-json", str(out), "--oversub-requests", "7", "--oversub-max-seqs", "2",
                 "--min-len", "3", "--max-len", "8"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    profiles = [r for r in lines if r["scenario"] == "profile"]
    assert {r["batch"] for r in profiles} == {1, 3}
    saved = json.loads(out.read_text())
    assert [s["batch"] for s in saved["steps"]] == [1, 3] and saved["steps"][0]["timeline"]
    serve = [r for r in lines if r["scenario"] == "serve-oversubscribed"]
    assert [r["mode"] for r in serve] == ["static+contiguous", "static+paged", "continuous+contiguous",
                                          "continuous+paged"]
    assert all(r["requests"] == 7 and r["max_running"] <= 2 for r in serve)
    assert len({r["output_tokens"] for r in serve}) == 1


@pytest.mark.gpu
def test_profile_on_gpu(tiny_dir):
    model = load_model(tiny_dir, backend="cupy", max_context=128)
    result = profile_decode(model, rows=4, context=100, reps=3)
    records = profile_records(result, copy_gbps=1000.0)
    total = records[-1]
    assert total["ms"] > 0 and total["graph_step_ms"] is not None and total["graph_step_ms"] > 0
    assert all(r["ms"] > 0 for r in records)


def test_the_serving_floor_counts_bytes_and_flops_of_each_step():
    from engine.bench.run import step_floor_seconds
    from engine.formats.config import config_from_dict
    from engine.model.random_model import PRESETS
    cfg = config_from_dict(PRESETS["llama-3.2-1b"])            # tied embeddings
    head = cfg.vocab_size * cfg.hidden_size
    layers = cfg.num_parameters() - head
    decode = {"context_tokens": 64 * 1000, "tokens": 64, "sampled": 64}
    want = (cfg.num_parameters() * 2 + 64 * 1000 * cfg.kv_bytes_per_token(2)) / 4000e9    # memory-bound
    assert step_floor_seconds([decode], cfg, 2, 4000, 800) == pytest.approx(want)
    prefill = {"context_tokens": 8192, "tokens": 8192, "sampled": 1}                     # compute-bound
    want = (2 * layers * 8192 + 2 * head) / 800e12
    assert step_floor_seconds([prefill], cfg, 2, 4000, 800) == pytest.approx(want)
    assert step_floor_seconds([decode, prefill], cfg, 2, 4000, 800) == pytest.approx(
        step_floor_seconds([decode], cfg, 2, 4000, 800) + want)


def test_a_hybrid_models_floor_reads_and_writes_each_rows_states():
    """Qwen3.5: the full-attention layers' K/V per token, and each row's fixed-size recurrent states
    (18 layers of a 16 x 128 x 128 delta-rule state and a conv window) read and written once."""
    from engine.bench.run import step_floor_seconds
    from engine.formats.config import config_from_dict
    from engine.model.random_model import PRESETS
    cfg = config_from_dict(PRESETS["qwen3.5-0.8b"])
    assert cfg.state_bytes_per_sequence == 4 * 18 * (3 * cfg.conv_dim + 16 * 128 * 128)
    decode = {"context_tokens": 64 * 1000, "tokens": 64, "sampled": 64, "rows": 64}
    weights = cfg.num_parameters() * 2
    want = (weights + 64 * 1000 * cfg.kv_bytes_per_token(2) + 64 * 2 * cfg.state_bytes_per_sequence) / 4000e9
    assert step_floor_seconds([decode], cfg, 2, 4000, 800) == pytest.approx(want)


def test_a_hybrid_models_ops_are_timed_by_name_and_restored(tmp_path):
    """OpTimer names a Qwen3.5 model's projections (qkvg/o, in_proj/out) and times the ops of another module
    the pass calls (engine/model/hybrid_forward.py), changing nothing (notes/measurements/hybrid_prefill_profile.py)."""
    import engine.model.hybrid_forward as hybrid_module
    from engine.model.forward_pass import ForwardBatch
    model = load_model(write_random_model(tmp_path / "q35", "tiny-qwen3.5", seed=2), backend="numpy")
    batch = ForwardBatch.single(np.arange(3, 40, dtype=np.int32))
    names = ("linear", "linear_attention", "gated_attention", "swiglu")
    before = {name: getattr(hybrid_module, name) for name in names}
    ref = model.forward(batch)
    timer = OpTimer(model)
    with timer.timed_ops(hybrid_module, names):
        got = model.forward(batch)
    np.testing.assert_array_equal(got, ref)
    assert {name: getattr(hybrid_module, name) for name in names} == before
    calls = {row["kernel"]: row["calls"] for row in timer.table()[0]}
    kinds = model.config.layer_types
    n_linear, n_full = kinds.count("linear_attention"), kinds.count("full_attention")
    assert calls == {"linear in_proj": n_linear, "linear out": n_linear, "linear_attention": n_linear,
                     "linear qkvg": n_full, "linear o": n_full, "gated_attention": n_full,
                     "linear gate_up": len(kinds), "swiglu": len(kinds), "linear down": len(kinds), "lm_head": 1}
