"""engine.formats.safetensors against the reference `safetensors` library, in both directions.

Malformed files live in test_safetensors_malformed.py; this file is about valid ones.
"""
import gc
import json
import struct

import numpy as np
import pytest
import safetensors
import safetensors.numpy as st_np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from engine.backend import bf16_to_f32, f32_to_bf16
from engine.formats.safetensors import (
    DTYPES,
    INDEX_FILE,
    SafetensorsError,
    TensorNotFoundError,
    load_file,
    open_checkpoint,
    safe_open,
    save_file,
)

# Every dtype NumPy can hold directly, with the name the format gives it.
NUMPY_DTYPES = {"BOOL": "?", "U8": "u1", "I8": "i1", "U16": "<u2", "I16": "<i2", "U32": "<u4",
                "I32": "<i4", "U64": "<u8", "I64": "<i8", "F16": "<f2", "F32": "<f4", "F64": "<f8"}
# dtype name the reference serializer takes for the formats NumPy has no dtype for.
LIBRARY_BIT_DTYPES = {"BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
                      "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2FNUZ": "float8_e5m2fnuz",
                      "F8_E8M0": "float8_e8m0fnu"}
FAST = settings(max_examples=40, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])

names = st.text(st.characters(exclude_categories=["Cs"]), max_size=8).filter(
    lambda s: s != "__metadata__")
shapes = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=5)  # includes () and 0-sized


@st.composite
def numpy_tensors(draw, dtype_names=tuple(NUMPY_DTYPES)):
    """name -> array of any NumPy-representable safetensors dtype (NaN/inf included)."""
    chosen = draw(st.dictionaries(names, st.sampled_from(dtype_names), max_size=5))
    return {name: draw(hnp.arrays(np.dtype(NUMPY_DTYPES[dt]), shapes)) for name, dt in chosen.items()}


metadata_dicts = st.none() | st.dictionaries(names, st.text(st.characters(exclude_categories=["Cs"]),
                                                            max_size=8), max_size=3)


