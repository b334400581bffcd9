"""GPU side of the hostile corpus (run on a CUDA machine; skipped elsewhere with the reason):
the embedding gather never reads past its table, non-finite logits are refused on the device path,
and non-finite weights (including F32 values that overflow bf16) are refused at load.

For the memory checker: compute-sanitizer --tool memcheck python -m pytest -m gpu tests/test_gpu_hostile.py
"""
import numpy as np
import pytest

pytestmark = pytest.mark.gpu   # skipped without a usable GPU (tests/conftest.py)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from engine.model.random_model import write_random_model
    return write_random_model(tmp_path_factory.mktemp("tiny"), "tiny", seed=3)


@pytest.mark.parametrize("H", [72, 577])          # even (bf16x2 path) and odd (scalar path) rows
def test_embedding_gather_never_reads_past_the_table(H):
    import cupy as cp

    from engine.backend import f32_to_bf16
    from engine.ops.embedding import embedding
    V = 301
    table_h = np.random.default_rng(0).standard_normal((V, H)).astype(np.float32)
    table = cp.asarray(f32_to_bf16(table_h))
    ids_h = np.array([0, -1, V - 1, V, 2**31 - 1, -(2**31), 17], dtype=np.int32)
    out = embedding(cp.asarray(ids_h), table).get()                     # device ids: no host check possible
    bad = (ids_h < 0) | (ids_h >= V)
    assert np.isnan(out[bad]).all()
    want = (f32_to_bf16(table_h[ids_h[~bad]]).astype(np.uint32) << 16).view(np.float32)
    np.testing.assert_array_equal(out[~bad], want)
    with pytest.raises(ValueError, match="token ids"):
        embedding(ids_h, table)                                          # host ids: refused up front


def test_out_of_range_device_id_ends_in_a_named_error(tiny_dir):
    import cupy as cp

    from engine.model.forward_pass import load_model
    from engine.ops.sampling import NonFiniteLogitsError, sample
    from engine.runtime.sampling_params import SamplingParams
    model = load_model(tiny_dir, backend="cupy", max_context=64)
    ids = cp.asarray(np.array([5, 9, 100000], dtype=np.int32))         # past the 397-row table
    pos = cp.arange(3, dtype=cp.int32)
    logits = model.run(ids, pos, np.array([0, 3], dtype=np.int32))
    clean = model.run(ids[:2], pos[:2], np.array([0, 2], dtype=np.int32))
    for params in (SamplingParams(), SamplingParams(temperature=0.9, seed=1)):
        with pytest.raises(NonFiniteLogitsError, match="request 4, step 0"):
            sample(logits[2:], [params], [0.3], labels=["request 4, step 0"])
        # the next batch without the bad id is served (a NaN row poisons its own batch only: masked keys
        # still enter attention's P V product as 0 * NaN, so earlier rows of that batch are not trusted)
        assert sample(clean[1:], [params], [0.3]).shape == (1,)


@pytest.mark.parametrize("poison", [np.nan, np.inf])
def test_gpu_sampler_refuses_non_finite_rows_and_agrees_on_finite_ones(poison):
    import cupy as cp

    from engine.ops.sampling import NonFiniteLogitsError, sample
    from engine.runtime.sampling_params import SamplingParams
    logits = np.random.default_rng(1).standard_normal((4, 1000)).astype(np.float32) * 3
    greedy = [SamplingParams()] * 4
    np.testing.assert_array_equal(sample(cp.asarray(logits), greedy, [0.0] * 4), sample(logits, greedy, [0.0] * 4))
    logits[2, 999] = poison
    for params in (greedy, [SamplingParams(temperature=1.0, top_p=0.9, seed=2)] * 4):
        with pytest.raises(NonFiniteLogitsError, match="row 2"):
            sample(cp.asarray(logits), params, [0.5] * 4)


def test_llm_on_gpu_names_the_request_and_keeps_serving(tiny_dir, monkeypatch):
    from engine.ops.sampling import NonFiniteLogitsError
    from engine.runtime.llm import LLM
    from engine.runtime.sampling_params import SamplingParams
    llm = LLM(tiny_dir, backend="cupy", max_context=64, kv_cache_mib=16)
    forward = llm.model.forward

    def poisoned(batch, cache=None):
        out = forward(batch, cache)
        out[-1, 0] = float("nan")
        return out
    monkeypatch.setattr(llm.model, "forward", poisoned)
    with pytest.raises(NonFiniteLogitsError, match=r"request \d+, step 0"):
        llm.generate([[1, 2, 3]], SamplingParams(max_new_tokens=3))
    monkeypatch.setattr(llm.model, "forward", forward)
    assert len(llm.generate([[1, 2, 3]], SamplingParams(max_new_tokens=3, ignore_eos=True))[0].token_ids) == 3


@pytest.mark.parametrize("dtype, value", [("BF16", np.nan), ("F32", 3.4e38)])   # 3.4e38 rounds to bf16 inf
def test_gpu_load_refuses_non_finite_weights(tmp_path, dtype, value):
    from engine.formats.config import load_config
    from engine.formats.safetensors import save_file
    from engine.model.forward_pass import load_model
    from engine.model.random_model import random_weights, write_random_model
    from engine.model.weights import NonFiniteWeightsError
    model_dir = write_random_model(tmp_path / "m", "tiny", seed=4)
    tensors = random_weights(load_config(model_dir), seed=4)
    tensors["model.layers.0.self_attn.v_proj.weight"].flat[3] = value
    save_file(tensors, model_dir / "model.safetensors", dtype=dtype)
    with pytest.raises(NonFiniteWeightsError, match="v_proj"):
        load_model(model_dir, backend="cupy")
