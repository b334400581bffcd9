"""Qwen3.5 on a GPU (skipped elsewhere with the reason): the hybrid model's CuPy forward pass against the
NumPy backend. Its two gates and the partial-rotary q/k pass against their references; the whole model
(tiny configs with odd head counts and dims, and Qwen3.5-0.8B's shape); the engine serving it on every
path (graphs on and off, async scheduling, static batching, a contiguous cache, prompts in chunks,
preemption), the state slots of the device pools, and a learner's delta rule plugged into the GPU model.

    python -m pytest -m gpu tests/test_gpu_appendix_linear_attention_model.py
"""
import numpy as np
import pytest

from engine.model.random_model import PRESETS

pytestmark = pytest.mark.gpu   # skipped without a usable GPU (tests/conftest.py)

# the GPU's paged kernels take power-of-two head dims: the second tiny config is the MQA/untied one with 32
GPU_CONFIGS = {"tiny-qwen3.5": PRESETS["tiny-qwen3.5"],
               "tiny-qwen3.5-mqa-untied-d32": {**PRESETS["tiny-qwen3.5-mqa-untied"], "head_dim": 32}}


def rel(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - b)) / max(np.max(np.abs(b)), 1e-30))


def poisoned_pool():
    """Fill the memory the next allocations reuse with NaN bits: an element never written shows."""
    import cupy as cp
    cp.get_default_memory_pool().free_all_blocks()
    poison = cp.full(1 << 22, 0xFFFF, dtype=cp.uint16)
    del poison


# ------------------------------------------------------------------------------ the new kernels

@pytest.mark.parametrize("T,Hv,Dv", [(1, 16, 128), (37, 3, 10), (200, 6, 40)])
def test_gated_rmsnorm_kernel_matches_numpy(T, Hv, Dv):
    import cupy as cp

    from engine.backend import bf16_to_f32
    from engine.ops.gated_delta import gated_rmsnorm_gpu, gated_rmsnorm_ref
    rng = np.random.default_rng(T)
    o = (3 * rng.standard_normal((T, Hv * Dv))).astype(np.float32)
    proj = rng.standard_normal((T, Hv * Dv + 11)).astype(np.float32)          # z: a strided column slice
    w = (1 + 0.3 * rng.standard_normal(Dv)).astype(np.float32)
    want = gated_rmsnorm_ref(o.reshape(T, Hv, Dv), proj[:, 5:5 + Hv * Dv].reshape(T, Hv, Dv), w, 1e-6)
    poisoned_pool()
    dev = cp.asarray(proj)
    got = bf16_to_f32(gated_rmsnorm_gpu(cp.asarray(o), dev[:, 5:5 + Hv * Dv], cp.asarray(w), 1e-6).get())
    assert np.isfinite(got).all(), "an output element was never written"
    assert rel(got, want.reshape(T, -1)) < 8e-3


@pytest.mark.parametrize("T,n", [(1, 2048), (45, 96), (300, 640)])
def test_attention_output_gate_kernel_matches_numpy(T, n):
    import cupy as cp

    from engine.backend import bf16_to_f32, f32_to_bf16
    from engine.ops.gated_delta import attention_output_gate_gpu, sigmoid
    rng = np.random.default_rng(n)
    attn = f32_to_bf16(rng.standard_normal((T, n)).astype(np.float32))
    qkvg = (4 * rng.standard_normal((T, n + 40))).astype(np.float32)
    want = bf16_to_f32(attn) * sigmoid(qkvg[:, 40:])
    poisoned_pool()
    got = bf16_to_f32(attention_output_gate_gpu(cp.asarray(attn), cp.asarray(qkvg)[:, 40:]).get())
    assert np.isfinite(got).all(), "an output element was never written"
    assert rel(got, want) < 8e-3


# (Hq, Hkv, D, rotary fraction): Qwen3.5-0.8B's heads, odd counts, rotary widths below and at a warp's 32 pairs
ROPE = [(8, 2, 256, 0.25), (3, 1, 32, 0.4), (4, 2, 16, 0.25), (5, 5, 64, 1.0), (6, 2, 128, 0.5)]


