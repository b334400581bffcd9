"""engine.formats.gguf_convert on a tiny synthetic Llama GGUF (no download).

The oracles are independent of the converter: a block decoder written out here from the GGML block
layouts, llama.cpp's own permutation formula applied in the forward direction, the `tokenizers`
library on the written tokenizer.json and, when installed, transformers reading the same GGUF.
"""
import importlib.util
import json
import struct

import gguf
import numpy as np
import pytest
from helpers.default_model import (
    CHAT_TEMPLATE,
    LAYER_TYPES,
    TINY,
    Q,
    llama_cpp_permute,
    tiny_vocab,
    write_tiny_llama_gguf,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.formats import gguf_convert
from engine.formats.gguf_convert import MARKER_FILE, GGUFConversionError, convert_gguf
from engine.formats.safetensors import load_file

HF_FILES = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json", MARKER_FILE]


# ---------------------------------------------------------------------------------------------
# An independent reference decoder: one block at a time, straight from the layouts in ggml-common.h

def _f16(raw: bytes) -> np.float32:
    return np.float32(struct.unpack("<e", raw)[0])


def _nibbles(qs: bytes) -> np.ndarray:
    """16 bytes -> 32 values: low nibbles are elements 0..15, high nibbles elements 16..31."""
    q = np.frombuffer(qs, dtype=np.uint8)
    return np.concatenate([q & 0x0F, q >> 4]).astype(np.float32)


def decode_block(qtype, block: bytes) -> np.ndarray:
    if qtype == Q.Q8_0:   # struct { f16 d; int8 qs[32]; }             x = d * q
        return _f16(block[:2]) * np.frombuffer(block[2:], dtype=np.int8).astype(np.float32)
    if qtype == Q.Q4_0:   # struct { f16 d; uint8 qs[16]; }            x = d * (q - 8)
        return _f16(block[:2]) * (_nibbles(block[2:]) - np.float32(8))
    if qtype == Q.Q4_1:   # struct { f16 d; f16 m; uint8 qs[16]; }     x = d * q + m
        return _f16(block[:2]) * _nibbles(block[4:]) + _f16(block[2:4])
    raise AssertionError(qtype)


BLOCK_BYTES = {Q.Q8_0: 34, Q.Q4_0: 18, Q.Q4_1: 20}


def reference_decode(qtype, raw: np.ndarray) -> np.ndarray:
    """Raw stored tensor (rows of blocks) -> float32 [rows, 32 * blocks per row]."""
    if qtype == Q.F32:
        return raw
    if qtype == Q.F16:
        return raw.astype(np.float32)
    if qtype == Q.BF16:
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    size = BLOCK_BYTES[qtype]
    rows = []
    for row in raw:
        data = row.tobytes()
        rows.append(np.concatenate([decode_block(qtype, data[i:i + size]) for i in range(0, len(data), size)]))
    return np.stack(rows)


def bf16_round(x: np.ndarray) -> np.ndarray:
    """float32 -> nearest bf16 (ties to even), returned as float32."""
    bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
    return bits.astype(np.uint32).view(np.float32)


# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    written = write_tiny_llama_gguf(root / "tiny.gguf")
    out = convert_gguf(written.path, root / "hf")
    return written, out


def test_directory_has_every_file_and_config_matches_metadata(tiny):
    written, out = tiny
    assert sorted(p.name for p in out.iterdir()) == sorted(HF_FILES)
    config = json.loads((out / "config.json").read_text())
    h, heads = TINY["hidden"], TINY["heads"]
    assert config == {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": h, "intermediate_size": TINY["ffn"], "num_hidden_layers": TINY["layers"],
        "num_attention_heads": heads, "num_key_value_heads": TINY["kv_heads"], "head_dim": h // heads,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "rope_scaling": None,
        "max_position_embeddings": TINY["context"], "vocab_size": len(tiny_vocab()[0]),
        "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
        "torch_dtype": "bfloat16", "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
    }
    assert json.loads((out / "generation_config.json").read_text()) == \
        {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
    marker = json.loads((out / MARKER_FILE).read_text())
    assert marker["source_sha256"] == gguf_convert.sha256_file(written.path)


def test_tensors_are_the_decoded_blocks_in_hf_layout(tiny):
    """Every tensor == bf16(reference decode of the stored bytes), with q/k rows back in HF order."""
    written, out = tiny
    tensors = load_file(out / "model.safetensors")
    assert set(tensors) == set(written.hf_weights)     # tied: no lm_head.weight
    for gguf_name, (qtype, raw) in written.stored.items():
        hf_name = gguf_convert.hf_tensor_name(gguf_name)
        got = tensors[hf_name]
        assert got.shape == written.hf_weights[hf_name].shape, hf_name
        expected = reference_decode(qtype, raw).reshape(got.shape)
        if hf_name.endswith("q_proj.weight"):
            got = llama_cpp_permute(got, TINY["heads"])      # back to the stored order
        elif hf_name.endswith("k_proj.weight"):
            got = llama_cpp_permute(got, TINY["kv_heads"])
        np.testing.assert_array_equal(got, bf16_round(expected), err_msg=f"{gguf_name} ({qtype.name})")


def test_unpermutation_restores_the_original_rows_exactly(tiny):
    """Layer 0 stores q/k in F32 after llama.cpp's permutation; converting must give them back."""
    written, out = tiny
    tensors = load_file(out / "model.safetensors")
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"):
        np.testing.assert_array_equal(tensors[name], written.hf_weights[name])


@pytest.mark.parametrize("n_heads,head_dim", [(1, 2), (3, 8), (9, 64), (2, 6)])
def test_unpermute_inverts_llama_cpp_permute(n_heads, head_dim):
    w = np.arange(n_heads * head_dim * 3, dtype=np.float32).reshape(n_heads * head_dim, 3)
    np.testing.assert_array_equal(gguf_convert.unpermute_rows(llama_cpp_permute(w, n_heads), n_heads), w)
    # and it is not the identity: row 1 of a head comes from the second half of that head
    if head_dim > 2:
        assert not np.array_equal(llama_cpp_permute(w, n_heads), w)


@settings(max_examples=30, deadline=None)
@given(qtype=st.sampled_from([Q.Q8_0, Q.Q4_0, Q.Q4_1]), n_blocks=st.integers(1, 6), data=st.data())
def test_gguf_dequantize_matches_reference_decoder_on_random_blocks(qtype, n_blocks, data):
    """The converter relies on gguf.quants.dequantize; check it against the decoder above on
    arbitrary block bytes (scales drawn from all finite float16 values)."""
    size = BLOCK_BYTES[qtype]
    blocks = bytearray(data.draw(st.binary(min_size=size * n_blocks, max_size=size * n_blocks)))
    finite_f16 = st.floats(width=16, allow_nan=False, allow_infinity=False)
    n_scales = 2 if qtype == Q.Q4_1 else 1
    for b in range(n_blocks):
        for s in range(n_scales):
            struct.pack_into("<e", blocks, b * size + 2 * s, data.draw(finite_f16))
    raw = np.frombuffer(bytes(blocks), dtype=np.uint8).reshape(1, -1)
    with np.errstate(over="ignore"):     # huge scales times q overflow to inf in both
        np.testing.assert_array_equal(gguf.quants.dequantize(raw, qtype), reference_decode(qtype, raw))


def test_tokenizer_json_is_byte_level_bpe_with_digits_split(tiny):
    from tokenizers import Tokenizer
    _, out = tiny
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    encoding = tokenizer.encode("the 12 is<|im_end|><tool> é", add_special_tokens=False)
    # "12" is a merge in the vocab, but Digits(individual_digits) splits digits before BPE runs
    assert encoding.tokens == ["t", "he", "Ġ", "1", "2", "Ġis", "<|im_end|>", "<tool>", "Ġ", "Ã", "©"]
    assert tokenizer.decode(encoding.ids, skip_special_tokens=False) == "the 12 is<|im_end|><tool> é"
    assert tokenizer.decode(encoding.ids, skip_special_tokens=True) == "the 12 is<tool> é"
    added = {t["content"]: t["special"] for t in json.loads((out / "tokenizer.json").read_text())["added_tokens"]}
    assert added == {"<|endoftext|>": True, "<|im_start|>": True, "<|im_end|>": True, "<tool>": False}


def test_tokenizer_config_carries_template_and_special_tokens(tiny):
    _, out = tiny
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["chat_template"] == CHAT_TEMPLATE
    assert (config["bos_token"], config["eos_token"], config["pad_token"], config["unk_token"]) == \
        ("<|im_start|>", "<|im_end|>", "<|im_end|>", "<|endoftext|>")
    assert config["add_bos_token"] is False and config["model_max_length"] == TINY["context"]


def test_untied_output_and_several_eos_ids(tmp_path):
    written = write_tiny_llama_gguf(tmp_path / "t.gguf", tied=False, extra_metadata={
        "tokenizer.ggml.eos_token_id": 0, "tokenizer.ggml.eot_token_id": 2})
    out = convert_gguf(written.path, tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is False and config["eos_token_id"] == [0, 2]
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [0, 2]
    lm_head = load_file(out / "model.safetensors")["lm_head.weight"]
    np.testing.assert_array_equal(lm_head, bf16_round(written.stored["output.weight"][1].astype(np.float32)))


UNSUPPORTED = {
    "tensor type Q5_0": dict(layer_types=[LAYER_TYPES[0], {**LAYER_TYPES[1], "ffn_up": Q.Q5_0}]),
    "architecture 'qwen2'": dict(arch="qwen2"),
    "pre-tokenizer 'llama-bpe'": dict(pre="llama-bpe"),
    "tokenizer model 'llama'": dict(tokenizer_model="llama"),
    "RoPE scaling 'yarn'": dict(extra_metadata={"llama.rope.scaling.type": "yarn"}),
    # the engine implements no linear scaling: a config saying so would be refused at load
    "RoPE scaling 'linear'": dict(extra_metadata={"llama.rope.scaling.type": "linear",
                                                  "llama.rope.scaling.factor": 4.0}),
}


@pytest.mark.parametrize("what", sorted(UNSUPPORTED))
def test_unsupported_inputs_are_refused_and_leave_nothing(tmp_path, what):
    written = write_tiny_llama_gguf(tmp_path / "bad.gguf", **UNSUPPORTED[what])
    with pytest.raises(GGUFConversionError) as error:
        convert_gguf(written.path, tmp_path / "hf")
    message = str(error.value)
    assert what.split()[-1].strip("'") in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.gguf"]


def test_not_a_gguf_file_is_refused(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"GGUF but not really")
    with pytest.raises(GGUFConversionError, match="cannot read"):
        convert_gguf(bad, tmp_path / "hf")


def test_failed_write_leaves_no_directory(tiny, tmp_path, monkeypatch):
    written, _ = tiny

    def disk_full(tensors, path, **kwargs):
        path.write_bytes(b"half a file")
        raise OSError("No space left on device")

    monkeypatch.setattr("engine.formats.safetensors.save_file", disk_full)
    with pytest.raises(GGUFConversionError, match="No space left"):
        convert_gguf(written.path, tmp_path / "hf")
    assert list(tmp_path.iterdir()) == []


def test_marker_is_written_last_and_directory_appears_whole(tiny, tmp_path, monkeypatch):
    written, _ = tiny
    out = tmp_path / "hf"
    writes, real_write = [], gguf_convert._write_json

    def spy(path, obj):
        assert not out.exists(), "the final directory must not exist before everything is written"
        writes.append(path.name)
        real_write(path, obj)

    monkeypatch.setattr(gguf_convert, "_write_json", spy)
    convert_gguf(written.path, out)
    assert writes[-1] == MARKER_FILE and len(writes) == len(HF_FILES) - 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]   # no *.tmp-<pid> left behind


def test_existing_output_directory_is_not_touched(tiny, tmp_path):
    written, _ = tiny
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "mine.txt").write_text("keep")
    with pytest.raises(GGUFConversionError, match="not empty"):
        convert_gguf(written.path, tmp_path / "hf")
    assert (tmp_path / "hf" / "mine.txt").read_text() == "keep"


def test_command_line(tiny, tmp_path, capsys):
    written, _ = tiny
    assert gguf_convert.main([str(written.path), str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / MARKER_FILE).is_file()
    assert "converted" in capsys.readouterr().err
    assert gguf_convert.main([str(written.path), str(tmp_path / "hf")]) == 1
    assert "error: output directory" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# Live: transformers reads the same GGUF itself (skipped when transformers/torch are absent)

live = pytest.mark.skipif(not (importlib.util.find_spec("torch") and importlib.util.find_spec("transformers")),
                          reason="needs torch and transformers")


@live
def test_live_transformers_gguf_reader_agrees(tiny):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    written, out = tiny
    kwargs = dict(gguf_file=written.path.name, dtype=torch.float32)
    from_gguf = AutoModelForCausalLM.from_pretrained(written.path.parent, **kwargs)
    from_dir = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ours = from_dir.state_dict()
    for name, weight in from_gguf.state_dict().items():   # its own dequantizer and un-permutation
        np.testing.assert_array_equal(ours[name].numpy(), bf16_round(weight.numpy()), err_msg=name)
    ids = torch.tensor([[1, 119, 260, 35, 52, 53, 263, 2, 266, 40]])
    with torch.no_grad():
        a, b = from_gguf(ids).logits, from_dir(ids).logits
    assert ((a - b).norm() / a.norm()).item() < 2e-2        # bf16 rounding of the weights only
    tokenizer = AutoTokenizer.from_pretrained(written.path.parent, gguf_file=written.path.name)
    # transformers' GGUF tokenizer has no Digits step, so the "1 2" merge fires there
    assert tokenizer.convert_ids_to_tokens(tokenizer("the 12 is", add_special_tokens=False)["input_ids"]) \
        == ["t", "he", "Ġ", "12", "Ġis"]
