"""Malformed GGUF files: every one ends in GGUFConversionError, within a work and memory bound.

Three corpora: hand-built files that each break one rule (counts larger than the file, duplicate
keys, absurd dimensions, wrong value types, ...), a small valid file truncated at every offset, and
random corruption of its header fields. No case may loop (more than CALLS function calls, counted by
tests/helpers/work.py: a whole valid conversion of the tiny test model makes about 70,000),
allocate more than PEAK_BYTES, or end in any other exception type.
"""
from __future__ import annotations

import resource
import struct
import tracemalloc
from pathlib import Path

import gguf
import numpy as np
import pytest
from helpers.default_model import write_tiny_llama_gguf
from helpers.work import WorkBudgetExceeded, call_budget
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.formats import gguf_reader
from engine.formats.gguf_convert import GGUFConversionError, convert_gguf
from engine.formats.gguf_reader import GGUFFile, GGUFFormatError

CALLS = 200_000
PEAK_BYTES = 32 << 20
Q = gguf.GGMLQuantizationType

# ---------------------------------------------------------------------------------------------
# A byte-level GGUF writer, independent of the reader under test

U8, U32, F32, BOOL, STR, ARR, U64 = 0, 4, 6, 7, 8, 9, 10


def gstr(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def kv(key: str, value_type: int, payload: bytes) -> bytes:
    return gstr(key) + struct.pack("<I", value_type) + payload


def header(tensor_count: int, kv_count: int, version: int = 3) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, tensor_count, kv_count)


def u32(value: int) -> bytes:
    return struct.pack("<I", value)


def tensor_info(name: str, dims, ggml_type: int, offset: int) -> bytes:
    return gstr(name) + u32(len(dims)) + b"".join(struct.pack("<Q", d) for d in dims) + u32(ggml_type) \
        + struct.pack("<Q", offset)


ARCH = kv("general.architecture", STR, gstr("llama"))

HAND_BUILT = {
    # the 68-byte file of the report: one array claiming 2^62 elements
    "array of 2^62 elements": header(0, 1) + kv("a", ARR, u32(U8) + struct.pack("<Q", 1 << 62)) + b"\0" * 19,
    "string array of 2^40": header(0, 1) + kv("a", ARR, u32(STR) + struct.pack("<Q", 1 << 40)) + b"\0" * 16,
    "tensor count 2^63": header(1 << 63, 0),
    "key count 2^63": header(0, 1 << 63),
    "key length 2^63": header(0, 1) + struct.pack("<Q", 1 << 63) + b"k",
    "string value length 2^60": header(0, 1) + kv("a", STR, struct.pack("<Q", 1 << 60) + b"xy"),
    "duplicate key": header(0, 2) + ARCH + ARCH,
    "unknown value type": header(0, 1) + kv("a", 99, b"\0" * 8),
    "nested arrays too deep": header(0, 1) + kv("a", ARR, (u32(ARR) + struct.pack("<Q", 1)) * 6 + u32(U8)
                                                + struct.pack("<Q", 0)),
    "invalid utf-8 key": header(0, 1) + gstr(b"\xff\xfe") + u32(U8) + b"\0",
    "version 1": header(0, 0, version=1),
    "big-endian": b"GGUF" + struct.pack(">IQQ", 3, 0, 0),
    "not gguf": b"GGML" + b"\0" * 40,
    "empty": b"",
    "header only, truncated": header(0, 5)[:20],
    "alignment zero": header(0, 1) + kv("general.alignment", U32, u32(0)),
    "alignment not a power of two": header(0, 1) + kv("general.alignment", U32, u32(48)),
    "tensor with 5 dims": header(1, 0) + tensor_info("t", [32, 1, 1, 1, 1], 0, 0) + b"\0" * 200,
    "tensor with a zero dim": header(1, 0) + tensor_info("t", [32, 0], 0, 0) + b"\0" * 200,
    "tensor dim 2^63": header(1, 0) + tensor_info("t", [32, 1 << 63], 0, 0) + b"\0" * 200,
    "unknown ggml type": header(1, 0) + tensor_info("t", [32], 999, 0) + b"\0" * 200,
    "quantized row not whole blocks": header(1, 0) + tensor_info("t", [33], int(Q.Q8_0), 0) + b"\0" * 200,
    "tensor past end of file": header(1, 0) + tensor_info("t", [1024, 1024], 0, 0) + b"\0" * 200,
    "tensor offset past end": header(1, 0) + tensor_info("t", [4], 0, 1 << 62) + b"\0" * 200,
    "misaligned tensor offset": header(1, 0) + tensor_info("t", [4], 0, 3) + b"\0" * 200,
    "duplicate tensor": header(2, 0) + tensor_info("t", [4], 0, 0) + tensor_info("t", [4], 0, 32) + b"\0" * 200,
    "no tensors at all": header(0, 1) + ARCH,
}

