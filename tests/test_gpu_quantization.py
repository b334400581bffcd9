"""Quantized models on the GPU (chapter 18): the CuPy backend, quantized on load or from an AWQ checkpoint,
against the NumPy backend's quantized model on the same weights (which equals the float32 model with the
dequantized weights: tests/test_quantization.py), through prefill, cached decode (graphs, the dequantizing
GEMV) and batched serving. Skipped without a GPU."""
import numpy as np
import pytest

from engine.runtime.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu

CASES = [("tiny", "int4", 8), ("tiny-mqa", "int8", 8), ("smollm2-135m", "int4", 64), ("smollm2-135m", "int8", 32),
         ("tiny-qwen2-mqa-untied", "int4", -1)]


@pytest.fixture(scope="module", params=sorted({preset for preset, _, _ in CASES}))
def preset_dir(request, tmp_path_factory):
    from engine.model.random_model import write_random_model
    return request.param, write_random_model(tmp_path_factory.mktemp(request.param), request.param, seed=3)


def rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_quantized_logits_and_decoding_match_numpy(preset_dir):
    import engine
    preset, model_dir = preset_dir
    for _, quantization, group in [c for c in CASES if c[0] == preset]:
        ids = np.random.default_rng(0).integers(3, 250, 40).tolist()
        ref = engine.load_model(model_dir, "numpy", quantization=quantization, group_size=group).logits(ids)
        got = engine.load_model(model_dir, "cupy", quantization=quantization, group_size=group).logits(ids)
        assert rel(got, ref) < 2e-2, (quantization, group)
        assert np.mean(got.argmax(-1) == ref.argmax(-1)) > 0.9
        # decode rows go through the dequantizing GEMV (and its CUDA graphs); batched, each request
        # keeps close to its own greedy answer on the NumPy backend
        llm = engine.LLM(model_dir, backend="cupy", max_seqs=8, max_context=128, quantization=quantization,
                         group_size=group)
        cpu = engine.LLM(model_dir, backend="numpy", max_seqs=8, max_context=128, quantization=quantization,
                         group_size=group)
        prompts = [np.random.default_rng(s).integers(3, 250, 6 + 5 * s).tolist() for s in range(6)]
        params = [SamplingParams(max_new_tokens=12, ignore_eos=True)] * len(prompts)
        got_tokens = [o.token_ids for o in llm.generate(prompts, params)]
        want_tokens = [o.token_ids for o in cpu.generate(prompts, params)]
        same = np.mean([a[:4] == b[:4] for a, b in zip(got_tokens, want_tokens, strict=True)])
        assert same >= 0.8, (quantization, got_tokens, want_tokens)     # bf16 activations may flip a near-tie
        assert llm.runner.decode_graphs.replays > 0
        llm.close()
        cpu.close()
