"""Every malformed file is refused with SafetensorsError, and nothing else.

A hand-written corpus (each case names the broken rule) plus two fuzzers that compare us with the
reference `safetensors` library: whatever we accept, it accepts with the same bytes.
"""
import json
import struct

import numpy as np
import pytest
import safetensors
import safetensors.numpy as st_np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.formats.safetensors import (
    INDEX_FILE,
    MAX_HEADER_LENGTH,
    SafetensorsError,
    load_file,
    open_checkpoint,
    safe_open,
    save_file,
)

FUZZ = settings(max_examples=150, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])


def u8(offsets, shape=None, dtype="U8"):
    """One header entry; shape defaults to what the offsets hold for a 1-byte dtype."""
    return {"dtype": dtype, "shape": [offsets[1] - offsets[0]] if shape is None else shape,
            "data_offsets": offsets}


def build(header, data=b"", length=None) -> bytes:
    """8-byte length + header (a dict to JSON-encode, or raw bytes) + data section."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


def raw_header(text: str, data=b"") -> bytes:
    return build(text.encode(), data)


OK_ENTRY = '{"dtype":"U8","shape":[1],"data_offsets":[0,1]}'

# (id, file bytes, words the message must contain). `strict` marks the few cases the reference
# library (0.8) lets through but we refuse on purpose; every other case it refuses too.
CORPUS = [
    ("empty-file", b"", ["too short"]),
    ("truncated-length", b"\x10\x00\x00", ["too short"]),
    ("length-past-end", build({"a": u8([0, 1])}, b"x", length=1000), ["runs past the end"]),
    ("length-2**63", build(b"{}", length=2**63), ["exceeds"]),
    ("length-2**64-1", build(b"{}", length=2**64 - 1), ["exceeds"]),
    ("length-over-limit", build(b"{}", length=MAX_HEADER_LENGTH + 1), ["exceeds"]),
    ("truncated-header", build({"a": u8([0, 4])})[:30], ["runs past the end"]),
    ("truncated-data", build({"a": u8([0, 4])}, b"xy"), ["'a'", "run past the end"]),
    ("length-zero", build(b""), ["start with '{'"]),
    ("invalid-utf8", build(b'{"a\xff":' + OK_ENTRY.encode() + b"}", b"x"), ["UTF-8"]),
    ("invalid-json", raw_header('{"a": {"dtype": "U8"'), ["not valid JSON"]),
    ("trailing-garbage", raw_header("{} x"), ["not valid JSON"]),
    ("trailing-nul-padding", raw_header("{}\0\0"), ["not valid JSON"]),
    ("header-is-list", raw_header("[]"), ["start with '{'"]),
    ("header-is-string", raw_header('"{}"'), ["start with '{'"]),
    ("header-is-number", raw_header("42"), ["start with '{'"]),
    ("nan-constant", raw_header('{"a":{"dtype":"U8","shape":[NaN],"data_offsets":[0,1]}}', b"x"),
     ["NaN"]),
    ("deep-nesting", raw_header('{"a":' + "[" * 100_000 + "]" * 100_000 + "}"), ["nested"]),
    ("entry-not-object", build({"a": 5}), ["'a'", "must be an object"]),
    ("missing-dtype", build({"a": {"shape": [1], "data_offsets": [0, 1]}}, b"x"), ["'a'", "'dtype'"]),
    ("missing-shape", build({"a": {"dtype": "U8", "data_offsets": [0, 1]}}, b"x"), ["'a'", "'shape'"]),
    ("missing-offsets", build({"a": {"dtype": "U8", "shape": [1]}}, b"x"), ["'a'", "'data_offsets'"]),
    ("unknown-dtype", build({"a": u8([0, 1], dtype="F128")}, b"x"), ["'a'", "unknown dtype 'F128'"]),
    ("dtype-lowercase", build({"a": u8([0, 4], [1], dtype="float32")}, b"xxxx"), ["unknown dtype"]),
    ("dtype-not-string", build({"a": u8([0, 1], dtype=["U8"])}, b"x"), ["'a'", "unknown dtype"]),
    ("dtype-null", build({"a": u8([0, 1], dtype=None)}, b"x"), ["'a'", "unknown dtype None"]),
    ("negative-shape", build({"a": u8([0, 1], [-1])}, b"x"), ["'a'", "non-negative"]),
    ("shape-not-list", build({"a": u8([0, 1], "1")}, b"x"), ["'a'", "shape must be a list"]),
    ("shape-is-int", build({"a": u8([0, 1], 1)}, b"x"), ["'a'", "shape must be a list"]),
    ("shape-float", build({"a": u8([0, 1], [1.0])}, b"x"), ["'a'", "shape"]),
    ("shape-bool", build({"a": u8([0, 1], [True])}, b"x"), ["'a'", "shape"]),
    ("shape-nested", build({"a": u8([0, 1], [[1]])}, b"x"), ["'a'", "shape"]),
    ("offsets-reversed", build({"a": u8([1, 0], [0])}, b"x"), ["'a'", "reversed"]),
    ("offsets-negative", build({"a": u8([-1, 0], [1])}, b"x"), ["'a'", "non-negative"]),
    ("offsets-float", build({"a": u8([0, 1.0], [1])}, b"x"), ["'a'", "data_offsets must be"]),
    ("offsets-string", build({"a": u8(["0", "1"], [1])}, b"x"), ["'a'", "data_offsets must be"]),
    ("offsets-three", build({"a": u8([0, 1, 2], [1])}, b"x"), ["'a'", "data_offsets must be"]),
    ("offsets-one", build({"a": u8([0], [1])}, b"x"), ["'a'", "data_offsets must be"]),
    ("offsets-huge", build({"a": u8([2**64, 2**64 + 1])}, b"x"), ["'a'", "run past the end"]),
    ("out-of-range", build({"a": u8([0, 2]), "b": u8([2, 9])}, b"xyz"), ["'b'", "run past the end"]),
    ("overlap", build({"a": u8([0, 2]), "b": u8([1, 3])}, b"xyz"), ["'b'", "overlap", "'a'"]),
    ("overlap-identical", build({"a": u8([0, 2]), "b": u8([0, 2])}, b"xy"), ["overlap"]),
    ("empty-inside-another", build({"a": u8([0, 2]), "b": u8([1, 1])}, b"xy"), ["'b'", "overlap"]),
    ("hole-between", build({"a": u8([0, 1]), "b": u8([2, 3])}, b"xyz"), ["hole", "[1, 2)", "'a'"]),
    ("hole-at-start", build({"a": u8([1, 2])}, b"xy"), ["hole", "[0, 1)", "'a'"]),
    ("trailing-bytes", build({"a": u8([0, 1])}, b"xyz"), ["2 trailing bytes", "'a'"]),
    ("no-tensors-but-data", build({}, b"xy"), ["trailing bytes"]),
    ("size-mismatch", build({"a": u8([0, 8], [3], dtype="F32")}, b"x" * 8),
     ["'a'", "needs 12 bytes", "hold 8"]),
    ("bf16-odd-bytes", build({"a": u8([0, 3], [1], dtype="BF16")}, b"xyz"), ["'a'", "needs 2 bytes"]),
    ("shape-overflows-int64", build({"a": u8([0, 8], [2**32, 2**32], dtype="F32")}, b"x" * 8),
     ["'a'", "overflows int64"]),
    ("shape-overflows-with-zero", build({"a": u8([0, 0], [2**62, 4, 0], dtype="F32")}),
     ["'a'", "overflows int64"]),
    ("shape-huge", build({"a": u8([0, 0], [2**70])}), ["'a'", "overflows int64"]),
    ("metadata-int-value", build({"__metadata__": {"k": 1}}), ["__metadata__['k']", "string"]),
    ("metadata-nested", build({"__metadata__": {"k": {"x": "y"}}}), ["__metadata__['k']"]),
    ("metadata-list", build({"__metadata__": ["k"]}), ["__metadata__ must be an object"]),
    ("duplicate-field", raw_header('{"a":{"dtype":"U8","dtype":"I8","shape":[1],'
                                   '"data_offsets":[0,1]}}', b"x"), ["duplicate key 'dtype'"]),
]
STRICT = [  # valid for the reference library 0.8, refused by us on purpose (see notes/01)
    ("duplicate-tensor", raw_header(f'{{"a":{OK_ENTRY},"a":{OK_ENTRY}}}', b"x"),
     ["duplicate key 'a'"]),
    ("leading-space", raw_header(" {}"), ["start with '{'"]),  # the spec: MUST begin with '{'
    ("zero-dim-hides-overflow", build({"a": u8([0, 0], [0, 2**62, 4], dtype="F32")}),
     ["'a'", "overflows int64"]),  # NumPy cannot even create this empty array
    ("packed-f4", build({"a": u8([0, 1], [2], dtype="F4")}, b"x"), ["'a'", "F4", "packs"]),
]


def write(tmp_path, blob: bytes):
    path = tmp_path / "model.safetensors"
    path.write_bytes(blob)
    return path


def library_rejects(path) -> bool:
    try:
        with safetensors.safe_open(path, "np") as f:
            for name in f.keys():
                f.get_tensor(name)
    except Exception:  # noqa: BLE001 - the library has no single error type for "malformed"
        return True
    return False


@pytest.mark.parametrize("blob, words", [pytest.param(b, w, id=i) for i, b, w in CORPUS + STRICT])
def test_malformed_file_is_refused(tmp_path, blob, words):
    path = write(tmp_path, blob)
    for opener in (safe_open, load_file, open_checkpoint, lambda p: open_checkpoint(p.parent)):
        with pytest.raises(SafetensorsError) as err:
            opener(path)
        message = str(err.value)
        assert str(path) in message
        for word in words:
            assert word in message, f"{word!r} missing from: {message}"


@pytest.mark.parametrize("blob", [pytest.param(b, id=i) for i, b, _ in CORPUS])
def test_the_reference_library_refuses_the_corpus_too(tmp_path, blob):
    """Keeps the corpus honest: each case really breaks the format, not just our taste."""
    assert library_rejects(write(tmp_path, blob))


def test_metadata_null_and_unknown_fields_are_accepted(tmp_path):
    """Tolerated like the reference: `"__metadata__": null` and extra keys in an entry."""
    entry = {**u8([0, 1]), "comment": "ignored"}
    with safe_open(write(tmp_path, build({"__metadata__": None, "a": entry}, b"x"))) as f:
        assert f.metadata == {} and f.get_tensor("a").tobytes() == b"x"


# ----------------------------------------------------------------------------- fuzzing

def valid_file() -> bytes:
    rng = np.random.default_rng(0)
    return st_np.save({"a": rng.standard_normal((2, 3)).astype(np.float32),
                       "b": np.arange(5, dtype=np.int16), "c": np.zeros(0, np.uint8),
                       "d": np.array(True)}, metadata={"k": "v"})


VALID = valid_file()


def assert_same_verdict(path):
    """We accept only what the library accepts, with the same bytes; our only errors are ours."""
    try:
        ours = load_file(path)
    except SafetensorsError:
        return
    theirs = dict(safetensors.deserialize(path.read_bytes()))  # raw bytes of every dtype
    assert sorted(ours) == sorted(theirs)
    with safe_open(path) as f:
        for name, tensor in theirs.items():
            assert (f.dtype(name), list(f.shape(name))) == (tensor["dtype"], tensor["shape"])
            assert f.raw(name).tobytes() == bytes(tensor["data"])


@FUZZ
@given(edits=st.lists(st.tuples(st.integers(0, len(VALID) - 1),
                                st.integers(0, 255) | st.sampled_from(b'0123456789 ,:[]{}"')),
                      max_size=3),
       cut=st.none() | st.integers(0, len(VALID)))
def test_corrupted_bytes(tmp_path, edits, cut):
    blob = bytearray(VALID)
    for position, value in edits:
        blob[position] = value
    assert_same_verdict(write(tmp_path, bytes(blob[:cut])))


json_values = st.recursive(st.none() | st.booleans() | st.integers(-2, 2**64) | st.text(max_size=3),
                           lambda inner: st.lists(inner, max_size=3), max_leaves=4)


@st.composite
def near_valid_files(draw) -> bytes:
    """Mostly well-formed layouts with a few off-by-one offsets, sizes and junk fields."""
    nudge = st.sampled_from([0, 0, 0, 0, 0, -1, 1])
    header, end_of_data = {}, 0
    for name in draw(st.permutations("abcd"))[:draw(st.integers(0, 4))]:
        dtype = draw(st.sampled_from(["U8", "I16", "F32", "BF16", "F8_E4M3", "F64", "C64"]))
        shape = draw(st.lists(st.integers(0, 3), max_size=3))
        begin = end_of_data + draw(nudge)
        end = begin + int(np.prod(shape)) * (2 if dtype in ("I16", "BF16") else 1 if dtype in (
            "U8", "F8_E4M3") else 4 if dtype == "F32" else 8) + draw(nudge)
        entry = {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}
        if draw(st.integers(0, 9)) == 0:
            entry[draw(st.sampled_from(sorted(entry)))] = draw(json_values)
        header[name] = entry
        end_of_data = max(end_of_data, end)
    return build(header, bytes(max(0, end_of_data + draw(nudge))))


@pytest.mark.slow
@FUZZ
@given(blob=near_valid_files())
def test_random_headers(tmp_path, blob):
    assert_same_verdict(write(tmp_path, blob))


# ----------------------------------------------------------------------------- sharded indexes

@pytest.mark.parametrize("shard", ["../evil.safetensors", "/etc/passwd", "sub/model.safetensors",
                                   "..", ".", "", "a\\..\\b", "x\0y", 5, None])
def test_index_shard_names_must_stay_in_the_directory(tmp_path, shard):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    save_file({"a": np.ones(2, np.float32)}, tmp_path / "evil.safetensors")  # the bait, outside
    (model_dir / INDEX_FILE).write_text(json.dumps({"weight_map": {"a": shard}}))
    with pytest.raises(SafetensorsError, match="plain file name"):
        open_checkpoint(model_dir)


@pytest.mark.parametrize("index, words", [
    ("{not json", ["not a valid JSON index"]),
    ("[]", ["weight_map"]),
    ('{"weight_map": ["a"]}', ["weight_map"]),
    ('{"weight_map": {"a": "missing.safetensors"}}', ["'missing.safetensors' does not exist"]),
    ('{"weight_map": {"a": "s1.safetensors", "z": "s1.safetensors"}}', ["'z' is not in shard"]),
    ('{"weight_map": {"a": "s2.safetensors", "b": "s2.safetensors"}}', ["'a' is not in shard"]),
    ('{"weight_map": {"a": "s1.safetensors"}}', ["['c']", "not in the weight_map"]),
    ('{"weight_map": {"a": "s1.safetensors", "b": "s2.safetensors", "c": "s3.safetensors"}}',
     ["'c' is in both"]),
])
def test_broken_index(tmp_path, index, words):
    save_file({"a": np.ones(1, np.float32), "c": np.ones(1, np.float32)}, tmp_path / "s1.safetensors")
    save_file({"b": np.ones(1, np.float32)}, tmp_path / "s2.safetensors")
    save_file({"c": np.ones(1, np.float32)}, tmp_path / "s3.safetensors")
    (tmp_path / INDEX_FILE).write_text(index)
    with pytest.raises(SafetensorsError) as err:
        open_checkpoint(tmp_path)
    for word in words:
        assert word in str(err.value), str(err.value)


def test_broken_shard_names_the_shard(tmp_path):
    (tmp_path / "s1.safetensors").write_bytes(build({"a": u8([0, 2])}, b"x"))
    (tmp_path / INDEX_FILE).write_text(json.dumps({"weight_map": {"a": "s1.safetensors"}}))
    with pytest.raises(SafetensorsError, match=r"s1\.safetensors.*'a'.*run past the end"):
        open_checkpoint(tmp_path)


def test_empty_directory(tmp_path):
    with pytest.raises(SafetensorsError, match="found neither"):
        open_checkpoint(tmp_path)