@pytest.mark.parametrize("Hq,Hkv,D,fraction", ROPE)
@pytest.mark.parametrize("T", [1, 29])
def test_partial_rope_kernel_matches_numpy(Hq, Hkv, D, fraction, T):
    import cupy as cp

    from engine.backend import bf16_to_f32
    from engine.formats.config import config_from_dict
    from engine.ops.rope import rope_qk_norm_partial, rope_tables
    cfg = config_from_dict({**PRESETS["tiny-qwen3.5"], "num_attention_heads": Hq, "num_key_value_heads": Hkv,
                            "head_dim": D, "rope_parameters": {"rope_type": "default", "rope_theta": 1e7,
                                                               "partial_rotary_factor": fraction}})
    rng = np.random.default_rng(T * 7 + D)
    qkvg = (3 * rng.standard_normal((T, 2 * cfg.q_dim + 2 * cfg.kv_dim))).astype(np.float32)   # q | k | v | gate
    pos = rng.integers(0, 500, T).astype(np.int32)
    cos, sin = rope_tables(cfg, 512)
    qn, kn = (1 + 0.2 * rng.standard_normal((2, D))).astype(np.float32)
    want = rope_qk_norm_partial(qkvg, pos, cos, sin, cfg, qn, kn)
    poisoned_pool()
    got = rope_qk_norm_partial(*(cp.asarray(a) for a in (qkvg, pos, cos, sin)), cfg, cp.asarray(qn), cp.asarray(kn))
    got = bf16_to_f32(got.get())
    assert np.isfinite(got).all(), "an output element was never written"
    assert rel(got, want) < 5e-3


# ------------------------------------------------------------------------------ the whole model

@pytest.fixture(scope="module", params=sorted(GPU_CONFIGS))
def model_dir(request, tmp_path_factory):
    from engine.model.random_model import write_random_model
    return write_random_model(tmp_path_factory.mktemp(request.param), GPU_CONFIGS[request.param], seed=3)


def test_cupy_logits_match_numpy(model_dir):
    import engine
    from engine.model.forward_pass import ForwardBatch
    ids = np.random.default_rng(0).integers(0, 200, 90)
    ref = engine.load_model(model_dir, backend="numpy").logits(ids)
    model = engine.load_model(model_dir, backend="cupy")
    got = model.logits(ids)
    assert rel(got, ref) < 2e-2
    assert np.mean(got.argmax(-1) == ref.argmax(-1)) > 0.9
    # two packed sequences: each its own state slot, as if alone
    a, b = ids[:30], ids[30:71]
    packed = ForwardBatch(np.concatenate([a, b]), np.concatenate([np.arange(30), np.arange(41)]).astype(np.int32),
                          np.array([0, 30, 71], dtype=np.int32))
    out = model.forward(packed).get()
    assert rel(out[:30], got[:30]) < 1e-5
    assert rel(out[30:], model.logits(b)) < 1e-5


def test_cached_decode_matches_recompute(model_dir):
    """The engine's greedy tokens (prefill into the state, then recurrent decode steps) are near-greedy
    under the full recomputation by the chunked kernel (bf16 near-ties)."""
    import engine
    from engine.runtime.llm import LLM
    ids = list(np.random.default_rng(1).integers(0, 200, 40))
    llm = LLM(model_dir, backend="cupy", max_context=128, max_seqs=2)
    toks = llm.generate([ids], engine.SamplingParams(max_new_tokens=16, ignore_eos=True))[0].token_ids
    full = llm.model.logits(ids + toks[:-1])
    for i, t in enumerate(toks):
        row = full[len(ids) - 1 + i]
        assert row[t] >= row.max() - 0.05 * (row.max() - row.mean()), (i, t, int(row.argmax()))


PATHS = {   # (batching, kv_cache, settings)
    "graphs": ("continuous", "paged", dict(cuda_graphs=True)),
    "eager": ("continuous", "paged", dict(cuda_graphs=False)),
    "sync": ("continuous", "paged", dict(cuda_graphs=True, async_scheduling=False)),
    "chunks": ("continuous", "paged", dict(cuda_graphs=True, max_batch_tokens=8, page_size=4)),
    "static": ("static", "paged", dict(cuda_graphs=False)),
    "contiguous": ("continuous", "contiguous", dict(cuda_graphs=True)),
}


