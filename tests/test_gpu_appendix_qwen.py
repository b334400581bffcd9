"""Qwen on the GPU (skipped elsewhere with the reason): the fused bias + q/k-norm + RoPE kernel against
the NumPy reference, and the CuPy backend against the NumPy backend on the full-size Qwen presets.

The tiny Qwen presets also run through every check of tests/test_gpu_model.py (logits, cached decode,
serving paths); `python -m engine.kernel_bench rope` times the kernel fused and unfused.
"""
import numpy as np
import pytest

pytestmark = pytest.mark.gpu   # skipped without a usable GPU (tests/conftest.py)


def rel(a, b):
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


# (Hq, Hkv, D, bias, norm): odd head counts, D below and above a warp's 32 pairs, each variation alone
SHAPES = [(6, 2, 14, True, False), (4, 1, 16, True, False), (14, 2, 64, True, False),
          (4, 2, 24, False, True), (6, 1, 10, False, True), (16, 8, 128, False, True), (5, 5, 96, True, True)]


@pytest.mark.parametrize("Hq,Hkv,D,bias,norm", SHAPES)
@pytest.mark.parametrize("T", [1, 37])
def test_rope_qkv_bias_norm_matches_numpy(Hq, Hkv, D, bias, norm, T):
    import cupy as cp

    from engine.backend import bf16_to_f32
    from engine.formats.config import config_from_dict
    from engine.ops.rope import rope_qkv, rope_tables
    cfg = config_from_dict({"model_type": "qwen3" if norm else "qwen2", "vocab_size": 10, "hidden_size": 8,
                            "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": Hq,
                            "num_key_value_heads": Hkv, "head_dim": D, "rope_theta": 1e6, "rms_norm_eps": 1e-6})
    rng = np.random.default_rng(T * 1000 + D)
    qkv = (3 * rng.standard_normal((T, cfg.qkv_dim))).astype(np.float32)
    pos = rng.integers(0, 500, T).astype(np.int32)
    cos, sin = rope_tables(cfg, 512)
    extra = {}
    if bias:
        extra["bias"] = (0.5 * rng.standard_normal(cfg.qkv_dim)).astype(np.float32)
    if norm:
        extra["q_norm"], extra["k_norm"] = (1 + 0.2 * rng.standard_normal((2, D))).astype(np.float32)
    ref = rope_qkv(qkv, pos, cos, sin, cfg, **extra)
    pool = cp.get_default_memory_pool()
    pool.free_all_blocks()
    poison = cp.full(8 * qkv.size, 0xFFFF, dtype=cp.uint16)      # NaN bits where the output will be allocated
    del poison
    got = rope_qkv(cp.asarray(qkv), cp.asarray(pos), cp.asarray(cos), cp.asarray(sin), cfg,
                   **{k: cp.asarray(v) for k, v in extra.items()})
    got = bf16_to_f32(got.get())
    assert np.isfinite(got).all(), "an output element was never written"
    assert rel(got, ref) < 5e-3


@pytest.mark.parametrize("preset", ["qwen2.5-0.5b", "qwen3-0.6b"])
def test_full_size_qwen_cupy_matches_numpy(tmp_path, preset):
    import engine
    from engine.model.random_model import write_random_model
    model_dir = write_random_model(tmp_path / preset, preset, seed=1)
    ids = np.random.default_rng(0).integers(0, 151643, 24)
    ref = engine.load_model(model_dir, backend="numpy").logits(ids)
    got = engine.load_model(model_dir, backend="cupy").logits(ids)
    assert float(np.linalg.norm(got - ref) / np.linalg.norm(ref)) < 2e-2
    assert np.mean(got.argmax(-1) == ref.argmax(-1)) > 0.9
