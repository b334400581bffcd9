"""Weight-only quantization (chapter 18; engine/ops/quantization.py): the packing is bit-exact against
references written from the formats' descriptions, and a quantized model (int8 or int4 on load, or an
AWQ checkpoint) computes exactly what the same model computes in float32 with the dequantized weights,
on tiny Llama, Qwen2 and Qwen3 configs, through every batching path."""
from __future__ import annotations

import json

import numpy as np
import pytest

import engine
from engine.formats.config import ConfigError
from engine.formats.safetensors import open_checkpoint, save_file
from engine.model.random_model import PRESETS, write_random_model
from engine.ops.quantization import (
    AWQ_ORDER,
    QuantizationError,
    awq_pack,
    awq_unpack_ref,
    dequantize_ref,
    from_awq,
    pack_ref,
    quant_linear_ref,
    quantize_ref,
    unpack_ref,
)
from engine.runtime.sampling_params import SamplingParams

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIGS = {   # every projection's K a multiple of 8, so that int4 and a group of 8 fit all of them
    "llama": PRESETS["tiny"],
    "qwen2": {**PRESETS["tiny-qwen2"], "hidden_size": 96, "intermediate_size": 136},
    "qwen3": PRESETS["tiny-qwen3"],
}


# ---- the formats, bit for bit --------------------------------------------------------------------
def test_packing_puts_the_first_input_in_the_lowest_bits():
    q = np.array([[1, 2, 3, 4, 5, 6, 7, 15, 0, 9, 10, 11, 12, 13, 14, 8]], dtype=np.uint8)
    assert pack_ref(q, 4).tolist() == [[0xF7654321, 0x8EDCBA90]]
    q8 = np.array([[1, 2, 3, 250, 7, 0, 0, 128]], dtype=np.uint8)
    assert pack_ref(q8, 8).tolist() == [[0xFA030201, 0x80000007]]
    rng = np.random.default_rng(0)
    for bits in (4, 8):
        codes = rng.integers(0, 1 << bits, (5, 64)).astype(np.uint8)
        np.testing.assert_array_equal(unpack_ref(pack_ref(codes, bits), bits), codes)


def test_awq_words_hold_columns_in_the_interleaved_order():
    # AutoAWQ packs columns 0..7 of a row into nibbles in the order 0, 2, 4, 6, 1, 3, 5, 7
    word = sum(column << (4 * nibble) for nibble, column in enumerate(AWQ_ORDER))
    assert awq_unpack_ref(np.array([[word]], dtype=np.uint32).view(np.int32)).tolist() == [list(range(8))]
    rng = np.random.default_rng(1)
    codes = rng.integers(0, 16, (12, 40)).astype(np.uint8)
    packed = awq_pack(codes)
    assert packed.dtype == np.int32 and packed.shape == (12, 5)
    np.testing.assert_array_equal(awq_unpack_ref(packed), codes)