def test_serving_paths_and_graphs_agree(model_dir):
    import engine
    from engine.runtime.llm import LLM
    rng = np.random.default_rng(2)
    prompts = [list(rng.integers(3, 200, n)) for n in (5, 33, 1, 64, 9, 20)]
    params = [engine.SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (8, 3, 12, 6, 10, 7)]
    outs = {}
    for name, (batching, kv, settings) in PATHS.items():
        llm = LLM(model_dir, backend="cupy", batching=batching, kv_cache=kv, max_context=128, max_seqs=3, **settings)
        outs[name] = [r.token_ids for r in llm.generate(prompts, params)]
        if settings.get("cuda_graphs"):
            assert llm.decode_graphs.replays > 0, f"{name}: no decode step was replayed"
        assert len(llm.runner.recurrent) == 0, f"{name}: finished requests still hold state slots"
    # a replayed graph runs the same kernels as an eager decode step, from the same states
    assert outs["graphs"] == outs["eager"] == outs["sync"]
    agree = np.mean([a == b for v in outs.values() for a, b in zip(v, outs["eager"], strict=True)])
    assert agree >= 0.8, outs


def test_preemption_and_slot_reuse(model_dir):
    """A pool of 8 pages of 4 tokens and more requests than seats: preempted requests recompute their
    state in a slot taken back from them; every request's tokens equal those of a roomy engine."""
    import engine
    from engine.formats.config import load_config
    from engine.runtime.llm import LLM
    rng = np.random.default_rng(4)
    prompts = [list(rng.integers(3, 200, n)) for n in (7, 12, 3, 9, 14, 5, 11)]
    params = [engine.SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (9, 6, 12, 8, 4, 10, 7)]
    roomy = LLM(model_dir, backend="cupy", max_context=64, max_seqs=3, cuda_graphs=False)
    want = [r.token_ids for r in roomy.generate(prompts, params)]
    mib = 8 * 4 * load_config(model_dir).kv_bytes_per_token(2) / 2**20
    tight = LLM(model_dir, backend="cupy", max_context=64, max_seqs=3, page_size=4, kv_cache_mib=mib,
                admission="on_demand", cuda_graphs=False)
    got = [r.token_ids for r in tight.generate(prompts, params)]
    assert sum(len(s["preempted"]) for s in tight.last_step_log) > 0, "the workload never preempted"
    assert got == want


def test_a_learners_delta_rule_runs_inside_the_gpu_model(model_dir):
    import engine
    from engine.ops.gated_delta import gated_delta_chunked_ref, gated_delta_recurrent_ref
    model = engine.load_model(model_dir, backend="cupy", max_context=128)
    ids = list(range(3, 50))
    want = model.logits(ids)

    def mine(q, k, v, g, beta, state):
        rule = gated_delta_recurrent_ref if q.shape[0] == 1 else gated_delta_chunked_ref
        return rule(q, k, v, g, beta, state)
    with engine.use_stage("gated_delta", mine):
        got = model.logits(ids)
    assert rel(got, want) < 2e-3


def test_full_size_qwen3_5_cupy_matches_numpy(tmp_path):
    """Qwen3.5-0.8B's shape (24 layers, 18 of them Gated DeltaNet with 16 heads of 128; head_dim 256
    with a quarter rotary) with random weights."""
    import engine
    from engine.model.random_model import write_random_model
    model_dir = write_random_model(tmp_path / "qwen3.5-0.8b", "qwen3.5-0.8b", seed=1)
    ids = np.random.default_rng(0).integers(0, 248000, 40)
    ref = engine.load_model(model_dir, backend="numpy").logits(ids)
    got = engine.load_model(model_dir, backend="cupy").logits(ids)
    assert rel(got, ref) < 2e-2
    assert np.mean(got.argmax(-1) == ref.argmax(-1)) > 0.9
    # decode at the real shape (the paged kernel at head_dim 256, the recurrent kernel on 16 x 128 x 128
    # states, graphs): near-greedy under the model's own full recomputation
    from engine.runtime.llm import LLM
    llm = LLM(model_dir, backend="cupy", max_context=256, max_seqs=4)
    toks = llm.generate([ids.tolist()], engine.SamplingParams(max_new_tokens=12, ignore_eos=True))[0].token_ids
    assert llm.decode_graphs.replays > 0
    full = llm.model.logits(ids.tolist() + toks[:-1])
    for i, t in enumerate(toks):
        row = full[len(ids) - 1 + i]
        assert row[t] >= row.max() - 0.05 * (row.max() - row.mean()), (i, t, int(row.argmax()))
