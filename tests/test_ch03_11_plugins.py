"""engine.use_stage: a learner's stage replaces the engine's inside the real model, and only inside the block."""
import re
import threading

import numpy as np
import pytest

import engine
from engine import plugins
from engine.ops.attention import causal_attention_ref
from engine.ops.embedding import embedding_ref
from engine.ops.kv_write import kv_write_ref
from engine.ops.paged_attention import paged_attention_ref
from engine.ops.rmsnorm import add_rmsnorm_ref, rmsnorm_ref
from engine.ops.rope import rope_ref
from engine.ops.sampling import sample_ref
from engine.ops.swiglu import swiglu_ref
from engine.runtime.sampling_params import SamplingParams

IDS = [5, 17, 3, 99, 250, 42, 7]

# A correct copy of every stage (calls counted), in the NumPy signature engine/plugins.py documents.
CORRECT = {
    "embedding": embedding_ref, "rmsnorm": rmsnorm_ref, "add_rmsnorm": add_rmsnorm_ref, "rope": rope_ref,
    "attention": causal_attention_ref, "swiglu": swiglu_ref, "sampling": sample_ref, "kv_write": kv_write_ref,
    "paged_attention": paged_attention_ref,
}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from engine.model.random_model import write_random_model
    return write_random_model(tmp_path_factory.mktemp("tiny"), "tiny", seed=3)


@pytest.fixture(scope="module")
def model(tiny_dir):
    return engine.load_model(tiny_dir, backend="numpy", max_context=128)


def counted(fn, calls: list):
    def wrapper(*args):
        calls.append(1)
        return fn(*args)
    return wrapper


@pytest.mark.parametrize("stage", ["embedding", "rmsnorm", "add_rmsnorm", "rope", "attention", "swiglu"])
def test_a_correct_stage_runs_inside_logits_and_changes_nothing(model, stage):
    want = model.logits(IDS)
    calls = []
    with engine.use_stage(stage, counted(CORRECT[stage], calls)):
        got = model.logits(IDS)
    assert calls, f"{stage} override was never called"
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert not plugins.any_active()


@pytest.mark.parametrize("stage", ["sampling", "kv_write", "paged_attention", "rmsnorm"])
def test_a_correct_stage_runs_inside_llm_generate(tiny_dir, stage):
    llm = engine.LLM(tiny_dir, backend="numpy", max_context=128, max_seqs=2)
    prompts = [IDS, IDS[:3], IDS[2:]]
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    want = [r.token_ids for r in llm.generate(prompts, params)]
    calls = []
    with engine.use_stage(stage, counted(CORRECT[stage], calls)):
        got = [r.token_ids for r in llm.generate(prompts, params)]
    assert calls and got == want


def test_a_wrong_stage_changes_the_model_and_leaving_the_block_restores_it(model):
    want = model.logits(IDS)
    with engine.use_stage("swiglu", lambda gate_up: 2 * swiglu_ref(gate_up)):
        wrong = model.logits(IDS)
    assert not np.allclose(wrong, want, atol=1e-3)
    np.testing.assert_array_equal(model.logits(IDS), want)


def test_rmsnorm_alone_also_replaces_the_fused_add_rmsnorm(model):
    """An overridden stage runs unfused: add_rmsnorm becomes residual += delta, then your rmsnorm."""
    calls = []
    with engine.use_stage("rmsnorm", counted(rmsnorm_ref, calls)):
        model.logits(IDS)
    layers = model.config.num_hidden_layers
    assert len(calls) == 1 + 2 * layers        # the first norm, then two per layer (the last is the final norm)


def test_the_block_restores_the_override_it_replaced_and_exceptions_leave_nothing(model):
    outer, inner = [], []
    with engine.use_stage("swiglu", counted(swiglu_ref, outer)):
        with engine.use_stage("swiglu", counted(swiglu_ref, inner)):
            model.logits(IDS)
        model.logits(IDS)
    assert len(inner) == len(outer) == model.config.num_hidden_layers
    with pytest.raises(ZeroDivisionError), engine.use_stage("swiglu", lambda g: 1 / 0):
        model.logits(IDS)
    assert not plugins.any_active()


def test_bad_overrides_are_refused_with_a_clear_error(model):
    with pytest.raises(plugins.PluginError, match="unknown stage 'layernorm'"), engine.use_stage("layernorm", abs):
        pass
    with pytest.raises(plugins.PluginError, match="exactly one"), engine.use_stage("rmsnorm"):
        pass
    with pytest.raises(plugins.PluginError, match="callable"), engine.use_stage("rmsnorm", 3):
        pass
    with pytest.raises(plugins.PluginError, match=r"returned shape \(7, 8\)"):
        with engine.use_stage("rmsnorm", lambda x, w, eps: np.zeros((7, 8))):
            model.logits(IDS)
    assert issubclass(plugins.PluginError, ValueError)


