"""A hostile corpus for everything that reaches the model before a token is generated: config.json in
both layouts, checkpoints that disagree with it, non-finite weights, absurd sizes, constructor
arguments, tokenizers larger than the embedding table, token ids and non-finite logits.

Every case must end in a typed error (a ValueError subclass, or NonFiniteLogitsError at run time)
that names the offending key, tensor, argument or request, quickly and without large allocations.
"""
import json
import math
import tracemalloc

import numpy as np
import pytest
from helpers.oracle import FIXTURES, needs_transformers
from helpers.work import call_budget

import engine
from engine.backend import f32_to_bf16, resolve_backend
from engine.formats.config import ConfigError, config_from_dict, load_config
from engine.formats.safetensors import save_file
from engine.model.forward_pass import load_model
from engine.model.random_model import PRESETS, random_weights, write_random_model
from engine.model.weights import NonFiniteWeightsError, check_finite, load_weights
from engine.ops.embedding import embedding_ref
from engine.ops.sampling import NonFiniteLogitsError, sample
from engine.runtime.llm import LLM
from engine.runtime.sampling_params import SamplingParams

TINY = PRESETS["tiny"]
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


def current_layout(config: dict) -> dict:
    """The same model in the layout transformers >= 5 writes: rope_parameters holds theta and scaling."""
    d = {k: v for k, v in config.items() if k not in ("rope_theta", "rope_scaling")}
    d["rope_parameters"] = {"rope_type": "default", **(config.get("rope_scaling") or {}),
                            "rope_theta": config.get("rope_theta", 10000.0)}
    return d


# ---- config.json: what is refused, and the key the error names ---------------------------------

def without(d, *keys):
    return {k: v for k, v in d.items() if k not in keys}