def same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal dtype, shape and bit patterns (so NaNs compare equal to themselves)."""
    return (a.dtype == b.dtype and a.shape == b.shape
            and np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes())


def library_serialize(tensors: dict, metadata=None) -> bytes:
    """The reference writer fed raw bits: {name: (library dtype, shape, uint array)}."""
    specs = {name: safetensors.TensorSpec(dtype=dt, shape=list(shape), data_ptr=bits.ctypes.data,
                                          data_len=bits.nbytes)
             for name, (dt, shape, bits) in tensors.items()}
    return bytes(safetensors.serialize(specs, metadata=metadata))


# ----------------------------------------------------------------------------- both directions

@FAST
@given(tensors=numpy_tensors(), metadata=metadata_dicts)
def test_our_writer_is_read_by_the_library(tmp_path, tensors, metadata):
    path = tmp_path / "ours.safetensors"
    save_file(tensors, path, metadata=metadata)
    with safetensors.safe_open(path, "np") as f:
        assert sorted(f.keys()) == sorted(tensors)
        assert (f.metadata() or {}) == (metadata or {})
        for name, array in tensors.items():
            assert same_bytes(f.get_tensor(name), array.astype(array.dtype.newbyteorder("<")))


@FAST
@given(tensors=numpy_tensors(), metadata=metadata_dicts)
def test_library_writer_is_read_by_us(tmp_path, tensors, metadata):
    if not tensors and metadata == {}:
        metadata = None  # safetensors 0.8 writes the invalid header '{},"__metadata__":{}}' here
    path = tmp_path / "theirs.safetensors"
    st_np.save_file(tensors, path, metadata=metadata)
    loaded = load_file(path)
    assert sorted(loaded) == sorted(tensors)
    for name, array in tensors.items():
        assert same_bytes(loaded[name], array)
    with safe_open(path) as f:
        assert f.metadata == (metadata or {})
        for name, array in tensors.items():
            assert f.dtype(name) == next(k for k, v in NUMPY_DTYPES.items() if np.dtype(v) == array.dtype)
            assert f.shape(name) == array.shape


@FAST
@given(dtype=st.sampled_from(sorted(LIBRARY_BIT_DTYPES)), shape=shapes, data=st.data())
def test_bit_formats_written_by_the_library(tmp_path, dtype, shape, data):
    """BF16 and FP8: raw() gives the stored bits; get_tensor() decodes them exactly."""
    bits_dtype = DTYPES[dtype][0]
    bits = data.draw(hnp.arrays(bits_dtype, shape))
    path = tmp_path / "bits.safetensors"
    path.write_bytes(library_serialize({"t": (LIBRARY_BIT_DTYPES[dtype], shape, bits)}))
    with safe_open(path) as f:
        assert f.dtype("t") == dtype and f.shape("t") == shape
        assert same_bytes(f.raw("t"), bits)
        values = f.get_tensor("t")
        assert values.dtype == np.float32 and values.shape == shape
        if dtype == "BF16":  # bf16 is the top half of a float32: widening is a shift, NaNs included
            assert same_bytes(values.view(np.uint32), bits.astype(np.uint32) << 16)
        if dtype == "F8_E5M2":  # E5M2 is the top byte of an IEEE float16
            half = (bits.astype(np.uint16) << 8).view(np.float16).astype(np.float32)
            np.testing.assert_array_equal(values, half)


@FAST
@given(tensors=numpy_tensors(("F16", "F32", "F64")))
def test_bf16_writer_is_read_by_the_library(tmp_path, tensors):
    path = tmp_path / "bf16.safetensors"
    save_file(tensors, path, dtype="BF16")
    stored = dict(safetensors.deserialize(path.read_bytes()))
    assert sorted(stored) == sorted(tensors)
    for name, array in tensors.items():
        assert stored[name]["dtype"] == "BF16" and stored[name]["shape"] == list(array.shape)
        with np.errstate(over="ignore"):      # float64 beyond float32's range: inf, like the writer
            expected = f32_to_bf16(array.astype(np.float32)).tobytes()
        assert bytes(stored[name]["data"]) == expected


@FAST
@given(tensors=numpy_tensors(), padding=st.text(" ", max_size=40))
def test_whitespace_padded_header(tmp_path, tensors, padding):
    """Writers pad the JSON with spaces (to align the data section); readers must accept any amount."""
    blob = st_np.save(tensors)
    n = struct.unpack("<Q", blob[:8])[0]
    header = blob[8:8 + n] + padding.encode()
    path = tmp_path / "padded.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + blob[8 + n:])
    ours = load_file(path)
    theirs = st_np.load_file(path)
    assert sorted(ours) == sorted(theirs)
    for name in theirs:
        assert same_bytes(ours[name], theirs[name])


@pytest.mark.parametrize("target", ["F16", "F32", "F64"])
def test_float_dtype_conversion_on_write(tmp_path, target):
    x = np.linspace(-3, 3, 12, dtype=np.float32).reshape(3, 4)
    save_file({"x": x, "ids": np.arange(3, dtype=np.int64)}, tmp_path / "m.safetensors", dtype=target)
    with safe_open(tmp_path / "m.safetensors") as f:
        assert f.dtype("x") == target and f.dtype("ids") == "I64"  # integers are never converted
        np.testing.assert_array_equal(f.get_tensor("x"), x.astype(DTYPES[target][0]))


def test_layout_of_our_files(tmp_path):
    """Header padded to 8 bytes, tensors back to back in name order, scalars keep shape ()."""
    path = tmp_path / "m.safetensors"
    save_file({"b": np.ones((2, 3), np.float32), "a": np.array(7, np.int64),
               "c": np.zeros((0, 4), np.float16)}, path, metadata={"format": "np"})
    with safe_open(path) as f:
        assert f.header_length % 8 == 0 and f.data_start % 8 == 0
        assert f.keys() == ["a", "b", "c"]
        assert [(f.info(k).begin, f.info(k).end) for k in f.keys()] == [(0, 8), (8, 32), (32, 32)]
        assert f.shape("a") == () and f.get_tensor("a") == 7
        assert f.metadata == {"format": "np"}
    assert not [p for p in tmp_path.iterdir() if p.name != "m.safetensors"]  # no temp file left


# ----------------------------------------------------------------------------- mmap behaviour

def test_tensors_are_read_only_views_of_the_mapping(tmp_path):
    path = tmp_path / "m.safetensors"
    save_file({"w": np.arange(12, dtype=np.float32).reshape(3, 4)}, path)
    with safe_open(path) as f:
        w, raw = f.get_tensor("w"), f.raw("w")
        assert np.shares_memory(w, raw) and not w.flags.writeable
        base = w
        while isinstance(base, np.ndarray):
            base = base.base
        assert isinstance(base, memoryview) and type(base.obj).__name__ == "mmap"
        with pytest.raises(ValueError):
            w[0, 0] = 1.0


def test_arrays_outlive_the_file_object(tmp_path):
    path = tmp_path / "m.safetensors"
    expected = np.arange(1000, dtype=np.int32)
    save_file({"x": expected}, path)
    loaded = load_file(path)  # the file is closed on return; the views keep the mapping alive
    gc.collect()
    np.testing.assert_array_equal(loaded["x"], expected)


def test_closed_file_refuses_reads(tmp_path):
    path = tmp_path / "m.safetensors"
    save_file({"x": np.ones(3, np.float32)}, path)
    f = safe_open(path)
    f.close()
    with pytest.raises(SafetensorsError, match="closed"):
        f.raw("x")


def test_bf16_bits_from_any_float_dtype(tmp_path):
    x = np.array([1.0, 1.00390625, 1.01171875, -2.5e-3, np.inf, np.nan], np.float32)  # ties included
    path = tmp_path / "m.safetensors"
    save_file({"f32": x, "f16": x.astype(np.float16), "i": np.arange(3)}, path)
    save_file({"bf16": x}, tmp_path / "b.safetensors", dtype="BF16")
    with safe_open(path) as f, safe_open(tmp_path / "b.safetensors") as b:
        np.testing.assert_array_equal(f.get_bf16_bits("f32"), f32_to_bf16(x))
        np.testing.assert_array_equal(f.get_bf16_bits("f16"), f32_to_bf16(x.astype(np.float16)))
        np.testing.assert_array_equal(b.get_bf16_bits("bf16"), f32_to_bf16(x))
        np.testing.assert_array_equal(b.get_tensor("bf16"), bf16_to_f32(f32_to_bf16(x)))
        with pytest.raises(SafetensorsError, match="'i' is I64"):
            f.get_bf16_bits("i")


def test_fp8_tables_known_values(tmp_path):
    codes = np.array([0x00, 0x01, 0x08, 0x38, 0x7E, 0x7F, 0x80, 0xFE], np.uint8)
    expect = {
        "F8_E4M3": [0.0, 2.0**-9, 2.0**-6, 1.0, 448.0, np.nan, -0.0, -448.0],
        "F8_E4M3FNUZ": [0.0, 2.0**-10, 2.0**-7, 0.5, 224.0, 240.0, np.nan, -224.0],
        "F8_E8M0": [2.0**-127, 2.0**-126, 2.0**-119, 2.0**-71, 2.0**-1, 1.0, 2.0, 2.0**127],
    }
    for dtype, values in expect.items():
        path = tmp_path / f"{dtype}.safetensors"
        path.write_bytes(library_serialize({"t": (LIBRARY_BIT_DTYPES[dtype], [8], codes)}))
        np.testing.assert_array_equal(load_file(path)["t"], np.array(values, np.float32))


def test_missing_tensor_is_a_key_error_too(tmp_path):
    path = tmp_path / "m.safetensors"
    save_file({"x": np.ones(1, np.float32)}, path)
    with safe_open(path) as f, pytest.raises(TensorNotFoundError) as err:
        f.get_tensor("model.missing.weight")
    assert isinstance(err.value, KeyError) and isinstance(err.value, SafetensorsError)
    assert "model.missing.weight" in str(err.value) and str(path) in str(err.value)


# ----------------------------------------------------------------------------- the writer refuses

@pytest.mark.parametrize("tensors, kwargs, message", [
    ({"x": np.array(["a"], dtype=object)}, {}, "no safetensors equivalent"),
    ({"x": np.ones(2)}, {"metadata": {"k": 1}}, "strings to strings"),
    ({"x": np.ones(2)}, {"dtype": "I8"}, "dtype must be one of"),
    ({"__metadata__": np.ones(2)}, {}, "invalid tensor name"),
    ({"\ud800": np.ones(2)}, {}, "not valid Unicode"),
])
def test_writer_refuses_and_leaves_the_old_file(tmp_path, tensors, kwargs, message):
    path = tmp_path / "m.safetensors"
    save_file({"old": np.ones(3, np.float32)}, path)
    before = path.read_bytes()
    with pytest.raises(SafetensorsError, match=message):
        save_file(tensors, path, **kwargs)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["m.safetensors"]


# ----------------------------------------------------------------------------- checkpoints

def write_sharded(model_dir, shards: dict, weight_map=None):
    """shards: file name -> tensors. The index lists every tensor unless weight_map is given."""
    model_dir.mkdir(exist_ok=True)
    for shard, tensors in shards.items():
        save_file(tensors, model_dir / shard)
    if weight_map is None:
        weight_map = {name: shard for shard, tensors in shards.items() for name in tensors}
    (model_dir / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_sharded_checkpoint(tmp_path):
    a, b = np.arange(4, dtype=np.float32), np.full((2, 2), 0.5, np.float32)
    write_sharded(tmp_path, {"model-00001-of-00002.safetensors": {"a": a},
                             "model-00002-of-00002.safetensors": {"b": b}})
    with open_checkpoint(tmp_path) as ckpt:
        assert sorted(ckpt.keys()) == ["a", "b"] and len(ckpt) == 2 and "a" in ckpt
        np.testing.assert_array_equal(ckpt.get_tensor("a"), a)
        assert ckpt.dtype("b") == "F32" and ckpt.shape("b") == (2, 2)
        np.testing.assert_array_equal(ckpt.get_bf16_bits("b"), f32_to_bf16(b))
        np.testing.assert_array_equal(ckpt.raw("b"), b)
        assert ckpt.nbytes == a.nbytes + b.nbytes
        with pytest.raises(TensorNotFoundError, match="'c'"):
            ckpt.get_tensor("c")


def test_single_file_checkpoint_by_directory_or_path(tmp_path):
    save_file({"w": np.ones(3, np.float32)}, tmp_path / "model.safetensors", dtype="BF16")
    for where in (tmp_path, tmp_path / "model.safetensors"):
        with open_checkpoint(where) as ckpt:
            assert ckpt.keys() == ["w"] and ckpt.dtype("w") == "BF16"
            np.testing.assert_array_equal(ckpt.get_tensor("w"), np.ones(3, np.float32))


# ----------------------------------------------------------------------------- GPU

@pytest.mark.gpu
def test_to_device(tmp_path):
    import cupy as cp
    x = np.random.default_rng(0).standard_normal((33, 7)).astype(np.float32)
    save_file({"x": x}, tmp_path / "f32.safetensors")
    save_file({"x": x}, tmp_path / "bf16.safetensors", dtype="BF16")
    for name in ("f32.safetensors", "bf16.safetensors"):
        with safe_open(tmp_path / name) as f:
            bits, full = f.to_device("x"), f.to_device("x", "f32")
            assert bits.dtype == cp.uint16 and full.dtype == cp.float32 and full.shape == x.shape
            np.testing.assert_array_equal(cp.asnumpy(bits), f.get_bf16_bits("x"))
            np.testing.assert_array_equal(cp.asnumpy(full), f.get_tensor("x"))
