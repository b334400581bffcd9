"""Qwen3.5 hybrid models (Gated DeltaNet + gated full attention) against transformers (fp32, CPU).

As in tests/test_ch07_model_oracle.py: tests/fixtures/make_qwen3_5_fixtures.py produced the reference
logits once; each test rebuilds the same random model directory (same sha256) and holds
engine.load_model(dir, backend="numpy").logits(ids) to them (max |diff| / max |ref| <= 1e-4, the same
argmax everywhere). The no-cache greedy continuation must be transformers' generate (which runs its
own recurrent state and cache) token for token. Live against transformers when it is importable.
"""
import json
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
from helpers.oracle import (
    FIXTURES,
    ORACLE_REL_TOL,
    check_logits,
    fixture_rebuilder,
    greedy_no_cache,
    hf_logits,
    needs_transformers,
    relative_error,
    sha256_file,
)

from engine.formats.config import ConfigError, config_from_dict
from engine.formats.safetensors import load_file, save_file
from engine.model import hybrid_forward
from engine.model.forward_pass import ForwardBatch, Model, check_backend_runs, load_model
from engine.model.hybrid_weights import GatedAttentionLayer, LinearAttentionLayer
from engine.model.kv_cache import KVCache
from engine.model.random_model import PRESETS

INDEX = json.loads((FIXTURES / "qwen3_5_oracle_index.json").read_text())
NAMES = sorted(INDEX["models"])
REL_TOL = ORACLE_REL_TOL
REGENERATE = "regenerate the fixtures with `python tests/fixtures/make_qwen3_5_fixtures.py`"


@pytest.fixture(scope="module")
def rebuilt(tmp_path_factory):
    """name -> (model directory, token ids, reference logits), built lazily once per module."""
    return fixture_rebuilder(tmp_path_factory, INDEX, "qwen3_5_oracle")


def text_config(config: dict) -> dict:
    return config.get("text_config", config)


def test_fixtures_cover_the_required_shapes():
    configs = [INDEX["models"][n]["config"] for n in NAMES]
    texts = [text_config(c) for c in configs]
    assert {t["tie_word_embeddings"] for t in texts} == {True, False}
    assert {t["num_key_value_heads"] == 1 for t in texts} == {True, False}                  # MQA and GQA
    assert any(t["linear_num_value_heads"] > t["linear_num_key_heads"] for t in texts)
    assert any("layer_types" not in t for t in texts)                                       # the default pattern
    assert any(t.get("layer_types", [None])[0] == "full_attention" for t in texts)          # irregular
    assert {t["rope_parameters"]["partial_rotary_factor"] for t in texts} == {0.25, 0.4}
    assert any(c["model_type"] == "qwen3_5" for c in configs)                               # a vision-language dir
    assert any("transformers_version" in c for c in configs)                                # as transformers writes
    assert any(INDEX["models"][n]["num_tokens"] > 64 for n in NAMES)                        # more than one chunk
    assert {INDEX["models"][n]["dtype"] for n in NAMES} == {"BF16", "F32"}


@pytest.mark.parametrize("name", NAMES)
def test_random_model_is_rebuilt_bit_for_bit(rebuilt, name):
    model_dir, _, _ = rebuilt(name)
    assert sha256_file(model_dir / "model.safetensors") == INDEX["models"][name]["sha256"], \
        f"write_random_model no longer writes the same weights for {name}: {REGENERATE}"


@pytest.mark.parametrize("name", NAMES)
def test_numpy_logits_match_transformers_fixture(rebuilt, name):
    model_dir, ids, ref = rebuilt(name)
    check_logits(load_model(model_dir, backend="numpy").logits(ids.tolist()), ref, f"{name} vs fixture")


@pytest.mark.parametrize("name", NAMES)
def test_no_cache_greedy_matches_transformers_generate_fixture(rebuilt, name):
    model_dir, _, _ = rebuilt(name)
    with np.load(FIXTURES / f"qwen3_5_oracle_{name}.npz") as f:
        prompt, expected = f["greedy_prompt"].tolist(), f["greedy_tokens"].tolist()
    model = load_model(model_dir, backend="numpy")
    tokens, _ = greedy_no_cache(model, prompt, len(expected), eos=model.config.eos_token_ids)
    assert tokens == expected