# Valid files with one bad metadata value: each must be refused before anything big is allocated.
BAD_METADATA = {
    "block_count 10^9": {"llama.block_count": 10**9},
    "head_count 0": {"llama.attention.head_count": 0},
    "head_count_kv 0": {"llama.attention.head_count_kv": 0},
    "heads not dividing hidden": {"llama.attention.head_count": 5},
    "kv heads not dividing heads": {"llama.attention.head_count_kv": 3},
    "embedding_length 0": {"llama.embedding_length": 0},
    "context_length absurd": {"llama.context_length": 4_000_000_000},
    "head_count as string": {"llama.attention.head_count": "4"},
    "head_count as bool": {"llama.attention.head_count": True},
    "rope freq_base tiny": {"llama.rope.freq_base": 1e-30},
    "rms eps as string": {"llama.attention.layer_norm_rms_epsilon": "1e-5"},
    "bos id past vocab": {"tokenizer.ggml.bos_token_id": 10**6},
    "eos id past vocab": {"tokenizer.ggml.eos_token_id": 4_000_000_000},
    "tokens not strings": {"tokenizer.ggml.tokens": [1, 2, 3]},
    "token types too short": {"tokenizer.ggml.token_type": [1, 1]},
    "merges not strings": {"tokenizer.ggml.merges": [1.5]},
    "merge not a pair": {"tokenizer.ggml.merges": ["abc"]},
    "chat template not a string": {"tokenizer.chat_template": 5},
    "tokenizer model as int": {"tokenizer.ggml.model": 7},
}


def bounded(function):
    """(outcome, function calls made, peak traced bytes) of one call; tracemalloc must already be running.
    Past CALLS calls, WorkBudgetExceeded stops the call (and fails the test) instead of letting it loop."""
    tracemalloc.reset_peak()
    with call_budget(CALLS) as work:
        try:
            outcome = function()
        except Exception as e:   # noqa: BLE001 -- inspected by the caller
            outcome = e
    return outcome, work.calls, tracemalloc.get_traced_memory()[1]


@pytest.fixture
def traced():
    tracemalloc.start()
    yield
    tracemalloc.stop()


def assert_refused(outcome, calls, peak, what):
    assert isinstance(outcome, GGUFConversionError), f"{what}: {type(outcome).__name__}: {str(outcome)[:300]}"
    assert calls <= CALLS, f"{what}: {calls:,} calls"
    assert peak < PEAK_BYTES, f"{what}: peak {peak / 2**20:.0f} MiB"


@pytest.mark.parametrize("name", sorted(HAND_BUILT))
def test_hand_built_malformed_files(tmp_path, traced, name):
    path = tmp_path / "bad.gguf"
    path.write_bytes(HAND_BUILT[name])
    assert_refused(*bounded(lambda: convert_gguf(path, tmp_path / "hf")), name)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.gguf"]


def test_the_report_file_is_68_bytes():
    assert len(HAND_BUILT["array of 2^62 elements"]) == 68


@pytest.mark.parametrize("name", sorted(BAD_METADATA))
def test_bad_metadata_values(tmp_path, name):
    written = write_tiny_llama_gguf(tmp_path / "bad.gguf", extra_metadata=BAD_METADATA[name])
    tracemalloc.start()
    try:
        outcome = bounded(lambda: convert_gguf(written.path, tmp_path / "hf"))
    finally:
        tracemalloc.stop()
    assert_refused(*outcome, name)


# ---------------------------------------------------------------------------------------------
# A small valid file, truncated at every offset and corrupted at random