def test_from_awq_is_autoawqs_dequantization_in_the_engines_layout():
    rng = np.random.default_rng(2)
    K, N, G = 64, 24, 16
    codes = rng.integers(0, 16, (K, N)).astype(np.uint8)
    zeros = rng.integers(0, 16, (K // G, N)).astype(np.uint8)
    scales = (rng.random((K // G, N)) * 0.1 + 0.01).astype(np.float16)
    qw = from_awq(awq_pack(codes), awq_pack(zeros), scales, G)
    # AutoAWQ: W^T [K, N] = (q - z) * s with each group's z and s repeated over its G rows
    want = (codes.astype(np.float32) - np.repeat(zeros, G, axis=0)) * np.repeat(scales.astype(np.float32), G, axis=0)
    np.testing.assert_array_equal(dequantize_ref(qw), want.T)
    with pytest.raises(QuantizationError, match="shapes do not agree"):
        from_awq(awq_pack(codes), awq_pack(zeros)[:1], scales, G)


def test_quantization_error_is_within_a_step_of_each_group():
    """Rounding costs at most half a step; the rounded zero point can push a group's extreme value past
    the top code by up to another half, where it is clipped."""
    rng = np.random.default_rng(3)
    w = (rng.standard_normal((33, 256)) * 0.05).astype(np.float32)
    w[3] = 0.0                                    # an all-zero row: exact
    w[4, :128] = np.abs(w[4, :128])               # an all-positive group
    errors = {}
    for bits in (8, 4):
        for G in (32, 128, -1):
            qw = quantize_ref(w, bits, G)
            step = np.repeat(qw.scales.astype(np.float32), qw.group_size, axis=1)
            err = np.abs(dequantize_ref(qw) - w)
            assert np.all(err <= step * (1 + 1e-3) + 1e-7), (bits, G)
            assert np.mean(err <= 0.5 * step * (1 + 1e-3) + 1e-7) > 0.97, (bits, G)
            assert not dequantize_ref(qw)[3].any()
            errors[bits, G] = float(np.sqrt(np.mean(err ** 2)))
            x = rng.standard_normal((3, 256)).astype(np.float32)
            np.testing.assert_allclose(quant_linear_ref(x, qw), x @ dequantize_ref(qw).T, rtol=1e-6, atol=1e-6)
    assert errors[8, 32] < errors[4, 32] and errors[4, 32] < errors[4, -1]     # bits and groups buy accuracy


def test_bad_settings_are_refused_by_name():
    w = np.zeros((4, 96), np.float32)
    for bits, group, message in ((3, 32, "bits"), (4, 20, "group_size"), (4, 36, "group_size"), (8, 0, "group_size")):
        with pytest.raises(QuantizationError, match=message):
            quantize_ref(w, bits, group)


# ---- whole models ----------------------------------------------------------------------------------
def _is_projection(name: str) -> bool:
    return name.endswith(".weight") and name.rsplit(".", 2)[-2] in PROJECTIONS


def _dequantized_copy(src, dst, bits: int, group: int):
    """The model of `src` with every projection replaced by its quantized-then-dequantized float32 values."""
    with open_checkpoint(src) as ckpt:
        tensors = {name: np.array(ckpt.get_tensor(name), dtype=np.float32) for name in ckpt.keys()}
    for name in tensors:
        if _is_projection(name):
            tensors[name] = dequantize_ref(quantize_ref(tensors[name], bits, group))
    _write(src, dst, tensors)


def _awq_copy(src, dst, group: int):
    """`src` as an AutoAWQ GEMM checkpoint (int4, zero points), and the float32 model it stands for."""
    with open_checkpoint(src) as ckpt:
        tensors = {name: np.array(ckpt.get_tensor(name), dtype=np.float32) for name in ckpt.keys()}
    awq, oracle = {}, {}
    for name, w in tensors.items():
        if not _is_projection(name):
            awq[name] = oracle[name] = w
            continue
        qw = quantize_ref(w, 4, group)
        base = name[:-len("weight")]
        awq[base + "qweight"] = awq_pack(np.ascontiguousarray(unpack_ref(qw.qweight, 4).T))    # [K, N/8]
        awq[base + "qzeros"] = awq_pack(np.ascontiguousarray(qw.zeros.T))                     # [K/G, N/8]
        awq[base + "scales"] = np.ascontiguousarray(qw.scales.T)                               # [K/G, N] fp16
        oracle[name] = dequantize_ref(qw)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "version": "gemm", "zero_point": True,
                                     "group_size": group}
    _write(src, dst, awq, config)
    _write(src, dst.with_name(dst.name + "-oracle"), oracle)
    return dst.with_name(dst.name + "-oracle")


def _write(src, dst, tensors, config=None):
    dst.mkdir(parents=True, exist_ok=True)
    save_file(tensors, dst / "model.safetensors")
    (dst / "config.json").write_text(json.dumps(config or json.loads((src / "config.json").read_text())))
    (dst / "generation_config.json").write_text((src / "generation_config.json").read_text())


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def family_dir(request, tmp_path_factory):
    return write_random_model(tmp_path_factory.mktemp(request.param) / "m", CONFIGS[request.param], seed=5)


PROMPTS = [[5, 9, 30, 2, 41, 7], [11, 12, 13], [40, 3, 3, 3, 8, 9, 10, 22, 31, 4, 4]]


@pytest.mark.parametrize("quantization, group", [("int8", 8), ("int4", 8), ("int4", -1)])
def test_a_model_quantized_on_load_equals_its_dequantized_float32_self(family_dir, tmp_path, quantization, group):
    bits = {"int8": 8, "int4": 4}[quantization]
    _dequantized_copy(family_dir, tmp_path / "oracle", bits, group)
    quantized = engine.load_model(family_dir, "numpy", quantization=quantization, group_size=group)
    oracle = engine.load_model(tmp_path / "oracle", "numpy")
    plain = engine.load_model(family_dir, "numpy")
    for prompt in PROMPTS:
        got, want = quantized.logits(prompt), oracle.logits(prompt)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        assert np.abs(got - plain.logits(prompt)).max() > 0          # the quantization is real


def test_an_awq_checkpoint_runs_its_own_weights(family_dir, tmp_path):
    oracle_dir = _awq_copy(family_dir, tmp_path / "awq", group=8)
    awq, oracle = engine.load_model(tmp_path / "awq", "numpy"), engine.load_model(oracle_dir, "numpy")
    for prompt in PROMPTS:
        np.testing.assert_allclose(awq.logits(prompt), oracle.logits(prompt), rtol=1e-5, atol=1e-5)
    params = [SamplingParams(max_new_tokens=12, ignore_eos=True)] * len(PROMPTS)
    batched = engine.LLM(tmp_path / "awq", backend="numpy", max_seqs=4, max_batch_tokens=8)   # chunked, mixed
    alone = engine.LLM(oracle_dir, backend="numpy", max_seqs=1)
    assert [o.token_ids for o in batched.generate(PROMPTS, params)] == \
        [alone.generate([p], params[:1])[0].token_ids for p in PROMPTS]


def test_quantized_serving_paths_agree(family_dir):
    """Continuous batching, chunked prefill and the prefix cache give each request the tokens it gets alone."""
    params = [SamplingParams(max_new_tokens=10, temperature=0.9, seed=s, ignore_eos=True) for s in range(4)]
    prompts = PROMPTS + [PROMPTS[0] + [17, 18]]
    batched = engine.LLM(family_dir, backend="numpy", max_seqs=4, max_batch_tokens=6, quantization="int4", group_size=8)
    alone = engine.LLM(family_dir, backend="numpy", max_seqs=1, prefix_caching=False, quantization="int4", group_size=8)
    assert [o.token_ids for o in batched.generate(prompts, params)] == \
        [alone.generate([p], [q])[0].token_ids for p, q in zip(prompts, params, strict=True)]


def test_a_numpy_quant_gemv_override_runs_in_every_int4_projection(family_dir):
    """The chapter's plug-in stage: your function computes every int4 projection of the real model (the
    engine's dense cache is bypassed), and an int8 model does not call it."""
    calls = []

    def mine(x, qw):
        calls.append(qw.shape)
        return quant_linear_ref(x, qw)

    model = engine.load_model(family_dir, "numpy", quantization="int4", group_size=8)
    want = model.logits(PROMPTS[0])
    with engine.use_stage("quant_gemv", mine):
        got = model.logits(PROMPTS[0])
        engine.load_model(family_dir, "numpy", quantization="int8", group_size=8).logits(PROMPTS[0])
    assert len(calls) == 4 * model.config.num_hidden_layers
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_the_default_group_is_128_or_the_largest_below_that_the_sizes_take():
    from engine.formats.config import config_from_dict
    from engine.model.weights import default_group_size
    for preset, bits, want in (("llama-3.2-1b", 4, 128), ("smollm2-135m", 4, 96), ("smollm2-135m", 8, 96),
                               ("tiny", 4, 8), ("tiny-mqa", 8, 8), ("tiny-qwen2", 4, -1)):
        assert default_group_size(config_from_dict(PRESETS[preset]), bits) == want, preset


def test_unsupported_quantization_is_refused_by_name(tmp_path):
    src = write_random_model(tmp_path / "m", "tiny", seed=1)
    for bad, key in (({"quant_method": "gptq", "bits": 4}, "quant_method"),
                     ({"quant_method": "awq", "bits": 8, "version": "gemm", "zero_point": True}, "bits"),
                     ({"quant_method": "awq", "bits": 4, "version": "gemv", "zero_point": True}, "version"),
                     ({"quant_method": "awq", "bits": 4, "version": "gemm", "zero_point": False}, "zero_point"),
                     ({"quant_method": "awq", "bits": 4, "version": "gemm", "group_size": 0}, "group_size"),
                     ({"quant_method": "awq", "bits": 4, "version": "gemm", "group_size": 48},   # 72 inputs
                      "group_size=48 cannot describe the 72 inputs")):
        config = {**json.loads((src / "config.json").read_text()), "quantization_config": bad}
        (src / "config.json").write_text(json.dumps(config))
        with pytest.raises(ConfigError, match=key):
            engine.load_model(src, "numpy")
    config.pop("quantization_config")
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quantization must be one of"):
        engine.load_model(src, "numpy", quantization="int3")
    with pytest.raises(QuantizationError, match="group_size"):
        engine.LLM(src, backend="numpy", quantization="int4", group_size=48)      # 48 does not divide 72


def test_the_quantized_bench_runs_on_the_cpu(capsys):
    from engine.bench import run as bench
    bench.main(["--preset", "tiny", "--backend", "numpy", "--scenario", "quantized", "--prompt-len", "12",
                "--new-tokens", "6", "--prefill-len", "32", "--group-size", "8"])
    runs = [json.loads(line) for line in capsys.readouterr().out.splitlines() if '"quantized"' in line]
    assert [r["quantization"] for r in runs] == ["none", "int8", "int4"]
    assert runs[2]["weight_bytes"] < runs[1]["weight_bytes"] < runs[0]["weight_bytes"]
    assert all(r["decode_tok_per_s"] > 0 and r["prefill_ms"] > 0 for r in runs) and "decode_speedup" in runs[2]