def test_each_feature_matters(rebuilt):
    """Dropping any one piece of the hybrid layers misses the fixture by far: the oracle would catch an
    engine that loaded it and then ignored it."""
    model_dir, ids, ref = rebuilt("tiny-qwen3.5-mqa-untied")
    model = load_model(model_dir, backend="numpy")
    layers = model.weights.layers

    def without(change):
        saved = [vars(lw).copy() for lw in layers]
        for lw in layers:
            change(lw)
        try:
            return relative_error(model.logits(ids.tolist()), ref)
        finally:
            for lw, fields in zip(layers, saved, strict=True):
                vars(lw).update(fields)

    def no_query_gate(lw):         # gate rows zeroed: sigmoid(gate) = 1/2 everywhere, not per token
        if isinstance(lw, GatedAttentionLayer):
            lw.qkvg = lw.qkvg.copy()
            lw.qkvg[-model.config.q_dim:] = 0.0

    def no_conv_history(lw):       # only the current token's tap
        if isinstance(lw, LinearAttentionLayer):
            lw.conv = np.where(np.arange(lw.conv.shape[1]) == lw.conv.shape[1] - 1, lw.conv, 0.0).astype(np.float32)

    def plain_norm_weights(lw):    # forget the (1 + w) of Qwen3.5's RMSNorm
        lw.input_norm = lw.input_norm - 1.0

    def no_decay(lw):
        if isinstance(lw, LinearAttentionLayer):
            lw.A_log = np.full_like(lw.A_log, -30.0)

    for change in (no_query_gate, no_conv_history, plain_norm_weights, no_decay):
        assert without(change) > 100 * REL_TOL, change.__name__
    full_rotary = Model(replace(model.config, partial_rotary_factor=1.0), model.weights, model.backend)
    assert relative_error(full_rotary.logits(ids.tolist()), ref) > 100 * REL_TOL


def test_chunk_size_does_not_change_the_logits(rebuilt, monkeypatch):
    model_dir, ids, ref = rebuilt("tiny-qwen3.5")
    model = load_model(model_dir, backend="numpy")
    for chunk in (1, 7, 200):
        monkeypatch.setattr(hybrid_forward, "CHUNK_SIZE", chunk)
        check_logits(model.logits(ids.tolist()), ref, f"chunk size {chunk}")


def test_logits_are_causal_and_packed_sequences_independent(rebuilt):
    model_dir, ids, _ = rebuilt("tiny-qwen3.5")
    model = load_model(model_dir, backend="numpy")
    full = model.logits(ids)
    for n in (1, 2, 65):
        np.testing.assert_allclose(model.logits(ids[:n]), full[:n], rtol=1e-5, atol=1e-5 * np.abs(full).max())
    a, b = ids[:30], ids[30:71]
    packed = ForwardBatch(np.concatenate([a, b]), np.concatenate([np.arange(30), np.arange(41)]).astype(np.int32),
                          np.array([0, 30, 71], dtype=np.int32))
    out = model.forward(packed)
    np.testing.assert_allclose(out[:30], full[:30], rtol=1e-5, atol=1e-5 * np.abs(full).max())
    np.testing.assert_allclose(out[30:], model.logits(b), rtol=1e-5, atol=1e-5 * np.abs(full).max())


def test_what_is_not_supported_is_refused(rebuilt):
    model_dir, _, _ = rebuilt("tiny-qwen3.5")
    gpu = SimpleNamespace(is_gpu=True)
    check_backend_runs(load_model(model_dir, backend="numpy").config, gpu)       # the GPU runs it
    for wide in (dict(linear_key_head_dim=160), dict(linear_value_head_dim=136), dict(linear_conv_kernel_dim=9)):
        with pytest.raises(ConfigError, match="Gated DeltaNet kernels take"):
            check_backend_runs(config_from_dict({**PRESETS["tiny-qwen3.5"], **wide}), gpu)
    with pytest.raises(ConfigError, match="quantization"):
        load_model(model_dir, backend="numpy", quantization="int8")
    model = load_model(model_dir, backend="numpy")
    cache = KVCache.paged(model.config, 1.0, 4)
    with pytest.raises(ValueError, match="recurrent state"):
        model.forward(ForwardBatch.single([1, 2], page_table=[0], page_size=4), cache)