def test_a_cuda_override_on_the_numpy_backend_says_so(model):
    """(Registered directly: compiling needs CuPy, which a CPU machine may not have.)"""
    plugins.OVERRIDES["swiglu"] = plugins.Override("swiglu", source="...", kernel_name="swiglu")
    try:
        with pytest.raises(plugins.PluginError, match="cupy backend"):
            model.logits(IDS)
    finally:
        del plugins.OVERRIDES["swiglu"]


def test_every_stage_documents_its_function_and_kernel():
    for name, stage in plugins.STAGES.items():
        assert stage.function.startswith("fn(") and "<<<" in stage.kernel, name
        assert name in plugins.__doc__


def test_overrides_are_process_wide_and_visible_from_other_threads(model):
    calls = []
    with engine.use_stage("swiglu", counted(swiglu_ref, calls)):
        t = threading.Thread(target=model.logits, args=(IDS,))
        t.start()
        t.join()
    assert len(calls) == model.config.num_hidden_layers


# ---------------------------------------------------------------------------------------------- GPU

def _engine_source(stage: str) -> tuple[str, str]:
    """The engine's own kernel source for a stage: plugged back in, it must reproduce the engine."""
    kernels_stage, name = plugins.STAGES[stage].engine_kernel
    from engine.backend import kernel_path
    return kernel_path(kernels_stage).read_text(), name


@pytest.mark.gpu
@pytest.mark.parametrize("stage", ["embedding", "rmsnorm", "add_rmsnorm", "rope", "attention", "swiglu"])
def test_gpu_cuda_source_of_the_engine_reproduces_the_engine(tiny_dir, stage):
    model = engine.load_model(tiny_dir, backend="cupy", max_context=128)
    want = model.logits(IDS)
    source, name = _engine_source(stage)
    with engine.use_stage(stage, cuda_source=source, kernel=name):
        got = model.logits(IDS)
    if stage == "attention":
        # the engine prefills with the flash kernel; an attention override runs chapter 06's path
        # (cuBLAS + your softmax), so the two agree to bf16 rounding, not bit for bit
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-2
        assert np.mean(got.argmax(-1) == want.argmax(-1)) > 0.9
        return
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("stage", ["kv_write", "paged_attention", "sampling", "rmsnorm"])
def test_gpu_cuda_source_runs_inside_generate_and_the_chat(tiny_dir, stage):
    from engine.runtime.chat_session import ChatSession
    llm = engine.LLM(tiny_dir, backend="cupy", max_context=128, max_seqs=2)
    prompts = [IDS, IDS[:3], IDS[2:]]
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    want = [r.token_ids for r in llm.generate(prompts, params)]
    chat_want = list(ChatSession(llm.model).stream(IDS, params))
    source, name = _engine_source(stage)
    # rename the kernel's definition (after `void` and any __launch_bounds__): the launch must reach OUR module
    broken = re.sub(rf"(__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s+)?){name}\(", rf"\g<1>{name}_unused(",
                    source, count=1)
    assert broken != source
    with engine.use_stage(stage, cuda_source=source, kernel=name) as plug:
        got = [r.token_ids for r in llm.generate(prompts, params)]
        chat_got = list(ChatSession(llm.model).stream(IDS, params))    # eager steps: no CUDA graph
    assert plug._kernels, "the learner's kernel was never compiled/launched"
    assert got == want and chat_got == chat_want
    with pytest.raises(plugins.PluginError, match="no kernel named"):
        with engine.use_stage(stage, cuda_source=broken, kernel=name):
            llm.generate(prompts, params)


@pytest.mark.gpu
def test_gpu_numpy_function_runs_on_the_gpu_backend_and_cache_stages_refuse(tiny_dir):
    model = engine.load_model(tiny_dir, backend="cupy", max_context=128)
    want = model.logits(IDS)
    with engine.use_stages({"rmsnorm": rmsnorm_ref, "add_rmsnorm": add_rmsnorm_ref, "swiglu": swiglu_ref,
                            "rope": rope_ref, "attention": causal_attention_ref, "embedding": embedding_ref}):
        got = model.logits(IDS)
    assert float(np.linalg.norm(got - want) / np.linalg.norm(want)) < 2e-2
    llm = engine.LLM(tiny_dir, backend="cupy", max_context=128, max_seqs=2)
    with pytest.raises(plugins.PluginError, match="NumPy backend only"), engine.use_stage("kv_write", kv_write_ref):
        llm.generate([IDS], SamplingParams(max_new_tokens=3))