def write_small_gguf(path: Path) -> bytes:
    """A complete one-layer Llama GGUF of a few kB that converts successfully."""
    h, f, heads, kv_heads = 32, 32, 2, 1
    tokens = ["<|endoftext|>", "a", "b", "ab", "Ġ", "Ġa"]
    writer = gguf.GGUFWriter(path, "llama")
    for key, value in {"llama.context_length": 64, "llama.embedding_length": h, "llama.feed_forward_length": f,
                       "llama.block_count": 1, "llama.attention.head_count": heads,
                       "llama.attention.head_count_kv": kv_heads, "tokenizer.ggml.bos_token_id": 0,
                       "tokenizer.ggml.eos_token_id": 0}.items():
        writer.add_uint32(key, value)
    writer.add_float32("llama.rope.freq_base", 10000.0)
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_string("tokenizer.ggml.pre", "smollm")
    writer.add_array("tokenizer.ggml.tokens", tokens)
    writer.add_array("tokenizer.ggml.token_type", [3, 1, 1, 1, 1, 1])
    writer.add_array("tokenizer.ggml.merges", ["a b", "Ġ a"])
    writer.add_string("tokenizer.chat_template", "{{ messages[0].content }}")
    rng = np.random.default_rng(0)

    def add(name, shape, qtype=Q.F32):
        w = (rng.standard_normal(shape) * 0.1).astype(np.float32)
        raw = w if qtype == Q.F32 else gguf.quants.quantize(w, qtype)
        writer.add_tensor(name, raw, raw_dtype=None if qtype == Q.F32 else qtype)

    add("token_embd.weight", (len(tokens), h), Q.Q8_0)
    add("blk.0.attn_norm.weight", (h,))
    add("blk.0.ffn_norm.weight", (h,))
    for name, shape in {"attn_q": (h, h), "attn_k": (h // heads * kv_heads, h), "attn_v": (h // heads * kv_heads, h),
                        "attn_output": (h, h), "ffn_gate": (f, h), "ffn_up": (f, h), "ffn_down": (h, f)}.items():
        add(f"blk.0.{name}.weight", shape, Q.Q4_0)
    add("output_norm.weight", (h,))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.read_bytes()


@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory):
    root = tmp_path_factory.mktemp("small")
    data = write_small_gguf(root / "small.gguf")
    convert_gguf(root / "small.gguf", root / "hf")   # the untouched file is valid
    return data


def test_truncation_at_every_offset(small_gguf, monkeypatch):
    """The header reader on every prefix of the file: refused, or (trailing padding cut) still whole.

    Thousands of cases: memory is bounded by the process high-water mark over the whole loop
    (tracemalloc would make it ten times slower); the per-case bounds run in the tests around it.
    The work is the reader's field reads (every one goes through _Cursor.take): a prefix of n bytes
    allows at most n of them, and one more stops the case."""
    whole = GGUFFile(small_gguf)
    reads = [0, 0]   # [reads so far, allowed]
    take = gguf_reader._Cursor.take

    def counted_take(cursor, n, what):
        reads[0] += 1
        if reads[0] > reads[1]:
            raise WorkBudgetExceeded(f"more than {reads[1]:,} field reads")
        return take(cursor, n, what)

    monkeypatch.setattr(gguf_reader._Cursor, "take", counted_take)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    for length in range(len(small_gguf)):
        reads[:] = [0, length]
        try:
            outcome = GGUFFile(small_gguf[:length])
        except Exception as e:   # noqa: BLE001 -- checked below
            outcome = e
        assert reads[0] <= length, length
        if isinstance(outcome, GGUFFile):
            assert [t.name for t in outcome.tensors] == [t.name for t in whole.tensors]
            assert length >= whole.tensors[-1].offset + whole.tensors[-1].nbytes, length
            continue
        assert isinstance(outcome, GGUFFormatError), f"{length}: {type(outcome).__name__}: {outcome}"
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss_before < 4 * PEAK_BYTES


def test_truncated_files_are_refused_by_the_converter(small_gguf, tmp_path, traced):
    """The same through convert_gguf and a real file, on a stride of offsets (file writes are slow)."""
    path, end = tmp_path / "cut.gguf", GGUFFile(small_gguf).tensors[-1]
    for length in [*range(0, len(small_gguf), 37), end.offset + end.nbytes - 1]:
        path.write_bytes(small_gguf[:length])
        assert_refused(*bounded(lambda: convert_gguf(path, tmp_path / "hf")), f"truncated to {length}")
        assert sorted(p.name for p in tmp_path.iterdir()) == ["cut.gguf"]


INTERESTING = [0, 1, 2**31, 2**32 - 1, 2**62, 2**63, 2**64 - 1]


@pytest.mark.slow
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_field_corruption(small_gguf, tmp_path, data):
    """Overwrite a random header position with a random or boundary value (counts, lengths, types, dims)."""
    header_end = small_gguf.index(b"\0" * 16, 24) if b"\0" * 16 in small_gguf[24:] else 2048
    corrupted = bytearray(small_gguf)
    position = data.draw(st.integers(4, max(header_end, 64)))
    if data.draw(st.booleans()):
        value = data.draw(st.sampled_from(INTERESTING) | st.integers(0, 2**64 - 1))
        patch = struct.pack("<Q", value)[:data.draw(st.sampled_from([4, 8]))]
    else:
        patch = data.draw(st.binary(min_size=1, max_size=4))
    corrupted[position:position + len(patch)] = patch
    path = tmp_path / f"corrupt-{position}.gguf"
    path.write_bytes(bytes(corrupted))
    out = tmp_path / f"hf-{position}"
    tracemalloc.start()
    try:
        outcome, calls, peak = bounded(lambda: convert_gguf(path, out))
    finally:
        tracemalloc.stop()
    if not isinstance(outcome, Path):   # a corruption may leave a valid file (a changed weight byte)
        assert_refused(outcome, calls, peak, f"{len(patch)} bytes at {position}")