HOSTILE = {
    "missing conv": (lambda t: t.pop("model.layers.0.linear_attn.conv1d.weight"), "missing"),
    "extra tensor": (lambda t: t.update({"model.layers.0.linear_attn.in_proj_ba.weight": np.zeros((2, 2), np.float32)}),
                     "unexpected"),
    "A_log shape": (lambda t: t.update({"model.layers.1.linear_attn.A_log": np.zeros(5, np.float32)}), "shape"),
    "gate missing from q_proj": (lambda t: t.update({"model.layers.2.self_attn.q_proj.weight":
                                                     t["model.layers.2.self_attn.q_proj.weight"][:64]}), "shape"),
    "a full layer where a linear one is": (
        lambda t: [t.pop(n) for n in list(t) if n.startswith("model.layers.3.linear_attn.")], "missing"),
    "lm_head not the embedding": (lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"] + 1}),
                                  "tie_word_embeddings"),
    "a layer too many": (lambda t: t.update({"model.layers.4.input_layernorm.weight": np.ones(48, np.float32)}),
                         "num_hidden_layers"),
    "NaN weight": (lambda t: t["model.layers.0.linear_attn.dt_bias"].__setitem__(0, np.nan), "NaN"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_checkpoints_are_refused(rebuilt, tmp_path, name):
    model_dir, _, _ = rebuilt("tiny-qwen3.5")
    tensors = {k: np.array(v) for k, v in load_file(model_dir / "model.safetensors").items()}
    change, message = HOSTILE[name]
    change(tensors)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((model_dir / "config.json").read_text())
    save_file(tensors, bad / "model.safetensors")
    with pytest.raises(ConfigError, match=message):
        load_model(bad, backend="numpy")


def test_mtp_and_vision_tensors_are_skipped(rebuilt, tmp_path):
    """What transformers skips on load (the multi-token-prediction head, the vision tower) is skipped here."""
    model_dir, ids, ref = rebuilt("tiny-qwen3.5")
    tensors = dict(load_file(model_dir / "model.safetensors"))
    tensors.update({"mtp.fc.weight": np.ones((3, 3), np.float32), "model.visual.patch.weight": np.ones(4, np.float32)})
    extra = tmp_path / "extra"
    extra.mkdir()
    (extra / "config.json").write_text((model_dir / "config.json").read_text())
    save_file(tensors, extra / "model.safetensors", dtype="BF16")
    check_logits(load_model(extra, backend="numpy").logits(ids.tolist()), ref, "with mtp/visual tensors")


@needs_transformers
@pytest.mark.parametrize("name", NAMES)
def test_numpy_logits_match_transformers_live(rebuilt, name):
    model_dir, ids, ref = rebuilt(name)
    check_logits(hf_logits(model_dir, ids.tolist()), ref, f"{name}: transformers today vs the fixture")
    vocab = text_config(INDEX["models"][name]["config"])["vocab_size"]
    other = np.random.default_rng(7).integers(0, vocab, size=len(ids) // 2 + 37).tolist()
    check_logits(load_model(model_dir, backend="numpy").logits(other), hf_logits(model_dir, other),
                 f"{name} vs transformers live")


@needs_transformers
def test_parameter_count_matches_transformers(rebuilt):
    from helpers.oracle import hf_model
    for name in ("tiny-qwen3.5", "tiny-qwen3.5-mqa-untied"):
        model_dir, _, _ = rebuilt(name)
        hf = hf_model(model_dir)
        count = sum(p.numel() for p in hf.parameters())
        if hf.config.tie_word_embeddings:
            assert hf.lm_head.weight is hf.model.embed_tokens.weight
        assert load_model(model_dir, backend="numpy").config.num_parameters() == count, name


def test_a_rope_override_rotates_the_partial_dimensions(rebuilt):
    """A learner's rope stage runs in Qwen3.5's full-attention layers too, on the rotated dimensions only."""
    import engine
    from engine.ops.rope import rope_ref
    model_dir, ids, ref = rebuilt("tiny-qwen3.5-mqa-untied")
    model = load_model(model_dir, backend="numpy")
    shapes = []

    def counted(x, positions, cos, sin):
        shapes.append(x.shape)
        return rope_ref(x, positions, cos, sin)
    with engine.use_stage("rope", counted):
        check_logits(model.logits(ids.tolist()), ref, "through a rope override")
    cfg = model.config
    assert shapes == [(len(ids), cfg.num_attention_heads + cfg.num_key_value_heads, cfg.rotary_dim)] * 2