HOSTILE_CONFIGS = {
    # strict types
    "bool as string": ({**TINY, "tie_word_embeddings": "false"}, "tie_word_embeddings"),
    "bias as string": ({**TINY, "attention_bias": "false"}, "attention_bias"),
    "bias as 0": ({**TINY, "mlp_bias": 0}, "mlp_bias"),
    "size as float": ({**TINY, "hidden_size": 72.0}, "hidden_size"),
    "size as string": ({**TINY, "vocab_size": "397"}, "vocab_size"),
    "size as bool": ({**TINY, "num_hidden_layers": True}, "num_hidden_layers"),
    "theta as string": ({**TINY, "rope_theta": "10000"}, "rope_theta"),
    "eos as bool": ({**TINY, "eos_token_id": True}, "eos_token_id"),
    "eos list with a string": ({**TINY, "eos_token_id": [2, "3"]}, "eos_token_id"),
    "bos as float": ({**TINY, "bos_token_id": 1.5}, "bos_token_id"),
    # non-finite and absurd numbers
    "theta 1e-300": ({**TINY, "rope_theta": 1e-300}, "rope_theta"),
    "theta NaN": ({**TINY, "rope_theta": math.nan}, "rope_theta"),
    "theta inf": ({**TINY, "rope_theta": math.inf}, "rope_theta"),
    "theta 1e300": ({**TINY, "rope_theta": 1e300}, "rope_theta"),
    "theta 1": ({**TINY, "rope_theta": 1.0}, "rope_theta"),
    "eps 0": ({**TINY, "rms_norm_eps": 0.0}, "rms_norm_eps"),
    "eps 1e-300": ({**TINY, "rms_norm_eps": 1e-300}, "rms_norm_eps"),
    "eps NaN": ({**TINY, "rms_norm_eps": math.nan}, "rms_norm_eps"),
    "layers 10**8": ({**TINY, "num_hidden_layers": 10**8}, "num_hidden_layers"),
    "vocab 2**40": ({**TINY, "vocab_size": 2**40}, "vocab_size"),
    "context 10**10": ({**TINY, "max_position_embeddings": 10**10}, "max_position_embeddings"),
    "context 1": ({**TINY, "max_position_embeddings": 1}, "max_position_embeddings"),
    "head_dim 0": ({**TINY, "head_dim": 0}, "head_dim"),
    "eos past the vocab": ({**TINY, "eos_token_id": 10**9}, "eos_token_id"),
    "bos past the vocab": ({**TINY, "bos_token_id": 397}, "bos_token_id"),
    # settings that change the math and are not implemented
    "gelu": ({**TINY, "hidden_act": "gelu"}, "hidden_act"),
    "attention bias": ({**TINY, "attention_bias": True}, "attention_bias"),
    "mlp bias": ({**TINY, "mlp_bias": True}, "mlp_bias"),
    "sliding window": ({**TINY, "sliding_window": 4096}, "sliding_window"),
    "use sliding window": ({**TINY, "use_sliding_window": True}, "use_sliding_window"),
    "layer types": ({**TINY, "layer_types": ["sliding_attention", "full_attention"]}, "layer_types"),
    "partial rotary": ({**TINY, "partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    "quantized": ({**TINY, "quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
    "experts": ({**TINY, "num_local_experts": 8}, "num_local_experts"),
    "softcapping": ({**TINY, "final_logit_softcapping": 30.0}, "final_logit_softcapping"),
    # rope, older layout
    "rope_scaling yarn": ({**TINY, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type"),
    "rope_scaling linear": ({**TINY, "rope_scaling": {"type": "linear", "factor": 4.0}}, "rope_type"),
    "rope_scaling dynamic": ({**TINY, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type"),
    "rope_scaling as string": ({**TINY, "rope_scaling": "llama3"}, "rope_scaling"),
    "llama3 factor < 1": ({**TINY, "rope_scaling": {**LLAMA3, "factor": 0.5}}, "factor"),
    "llama3 factor NaN": ({**TINY, "rope_scaling": {**LLAMA3, "factor": math.nan}}, "factor"),
    "llama3 high <= low": ({**TINY, "rope_scaling": {**LLAMA3, "high_freq_factor": 1.0}}, "high_freq_factor"),
    "llama3 low missing": ({**TINY, "rope_scaling": without(LLAMA3, "low_freq_factor")}, "low_freq_factor"),
    "llama3 original as string": ({**TINY, "rope_scaling": {**LLAMA3, "original_max_position_embeddings": "64"}},
                                  "original_max_position_embeddings"),
    "rope_type vs type": ({**TINY, "rope_scaling": {**LLAMA3, "type": "default"}}, "type"),
    # rope, current layout
    "rope_parameters yarn": ({**without(TINY, "rope_scaling"), "rope_parameters": {"rope_type": "yarn",
                              "rope_theta": 1e4, "factor": 4.0}}, "rope_type"),
    "rope_parameters longrope": ({**without(TINY, "rope_scaling"), "rope_parameters": {"rope_type": "longrope"}},
                                 "rope_type"),
    "rope_parameters unknown key": ({**without(TINY, "rope_scaling"), "rope_parameters": {
        "rope_type": "default", "rope_theta": 1e4, "mscale": 2.0}}, "mscale"),
    "rope_parameters partial": ({**without(TINY, "rope_scaling"), "rope_parameters": {
        "rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25}}, "partial_rotary_factor"),
    "rope_parameters theta 1e-300": ({**without(TINY, "rope_scaling"), "rope_parameters": {
        "rope_type": "default", "rope_theta": 1e-300}}, "rope_theta"),
    "rope_parameters as list": ({**without(TINY, "rope_scaling"), "rope_parameters": [10000.0]}, "rope_parameters"),
    "per-layer rope_parameters": ({**without(TINY, "rope_scaling"), "rope_parameters": {
        "full_attention": {"rope_type": "default", "rope_theta": 1e4}}}, "full_attention"),
    "both layouts": ({**TINY, "rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, **LLAMA3}},
                     "rope_parameters"),
    "thetas disagree": ({**without(TINY, "rope_scaling"), "rope_theta": 10000.0,
                         "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}, "disagree"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE_CONFIGS))
def test_hostile_config_is_refused_naming_the_key(name):
    config, key = HOSTILE_CONFIGS[name]
    with pytest.raises(ConfigError) as info:
        config_from_dict(config)
    assert key in str(info.value), str(info.value)


@pytest.mark.parametrize("content, match", [
    (b"[1, 2]", "JSON object"),
    (b"\xff\xfe{}", "cannot read"),
    (b"[" * 100_000 + b"]" * 100_000, "cannot read"),                   # nesting past the parser's stack
    (json.dumps({**TINY, "rope_theta": math.nan}).encode(), "rope_theta"),   # Python's json reads NaN back
])
def test_malformed_config_files(tmp_path, content, match):
    (tmp_path / "config.json").write_bytes(content)
    with pytest.raises(ConfigError, match=match):
        load_config(tmp_path)


def test_huge_config_file_is_refused_unread(tmp_path):
    with open(tmp_path / "config.json", "wb") as f:
        f.truncate(64 * 2**20)                                          # sparse: costs no disk
    with pytest.raises(ConfigError, match="bytes"):
        load_config(tmp_path)


def test_generation_config_must_be_an_object():
    with pytest.raises(ConfigError, match="generation_config"):
        config_from_dict(TINY, [2])


# ---- config.json: both layouts read to the same model -----------------------------------------

@pytest.mark.parametrize("preset", ["tiny", "tiny-mqa", "llama-3.2-1b", "smollm2-135m"])
def test_both_layouts_read_the_same(preset):
    old = config_from_dict(PRESETS[preset])
    new = config_from_dict(current_layout(PRESETS[preset]))
    assert new == old and new.rope_theta == PRESETS[preset]["rope_theta"]


def test_accepted_variants():
    base = without(TINY, "rope_scaling", "rope_theta")
    assert config_from_dict({**base, "rope_scaling": None,
                             "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}).rope_theta == 1e6
    assert config_from_dict({**base, "rope_scaling": {"type": "llama3", **without(LLAMA3, "rope_type")}}) \
        .rope_scaling.factor == 8.0                                    # the older "type" spelling
    c = config_from_dict({**base, "rope_scaling": without(LLAMA3, "original_max_position_embeddings")})
    assert c.rope_scaling.original_max_position_embeddings == TINY["max_position_embeddings"]   # as transformers
    assert config_from_dict({**TINY, "hidden_act": "swish", "pretraining_tp": 1, "sliding_window": None,
                             "use_cache": True, "initializer_range": 0.02}).hidden_size == 72


def test_fixture_config_written_by_transformers_loads():
    """The committed config.json that transformers 5 wrote (current layout) is read, theta included."""
    index = json.loads((FIXTURES / "model_oracle_index.json").read_text())
    written = [m["config"] for m in index["models"].values() if "rope_parameters" in m["config"]]
    assert written
    for d in written:
        c = config_from_dict(d)
        assert c.rope_theta == d["rope_parameters"]["rope_theta"]
        assert (c.rope_scaling is None) == (d["rope_parameters"]["rope_type"] == "default")


@needs_transformers
@pytest.mark.parametrize("layout", ["older", "current"])
@pytest.mark.parametrize("preset", ["tiny", "tiny-mha-untied", "llama-3.2-1b"])
def test_layouts_agree_with_transformers_live(tmp_path, preset, layout):
    """transformers reads the same directory to the same theta, scaling and inverse frequencies."""
    import transformers
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from engine.ops.rope import rope_inv_freq
    d = PRESETS[preset] if layout == "older" else current_layout(PRESETS[preset])
    (tmp_path / "config.json").write_text(json.dumps(d))
    hf = transformers.AutoConfig.from_pretrained(tmp_path)
    ours = load_config(tmp_path)
    assert ours.rope_theta == hf.rope_parameters["rope_theta"]
    assert (ours.rope_scaling is None) == (hf.rope_parameters["rope_type"] == "default")
    np.testing.assert_allclose(rope_inv_freq(ours), LlamaRotaryEmbedding(hf).inv_freq.numpy(), rtol=3e-7)


# ---- checkpoints that disagree with config.json -------------------------------------------------

@pytest.fixture()
def tiny_dir(tmp_path):
    return write_random_model(tmp_path / "m", "tiny", seed=5)


def set_config(model_dir, **changes):
    path = model_dir / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def rewrite(model_dir, mutate, dtype="BF16"):
    tensors = random_weights(load_config(model_dir), seed=5)
    mutate(tensors)
    save_file(tensors, model_dir / "model.safetensors", dtype=dtype)


def test_absurd_layer_count_fails_fast_without_allocating(tiny_dir):
    """Refused before anything is built per layer: a bounded number of function calls (loading the whole
    two-layer tiny model makes about 2,000; a loop over the 10^6 layers, even one call each, would pass
    the budget and be stopped) and little memory."""
    set_config(tiny_dir, num_hidden_layers=10**6)
    tracemalloc.start()
    try:
        with call_budget(50_000) as work, pytest.raises(ConfigError, match="num_hidden_layers"):
            load_model(tiny_dir, backend="numpy")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert work.calls < 50_000 and peak < 8 * 2**20, (work.calls, peak)


@pytest.mark.parametrize("changes, match", [
    ({"vocab_size": 400}, "embed_tokens"),
    ({"intermediate_size": 10**6}, "gate_proj"),
    ({"num_key_value_heads": 3}, "k_proj"),
    ({"tie_word_embeddings": False}, "tie_word_embeddings"),
])
def test_config_sizes_must_match_the_checkpoint(tiny_dir, changes, match):
    set_config(tiny_dir, **changes)
    with pytest.raises(ConfigError, match=match):
        load_model(tiny_dir, backend="numpy")


def test_tied_config_with_a_different_lm_head_is_refused(tiny_dir):
    rewrite(tiny_dir, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"] + 1}))
    with pytest.raises(ConfigError, match="tie_word_embeddings"):
        load_model(tiny_dir, backend="numpy")


@pytest.mark.parametrize("dtype", ["BF16", "F16", "F32"])
@pytest.mark.parametrize("name, value", [("model.layers.1.mlp.down_proj.weight", np.nan),
                                          ("model.norm.weight", -np.inf),
                                          ("model.embed_tokens.weight", np.inf)])
def test_non_finite_weights_are_refused_naming_the_tensor(tiny_dir, dtype, name, value):
    def poison(t):
        t[name].flat[7] = value
    rewrite(tiny_dir, poison, dtype)
    with pytest.raises(NonFiniteWeightsError, match=name.replace(".", r"\.")):
        load_weights(tiny_dir, load_config(tiny_dir), resolve_backend("numpy"))


def test_check_finite_on_every_bf16_pattern():
    bits = np.arange(2**16, dtype=np.uint32).astype(np.uint16)
    finite = np.isfinite((bits.astype(np.uint32) << 16).view(np.float32))
    for b, ok in zip(bits[::97].tolist() + [0x7F7F, 0x7F80, 0x7FFF, 0xFF7F, 0xFF80, 0xFFC0],
                     finite[::97].tolist() + [True, False, False, True, False, False], strict=True):
        one = np.array([0x3F80, b, 0x3F80], dtype=np.uint16)
        if ok:
            check_finite("w", one)
        else:
            with pytest.raises(NonFiniteWeightsError):
                check_finite("w", one)
    check_finite("all finite", bits[finite])
    # an F32 weight past the bf16 range becomes inf when cast for the GPU: caught on the bits
    with pytest.raises(NonFiniteWeightsError, match="big"):
        check_finite("big", f32_to_bf16(np.array([1.0, 3.4e38], dtype=np.float32)))


# ---- RoPE tables follow the context in use ------------------------------------------------------

def test_rope_tables_do_not_follow_max_position_embeddings(tmp_path):
    model_dir = write_random_model(tmp_path / "m", {**TINY, "max_position_embeddings": 2**31 - 1,
                                                    "rope_scaling": {**LLAMA3, "original_max_position_embeddings": 64}})
    tracemalloc.start()
    model = load_model(model_dir, backend="numpy")
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert model.max_context == 2**31 - 1 and model.cos.shape[0] <= 4096 and peak < 64 * 2**20
    ids = np.arange(40) % 397
    np.testing.assert_allclose(model.logits(ids), load_model(model_dir, "numpy", max_context=64).logits(ids),
                               rtol=1e-6, atol=1e-6)
    assert load_model(model_dir, "numpy", max_context=100).cos.shape == (100, TINY["head_dim"] // 2)


def test_rope_tables_grow_with_the_positions_used(tmp_path, monkeypatch):
    model_dir = write_random_model(tmp_path / "m", {**TINY, "max_position_embeddings": 10_000})
    full = load_model(model_dir, backend="numpy", max_context=10_000)       # explicit: the whole table now
    assert full.rope_positions == 10_000
    monkeypatch.setattr("engine.model.forward_pass.Model.ROPE_START", 16)
    small = load_model(model_dir, backend="numpy")
    assert small.rope_positions == 16
    ids = (np.arange(70) * 5) % 397
    np.testing.assert_allclose(small.logits(ids), full.logits(ids), rtol=1e-6, atol=1e-6)
    assert 70 <= small.rope_positions <= 140                                # grown to what was used, doubling


@pytest.mark.parametrize("max_context", [0, 1, 257, 2.5, True, "64"])
def test_load_model_refuses_a_bad_max_context(tiny_dir, max_context):
    with pytest.raises(ValueError, match="max_context"):
        load_model(tiny_dir, "numpy", max_context=max_context)


# ---- LLM constructor: checked before a weight is read -------------------------------------------

@pytest.mark.parametrize("kwargs, match", [
    ({"page_size": 0}, "page_size"), ({"page_size": -16}, "page_size"), ({"page_size": True}, "page_size"),
    ({"page_size": 16.0}, "page_size"), ({"max_seqs": 0}, "max_seqs"), ({"max_seqs": -1}, "max_seqs"),
    ({"max_batch_tokens": 0}, "max_batch_tokens"), ({"kv_cache_mib": -1}, "kv_cache_mib"),
    ({"kv_cache_mib": 0}, "kv_cache_mib"), ({"kv_cache_mib": math.nan}, "kv_cache_mib"),
    ({"kv_cache_mib": math.inf}, "kv_cache_mib"), ({"kv_cache_mib": True}, "kv_cache_mib"),
    ({"kv_cache_mib": "64"}, "kv_cache_mib"), ({"max_context": 1}, "max_context"),
    ({"max_context": 0}, "max_context"), ({"max_context": 257}, "max_context"),
    ({"max_context": 64.0}, "max_context"), ({"batching": "dynamic"}, "batching"),
    ({"kv_cache": "ring"}, "kv_cache"), ({"admission": "eager"}, "admission"), ({"batching": ["static"]}, "batching"),
])
def test_llm_arguments_refused_before_loading(tiny_dir, monkeypatch, kwargs, match):
    def never(*a, **k):
        raise AssertionError("weights were loaded before the arguments were checked")
    monkeypatch.setattr("engine.runtime.llm.load_model", never)
    with pytest.raises(ValueError, match=match):
        LLM(tiny_dir, backend="numpy", **kwargs)


def test_kv_cache_larger_than_memory_is_refused(tiny_dir):
    with pytest.raises(ValueError, match="MiB"):
        LLM(tiny_dir, backend="numpy", kv_cache_mib=2**40)


def test_numpy_integer_arguments_are_accepted(tiny_dir):
    llm = LLM(tiny_dir, backend="numpy", max_context=np.int64(64), max_seqs=np.int32(2), page_size=np.int16(8),
              kv_cache_mib=np.float32(1.0))
    assert (type(llm.max_context), type(llm.page_size)) == (int, int)
    assert len(llm.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2))[0].token_ids) == 2


# ---- token ids the model cannot embed -----------------------------------------------------------

def write_tokenizer(model_dir, added_id: int):
    from engine.text.tokenizer import bytes_to_unicode
    vocab = {ch: i for i, ch in enumerate(bytes_to_unicode().values())}          # 256 byte tokens
    spec = {"model": {"type": "BPE", "vocab": vocab, "merges": []},
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                              "use_regex": True},
            "decoder": {"type": "ByteLevel"},
            "added_tokens": [{"id": added_id, "content": "<|extra|>", "special": True, "single_word": False,
                              "lstrip": False, "rstrip": False, "normalized": False}]}
    (model_dir / "tokenizer.json").write_text(json.dumps(spec))


def test_tokenizer_past_the_embedding_table_is_refused(tiny_dir):
    write_tokenizer(tiny_dir, added_id=TINY["vocab_size"])                   # one id too many
    with pytest.raises(ConfigError, match="embedding table"):
        LLM(tiny_dir, backend="numpy", max_context=64)
    write_tokenizer(tiny_dir, added_id=TINY["vocab_size"] - 1)               # the last row: fine
    llm = LLM(tiny_dir, backend="numpy", max_context=64)
    assert llm.generate("hi <|extra|>", SamplingParams(max_new_tokens=1))[0].prompt_token_ids[-1] == 396


def test_ids_from_the_tokenizer_are_validated_like_ids_passed_in(tiny_dir, monkeypatch):
    write_tokenizer(tiny_dir, added_id=300)
    llm = LLM(tiny_dir, backend="numpy", max_context=64)
    monkeypatch.setattr(llm.tokenizer, "encode", lambda text, add_special_tokens=False: [5, 10**6])
    with pytest.raises(ValueError, match="token ids"):
        llm.generate("anything")
    for bad in ([5, 397], [-1, 5], [5, True]):
        with pytest.raises(ValueError, match="token ids"):
            llm.generate([bad])


@pytest.mark.parametrize("ids", [[-1], [397], [0, 10**9]])
def test_embedding_reference_refuses_ids_without_a_row(ids):
    with pytest.raises(ValueError, match="token ids"):
        embedding_ref(np.array(ids), np.zeros((397, 8), np.float32))


# ---- non-finite logits at run time --------------------------------------------------------------

@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.8, top_k=5, seed=1),
                                    SamplingParams(temperature=1.0, top_p=0.9, seed=2)],
                         ids=["greedy", "top-k", "top-p"])
@pytest.mark.parametrize("poison", [np.nan, np.inf, -np.inf])
def test_sampler_refuses_non_finite_rows(params, poison):
    logits = np.random.default_rng(0).standard_normal((3, 50)).astype(np.float32)
    logits[1, 17] = poison
    with pytest.raises(NonFiniteLogitsError, match="request 8, step 4"):
        sample(logits, [params] * 3, [0.5] * 3, labels=["request 7, step 0", "request 8, step 4", "request 9, step 1"])
    assert sample(logits[[0, 2]], [params] * 2, [0.5] * 2).shape == (2,)


@pytest.mark.parametrize("params", [SamplingParams(max_new_tokens=4),
                                    SamplingParams(max_new_tokens=4, temperature=0.7, seed=3)],
                         ids=["greedy", "sampled"])
def test_llm_names_the_request_and_step_then_keeps_serving(tiny_dir, monkeypatch, params):
    llm = LLM(tiny_dir, backend="numpy", max_context=64)
    forward, calls = llm.model.forward, []

    def nan_on_third_call(batch, cache=None):
        out = forward(batch, cache)
        calls.append(1)
        if len(calls) == 3:
            out = out.copy()
            out[-1, 3] = np.nan
        return out
    monkeypatch.setattr(llm.model, "forward", nan_on_third_call)
    with pytest.raises(NonFiniteLogitsError, match=r"request \d+, step 2"):
        llm.generate([[1, 2, 3]], params)
    monkeypatch.setattr(llm.model, "forward", forward)
    assert len(llm.generate([[1, 2, 3]], params)[0].token_ids) == 4      # the engine is still usable


def test_public_entry_points_still_work(tiny_dir):
    model = engine.load_model(tiny_dir, backend="numpy")
    assert model.logits([1, 2, 3]).shape == (3, TINY["vocab_size"])
