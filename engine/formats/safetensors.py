"""safetensors, read and written from scratch.

A .safetensors file is three things back to back:

    [ 8 bytes: N, little-endian u64 ][ N bytes: JSON header ][ data section: raw tensor bytes ]

The header maps each tensor name to {"dtype": "BF16", "shape": [576, 49152],
"data_offsets": [begin, end]} with offsets relative to the start of the data section, plus an
optional "__metadata__" object of string -> string. The format promises that every byte of the data
section belongs to exactly one tensor: ranges are sorted, touch end to end, never overlap, and
shape x itemsize equals end - begin. We check every one of those promises when the file is opened,
before a single tensor is touched, and raise SafetensorsError (a ValueError) naming the file, the
tensor and the problem when one is broken.

Tensors are views into an mmap of the file: opening a 2.5 GB checkpoint costs a header parse, and the
operating system pages bytes in only when a tensor is read. BF16 has no NumPy dtype, so `raw()` shows
its uint16 bit patterns and `get_tensor()` widens them to float32, which is exact.

    with safe_open("model.safetensors") as f:
        w = f.get_tensor("model.norm.weight")        # float32 [hidden]
    weights = load_file("model.safetensors")         # dict name -> numpy array
    save_file({"w": np.ones((2, 3), np.float32)}, "w.safetensors", dtype="BF16")
    ckpt = open_checkpoint(model_dir)                # model.safetensors or a sharded index
"""
from __future__ import annotations

import functools
import json
import math
import mmap
import operator
import os
import secrets
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.backend import bf16_to_f32, f32_to_bf16
from engine.checks import path_exists, read_regular_file

__all__ = [
    "DTYPES", "SafetensorsError", "TensorNotFoundError", "TensorInfo", "SafetensorsFile",
    "safe_open", "load_file", "save_file", "Checkpoint", "open_checkpoint",
    "MAX_HEADER_LENGTH", "SINGLE_FILE", "INDEX_FILE", "use_header_reader",
    "MAX_INDEX_BYTES", "MAX_INDEX_ENTRIES", "MAX_INDEX_SHARDS",
]

# The reference implementation refuses headers above 100 MB; so do we, before allocating anything.
MAX_HEADER_LENGTH = 100_000_000
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# The sharded index is read whole and parsed, so it is bounded before a byte is read. Llama-3-405B's
# index is ~100 kB for ~1,300 tensors in 191 shards; the largest MoE checkpoints list ~90k tensors in
# under 10 MB. A real entry ("model.layers.0.mlp.up_proj.weight": "model-00001-of-00191.safetensors")
# is 60-100 bytes, so 16 MiB holds at most ~250k of them: the entry limit matches the size limit, and
# parsing an index at both limits takes a fraction of a second and under ~100 MB.
MAX_INDEX_BYTES = 16 << 20
MAX_INDEX_ENTRIES = 1 << 18
MAX_INDEX_SHARDS = 1 << 14
_INT64_MAX = 2**63 - 1

# safetensors dtype name -> (NumPy dtype the bytes are viewed as, bytes per element).
# BF16 and the FP8 formats have no NumPy dtype: we view their bit patterns as unsigned integers.
DTYPES: dict[str, tuple[np.dtype, int]] = {
    name: (np.dtype(np_name), np.dtype(np_name).itemsize)
    for name, np_name in [
        ("BOOL", "?"), ("U8", "u1"), ("I8", "i1"), ("U16", "<u2"), ("I16", "<i2"),
        ("U32", "<u4"), ("I32", "<i4"), ("U64", "<u8"), ("I64", "<i8"),
        ("F16", "<f2"), ("F32", "<f4"), ("F64", "<f8"), ("C64", "<c8"),
        ("BF16", "<u2"),
        ("F8_E4M3", "u1"), ("F8_E5M2", "u1"), ("F8_E4M3FNUZ", "u1"), ("F8_E5M2FNUZ", "u1"),
        ("F8_E8M0", "u1"),
    ]
}
# Real formats we deliberately do not read: several elements share one byte.
_PACKED_DTYPES = {"F4", "F6_E2M3", "F6_E3M2"}
# Dtypes that save_file infers from a NumPy array (the inverse of DTYPES, bit-pattern views excluded).
_NAME_OF_NUMPY = {DTYPES[n][0].newbyteorder("<"): n for n in
                  ["BOOL", "U8", "I8", "U16", "I16", "U32", "I32", "U64", "I64",
                   "F16", "F32", "F64", "C64"]}
_FLOAT_TARGETS = {"BF16", "F16", "F32", "F64"}


class SafetensorsError(ValueError):
    """A safetensors file (or sharded index) breaks the format, or a request cannot be met."""


class TensorNotFoundError(SafetensorsError, KeyError):
    """The tensor name is not in the file. Also a KeyError, so `except KeyError` works."""

    __str__ = ValueError.__str__  # KeyError would print the message with quotes around it


def _fp8_table(exp_bits: int, bias: int, specials: str) -> np.ndarray:
    """float32 value of each of the 256 codes of a 1-sign / exp_bits / (7-exp_bits) minifloat.

    specials: "ieee" (all-ones exponent = inf/NaN, like E5M2), "fn" (only all-ones = NaN, E4M3),
    "fnuz" (0x80, the would-be negative zero, is the only NaN; no infinities).
    """
    man_bits = 7 - exp_bits
    code = np.arange(256)
    exponent, mantissa = (code >> man_bits) & ((1 << exp_bits) - 1), code & ((1 << man_bits) - 1)
    fraction = mantissa / 2.0**man_bits
    magnitude = np.where(exponent == 0, np.ldexp(fraction, 1 - bias),            # subnormals
                         np.ldexp(1.0 + fraction, exponent - bias))
    value = np.where(code & 0x80, -magnitude, magnitude)
    top = exponent == (1 << exp_bits) - 1
    if specials == "ieee":
        value[top] = np.where(mantissa[top] == 0, np.inf, np.nan) * np.sign(value[top])
    elif specials == "fn":
        value[top & (mantissa == (1 << man_bits) - 1)] = np.nan
    else:
        value[0x80] = np.nan
    return value.astype(np.float32)


def _e8m0_table() -> np.ndarray:
    """F8_E8M0 (the MX scale format): unsigned, 8 exponent bits, 2**(code - 127), 0xFF is NaN."""
    value = np.ldexp(1.0, np.arange(256) - 127)
    value[255] = np.nan
    return value.astype(np.float32)


_FP8_DECODE = {
    "F8_E4M3": lambda: _fp8_table(4, 7, "fn"),
    "F8_E5M2": lambda: _fp8_table(5, 15, "ieee"),
    "F8_E4M3FNUZ": lambda: _fp8_table(4, 8, "fnuz"),
    "F8_E5M2FNUZ": lambda: _fp8_table(5, 16, "fnuz"),
    "F8_E8M0": _e8m0_table,
}


@dataclass(frozen=True)
class TensorInfo:
    """One header entry. begin/end are byte offsets into the data section (end exclusive)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


# ----------------------------------------------------------------------------- header validation

def _reject_duplicates(pairs):
    """json object_pairs_hook: a repeated key would silently shadow an earlier one."""
    obj = {}
    for key, value in pairs:
        if key in obj:
            raise SafetensorsError(f"duplicate key {key!r} in the JSON header")
        obj[key] = value
    return obj


def _reject_constant(name):
    raise SafetensorsError(f"{name} is not valid JSON")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # JSON true is not 1


def _parse_header_json(header: bytes) -> dict:
    try:
        text = header.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SafetensorsError(f"header is not valid UTF-8 ({e.reason} at byte {e.start})") from None
    if not text.startswith("{"):
        raise SafetensorsError("header must be a JSON object and start with '{', "
                               f"found {text[:20]!r}")
    try:
        obj = json.loads(text, object_pairs_hook=_reject_duplicates, parse_constant=_reject_constant)
    except json.JSONDecodeError as e:
        raise SafetensorsError(f"header is not valid JSON: {e}") from None
    except RecursionError:
        raise SafetensorsError("header JSON is nested too deeply") from None
    return obj  # a dict: the text starts with '{' and json rejects anything after the object


def _parse_metadata(value) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise SafetensorsError(f"__metadata__ must be an object of strings, got {type(value).__name__}")
    for key, item in value.items():
        if not isinstance(item, str):
            raise SafetensorsError(f"__metadata__[{key!r}] must be a string, got {item!r}")
    return dict(value)


def _parse_entry(name: str, entry) -> TensorInfo:
    where = f"tensor {name!r}"
    if not isinstance(entry, dict):
        raise SafetensorsError(f"{where}: header entry must be an object, got {entry!r}")
    for field in ("dtype", "shape", "data_offsets"):
        if field not in entry:
            raise SafetensorsError(f"{where}: header entry has no {field!r}")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if isinstance(dtype, str) and dtype in _PACKED_DTYPES:
        raise SafetensorsError(f"{where}: dtype {dtype} packs several values per byte; "
                               "this reader does not support it")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise SafetensorsError(f"{where}: unknown dtype {dtype!r} (known: {', '.join(DTYPES)})")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise SafetensorsError(f"{where}: shape must be a list of non-negative integers, "
                               f"got {shape!r}")
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(_is_int(o) and o >= 0 for o in offsets)):
        raise SafetensorsError(f"{where}: data_offsets must be [begin, end] with non-negative "
                               f"integers, got {offsets!r}")
    begin, end = offsets
    if begin > end:
        raise SafetensorsError(f"{where}: data_offsets {offsets} are reversed (begin > end)")
    itemsize = DTYPES[dtype][1]
    # Python ints never overflow, but NumPy (and any C reader) must index this array with int64.
    if math.prod(d for d in shape if d) * itemsize > _INT64_MAX:
        raise SafetensorsError(f"{where}: shape {shape} x {itemsize} bytes overflows int64")
    expected = math.prod(shape) * itemsize
    if expected != end - begin:
        raise SafetensorsError(f"{where}: shape {shape} of {dtype} needs {expected} bytes but "
                               f"data_offsets {offsets} hold {end - begin}")
    return TensorInfo(name, dtype, tuple(shape), begin, end)


def _check_layout(infos: list[TensorInfo], data_len: int) -> list[TensorInfo]:
    """Sort by offset and check the ranges tile [0, data_len) exactly; return them in file order."""
    for info in infos:
        if info.end > data_len:
            raise SafetensorsError(f"tensor {info.name!r}: data_offsets [{info.begin}, {info.end}] "
                                   f"run past the end of the {data_len}-byte data section")
    ordered = sorted(infos, key=lambda i: (i.begin, i.end))
    position, previous = 0, None
    for info in ordered:
        if info.begin < position:
            assert previous is not None     # position > 0: a tensor came before this one
            raise SafetensorsError(f"tensor {info.name!r}: data_offsets [{info.begin}, {info.end}] "
                                   f"overlap tensor {previous.name!r} [{previous.begin}, "
                                   f"{previous.end}]")
        if info.begin > position:
            after = f"after tensor {previous.name!r}" if previous else "at the start of the data"
            raise SafetensorsError(f"hole in the data section: bytes [{position}, {info.begin}) "
                                   f"{after} belong to no tensor (the next is tensor "
                                   f"{info.name!r})")
        position, previous = info.end, info
    if position != data_len:
        last = f"after tensor {previous.name!r}" if previous else "(there are no tensors)"
        raise SafetensorsError(f"{data_len - position} trailing bytes of the data section "
                               f"{last} belong to no tensor")
    return ordered


# ----------------------------------------------------------------------------- a reader of your own

# The header reader a learner plugs in (chapter 01), or None for the engine's own. Read once per opened file.
_HEADER_READER: Callable | None = None
_HEADER_READER_LOCK = threading.Lock()


@contextmanager
def use_header_reader(fn: Callable) -> Iterator[None]:
    """For the span of the block, every safetensors file this module opens (safe_open, load_file,
    open_checkpoint, and so engine.load_model) finds its tensors with `fn` instead of the engine's parser.

    fn(data) -> {name: (dtype, shape, start, stop)}: `data` is the whole file (an mmap: len() and slicing
    to bytes work), start/stop are the tensor's byte positions in the FILE, and fn raises ValueError for
    a file that breaks the format. The engine still refuses a table it cannot read safely (an unknown
    dtype, a range outside the file, a size that disagrees with the shape); every other check is fn's.
    Blocks nest; the reader is process-wide while a block is open.
    """
    global _HEADER_READER
    if not callable(fn):
        raise TypeError(f"use_header_reader needs a function, got {type(fn).__name__}")
    with _HEADER_READER_LOCK:
        previous, _HEADER_READER = _HEADER_READER, fn
    try:
        yield
    finally:
        with _HEADER_READER_LOCK:
            _HEADER_READER = previous


def _infos_from_reader(fn: Callable, data, file_size: int) -> tuple[int, list[TensorInfo]]:
    """(data start, infos) from a plugged-in reader's table, refusing what cannot be read safely."""
    try:
        table = fn(data)
    except ValueError as e:
        raise SafetensorsError(f"your header reader refused the file: {e}") from None
    if not isinstance(table, dict):
        raise SafetensorsError(f"your header reader returned {type(table).__name__}, not a dict "
                               "{name: (dtype, shape, start, stop)}")
    rows = []
    for name, row in table.items():
        try:
            dtype, shape, start, stop = row
            shape = tuple(int(d) for d in shape)
        except (TypeError, ValueError):
            raise SafetensorsError(f"your header reader gave tensor {name!r} the entry {row!r}; "
                                   "expected (dtype, shape, start, stop)") from None
        if dtype not in DTYPES:
            raise SafetensorsError(f"your header reader gave tensor {name!r} the unknown dtype {dtype!r}")
        try:
            start, stop = operator.index(start), operator.index(stop)   # ints, NumPy ints too; not floats
        except TypeError:
            raise SafetensorsError(f"your header reader gave tensor {name!r} the positions {start!r}, {stop!r}; "
                                   "expected integers") from None
        if not 0 <= start <= stop <= file_size:
            raise SafetensorsError(f"your header reader put tensor {name!r} at bytes [{start}, {stop}), "
                                   f"outside the {file_size}-byte file")
        if math.prod(shape) * DTYPES[dtype][1] != stop - start:
            raise SafetensorsError(f"your header reader gave tensor {name!r} shape {shape} of {dtype} "
                                   f"but {stop - start} bytes")
        rows.append((name, dtype, shape, start, stop))
    data_start = min((r[3] for r in rows), default=file_size)
    infos = [TensorInfo(name, dtype, shape, start - data_start, stop - data_start)
             for name, dtype, shape, start, stop in rows]
    return data_start, sorted(infos, key=lambda i: (i.begin, i.end))


# ----------------------------------------------------------------------------- reading

class SafetensorsFile:
    """An open, fully validated .safetensors file whose tensors are views into one mmap."""

    def __init__(self, path):
        self.path = Path(path)
        reader = _HEADER_READER
        try:
            with open(self.path, "rb") as f:
                self.file_size = os.fstat(f.fileno()).st_size
                if reader is None:
                    self.header_length, infos, self.metadata = self._read_header(f)
                    self.data_start = 8 + self.header_length
                # Map the whole file read-only. The mapping keeps its own handle on the file, and
                # NumPy views keep the mapping alive (array.base), so closing f here is safe.
                self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if self.file_size else None
                if reader is not None:
                    self.data_start, infos = _infos_from_reader(reader, self._mmap or b"", self.file_size)
                    self.header_length, self.metadata = max(0, self.data_start - 8), {}
        except SafetensorsError as e:
            raise SafetensorsError(f"{self.path}: {e}") from None
        except OSError as e:
            raise SafetensorsError(f"{self.path}: cannot read file: {e.strerror or e}") from None
        self._infos = {info.name: info for info in infos}

    def _read_header(self, f):
        if self.file_size < 8:
            raise SafetensorsError(f"file is {self.file_size} bytes, too short to hold the 8-byte "
                                   "header length")
        n = int.from_bytes(f.read(8), "little")
        # Check N against reality before reading or allocating N bytes.
        if n > MAX_HEADER_LENGTH:
            raise SafetensorsError(f"header length {n} exceeds the {MAX_HEADER_LENGTH}-byte limit")
        if 8 + n > self.file_size:
            raise SafetensorsError(f"header length {n} runs past the end of the "
                                   f"{self.file_size}-byte file")
        header = _parse_header_json(f.read(n))
        metadata = _parse_metadata(header.pop("__metadata__", None))
        infos = [_parse_entry(name, entry) for name, entry in header.items()]
        return n, _check_layout(infos, self.file_size - 8 - n), metadata

    # -- context manager and lifetime
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        """Drop the mapping. Arrays already handed out stay valid: they keep the mmap alive."""
        mm, self._mmap = self._mmap, None
        if mm is not None:
            try:
                mm.close()
            except BufferError:  # views still exist; the mapping closes when the last one dies
                pass

    # -- header queries
    def keys(self) -> list[str]:
        """Tensor names in file order (by data offset)."""
        return list(self._infos)

    def __contains__(self, name) -> bool:
        return name in self._infos

    def __len__(self) -> int:
        return len(self._infos)

    def info(self, name: str) -> TensorInfo:
        try:
            return self._infos[name]
        except KeyError:
            raise TensorNotFoundError(f"{self.path}: no tensor named {name!r}") from None

    def dtype(self, name: str) -> str:
        return self.info(name).dtype

    def shape(self, name: str) -> tuple[int, ...]:
        return self.info(name).shape

    # -- data
    def raw(self, name: str) -> np.ndarray:
        """Zero-copy read-only view in the stored dtype (BF16 as uint16 bits, FP8 as uint8)."""
        info = self.info(name)
        if self._mmap is None:
            raise SafetensorsError(f"{self.path}: file is closed")
        np_dtype, _ = DTYPES[info.dtype]
        flat = np.frombuffer(self._mmap, dtype=np_dtype, count=info.numel,
                             offset=self.data_start + info.begin)
        return flat.reshape(info.shape)

    def get_tensor(self, name: str) -> np.ndarray:
        """The tensor's values: a zero-copy view, except BF16 and FP8 which become float32 (exact)."""
        dtype, bits = self.dtype(name), self.raw(name)
        if dtype == "BF16":
            return bf16_to_f32(bits).reshape(bits.shape)
        if dtype in _FP8_DECODE:
            return _fp8_lookup(dtype)[bits]
        return bits

    def get_bf16_bits(self, name: str) -> np.ndarray:
        """uint16 bf16 bit patterns: a view if stored BF16, else rounded to nearest even from F16/F32.

        F64 goes through float32 first (two roundings; fine for weights, not for bit-exactness).
        """
        dtype = self.dtype(name)
        if dtype == "BF16":
            return self.raw(name)
        if dtype in ("F16", "F32", "F64") or dtype in _FP8_DECODE:
            values = self.get_tensor(name)
            return f32_to_bf16(values.astype(np.float32, copy=False)).reshape(values.shape)
        raise SafetensorsError(f"{self.path}: tensor {name!r} is {dtype}, not a floating type; "
                               "it has no bf16 form")

    def to_device(self, name: str, dtype: str = "bf16"):
        """Copy a tensor from the mapping to the GPU: "bf16" -> cupy uint16 bits, "f32" -> float32."""
        if dtype not in ("bf16", "f32"):
            raise ValueError(f"to_device dtype must be 'bf16' or 'f32', got {dtype!r}")
        cp = _cupy()
        if dtype == "bf16":
            return cp.asarray(self.get_bf16_bits(name))  # host pages -> device, one copy
        if self.dtype(name) == "BF16":  # ship half the bytes, widen on the device (exact)
            bits = cp.asarray(self.raw(name)).astype(cp.uint32)
            return (bits << 16).view(cp.float32)
        return cp.asarray(np.asarray(self.get_tensor(name), dtype=np.float32))

    def __repr__(self) -> str:
        return f"SafetensorsFile({str(self.path)!r}, {len(self)} tensors)"


@functools.cache
def _fp8_lookup(dtype: str) -> np.ndarray:
    return _FP8_DECODE[dtype]()


def _cupy():
    try:
        import cupy
    except ImportError as e:
        raise RuntimeError(f"to_device needs CuPy, which cannot be imported ({e}); "
                           "install the cuda12 or cuda13 extra, or use get_tensor()") from None
    return cupy


def safe_open(path) -> SafetensorsFile:
    """Open and validate a .safetensors file. Use it as a context manager."""
    return SafetensorsFile(path)


def load_file(path) -> dict[str, np.ndarray]:
    """Every tensor as a NumPy array: BF16/FP8 as float32 (exact), other dtypes as stored (mmap views)."""
    with safe_open(path) as f:
        return {name: f.get_tensor(name) for name in f.keys()}


# ----------------------------------------------------------------------------- writing

def _stored_dtype(name: str, array: np.ndarray, float_dtype: str | None) -> str:
    """The safetensors dtype `array` is written as."""
    if array.dtype.kind == "f" and float_dtype is not None:
        return float_dtype
    name_of = _NAME_OF_NUMPY.get(array.dtype.newbyteorder("<"))
    if name_of is None:
        raise SafetensorsError(f"tensor {name!r}: NumPy dtype {array.dtype} has no safetensors "
                               "equivalent")
    return name_of


def _stored_bytes(array: np.ndarray, st_dtype: str) -> np.ndarray:
    """A C-contiguous little-endian array holding exactly the bytes to write (same shape)."""
    if st_dtype == "BF16":
        with np.errstate(over="ignore"):      # float64 beyond float32's range is inf in bf16 too, as in torch
            return f32_to_bf16(array.astype(np.float32, copy=False)).reshape(array.shape)
    # astype, not ascontiguousarray: the latter turns a 0-d scalar into shape (1,)
    return array.astype(DTYPES[st_dtype][0], order="C", copy=False)


def save_file(tensors: dict, path, metadata: dict | None = None, dtype: str | None = None) -> None:
    """Write tensors to a .safetensors file, atomically (temporary file, then rename).

    Tensors are laid out in name order, back to back; the header is padded with spaces to a multiple
    of 8 bytes so that the data section starts 8-byte aligned. Each array keeps its own dtype, except
    that dtype="BF16" | "F16" | "F32" | "F64" converts every floating array to that type (BF16
    rounds to nearest even). Integer and bool arrays are never converted, so a uint16 array is stored
    as U16: to store bf16 bit patterns you already have, widen them with bf16_to_f32 and pass
    dtype="BF16" (that round trip is exact).
    """
    if dtype is not None and dtype not in _FLOAT_TARGETS:
        raise SafetensorsError(f"dtype must be one of {sorted(_FLOAT_TARGETS)} or None, got {dtype!r}")
    header: dict = {}
    if metadata:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise SafetensorsError("metadata must map strings to strings")
        header["__metadata__"] = dict(metadata)
    # The header first (it needs only dtypes and shapes); each tensor is converted only when it is
    # written, so saving a float32 model as BF16 never holds a second copy of the whole model.
    arrays, offset = {}, 0
    for name in sorted(tensors):
        if not isinstance(name, str) or name == "__metadata__":
            raise SafetensorsError(f"invalid tensor name {name!r}")
        array = np.asarray(tensors[name])
        st_dtype = _stored_dtype(name, array, dtype)
        nbytes = array.size * DTYPES[st_dtype][1]
        header[name] = {"dtype": st_dtype, "shape": list(array.shape),
                        "data_offsets": [offset, offset + nbytes]}
        arrays[name] = array
        offset += nbytes
    try:
        header_bytes = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        raise SafetensorsError(f"a tensor name or metadata string is not valid Unicode ({e})") from None
    header_bytes += b" " * (-len(header_bytes) % 8)

    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "xb") as f:  # a fresh file with the usual permissions
            f.write(len(header_bytes).to_bytes(8, "little"))
            f.write(header_bytes)
            for name, array in arrays.items():
                data = _stored_bytes(array, header[name]["dtype"])
                f.write(data.reshape(-1).view(np.uint8).data)  # no tobytes() copy
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


# ----------------------------------------------------------------------------- checkpoints

def _read_index(index_path: Path) -> dict[str, str]:
    """The weight_map of the index (tensor name -> shard file name), its size and types checked."""
    raw = read_regular_file(index_path, MAX_INDEX_BYTES, SafetensorsError, "the index")
    # Every entry needs a ':'. Counting them (in C, no allocation) bounds the entries before json builds
    # them: a 16 MiB file of '"t1":"s",' entries would otherwise cost ~2M Python objects of each kind.
    if raw.count(b":") > MAX_INDEX_ENTRIES + 1024:   # + room for "metadata"
        raise SafetensorsError(f"{index_path}: the index holds more than {MAX_INDEX_ENTRIES:,} entries "
                               "(the limit)")
    try:
        index = json.loads(raw.decode("utf-8"), object_pairs_hook=_reject_duplicates,
                           parse_constant=_reject_constant)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise SafetensorsError(f"{index_path}: not a valid JSON index ({e})") from None
    except SafetensorsError as e:   # a duplicate key, NaN
        raise SafetensorsError(f"{index_path}: not a valid JSON index ({e})") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise SafetensorsError(f"{index_path}: needs a 'weight_map' object of name -> shard")
    if len(weight_map) > MAX_INDEX_ENTRIES:
        raise SafetensorsError(f"{index_path}: the weight_map has {len(weight_map):,} entries; "
                               f"the limit is {MAX_INDEX_ENTRIES:,}")
    if not weight_map:
        raise SafetensorsError(f"{index_path}: the weight_map is empty")
    for name, shard in weight_map.items():
        if not name:
            raise SafetensorsError(f"{index_path}: the weight_map has an empty tensor name")
        if not isinstance(shard, str):
            raise SafetensorsError(f"{index_path}: shard name {shard!r} (of tensor {name!r}) must be a plain "
                                   "file name inside the model directory")
    return weight_map


def _shard_path(model_dir: Path, shard) -> Path:
    """A shard must be a plain file name inside model_dir: no paths, no '..', nothing absolute."""
    if (not isinstance(shard, str) or not shard or shard in (".", "..") or "\0" in shard
            or "/" in shard or "\\" in shard or os.path.isabs(shard) or Path(shard).name != shard):
        raise SafetensorsError(f"{model_dir / INDEX_FILE}: shard name {shard!r} must be a plain "
                               "file name inside the model directory")
    return model_dir / shard


class Checkpoint:
    """All tensors of a model directory: model.safetensors, or shards listed in the index file."""

    def __init__(self, path):
        path = self.path = Path(path)
        self._files: list[SafetensorsFile] = []
        self._owner: dict[str, SafetensorsFile] = {}
        try:
            if path.is_file():
                self._add(safe_open(path))
            elif path_exists(path / INDEX_FILE):   # whatever is there: a FIFO or a device is refused, not skipped
                self._open_sharded(path)
            elif (path / SINGLE_FILE).is_file():
                self._add(safe_open(path / SINGLE_FILE))
            else:
                raise SafetensorsError(f"{path}: found neither {SINGLE_FILE} nor {INDEX_FILE}")
        except BaseException:
            self.close()
            raise

    def _add(self, f: SafetensorsFile) -> None:
        self._files.append(f)
        for name in f.keys():
            if name in self._owner:
                raise SafetensorsError(f"tensor {name!r} is in both {self._owner[name].path.name} "
                                       f"and {f.path.name}")
            self._owner[name] = f

    def _open_sharded(self, model_dir: Path) -> None:
        index_path = model_dir / INDEX_FILE
        weight_map = _read_index(index_path)
        names = set(weight_map.values())
        if len(names) > MAX_INDEX_SHARDS:
            raise SafetensorsError(f"{index_path}: the weight_map names {len(names):,} shards; "
                                   f"the limit is {MAX_INDEX_SHARDS:,}")
        shards = {shard: _shard_path(model_dir, shard) for shard in sorted(names)}
        for shard, shard_path in shards.items():   # all checked before any is opened
            if not path_exists(shard_path):
                raise SafetensorsError(f"{index_path}: shard {shard!r} does not exist")
            if not shard_path.is_file():   # a FIFO would block the open below; a device never ends
                raise SafetensorsError(f"{index_path}: shard {shard!r} is not a regular file")
        for shard_path in shards.values():
            self._add(safe_open(shard_path))
        for name, shard in weight_map.items():
            if name not in self._owner or self._owner[name].path.name != shard:
                raise SafetensorsError(f"{index_path}: tensor {name!r} is not in shard {shard!r}")
        unlisted = sorted(set(self._owner) - set(weight_map))
        if unlisted:
            raise SafetensorsError(f"{index_path}: tensors {unlisted[:5]} are in shards but not "
                                   "in the weight_map")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        for f in self._files:
            f.close()

    def keys(self) -> list[str]:
        return list(self._owner)

    def __contains__(self, name) -> bool:
        return name in self._owner

    def __len__(self) -> int:
        return len(self._owner)

    def file_of(self, name: str) -> SafetensorsFile:
        try:
            return self._owner[name]
        except KeyError:
            raise TensorNotFoundError(f"{self.path}: no tensor named {name!r}") from None

    def info(self, name: str) -> TensorInfo:
        return self.file_of(name).info(name)

    def dtype(self, name: str) -> str:
        return self.file_of(name).dtype(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.file_of(name).shape(name)

    def raw(self, name: str) -> np.ndarray:
        return self.file_of(name).raw(name)

    def get_tensor(self, name: str) -> np.ndarray:
        return self.file_of(name).get_tensor(name)

    def get_bf16_bits(self, name: str) -> np.ndarray:
        return self.file_of(name).get_bf16_bits(name)

    def to_device(self, name: str, dtype: str = "bf16"):
        return self.file_of(name).to_device(name, dtype)

    @property
    def nbytes(self) -> int:
        """Total tensor bytes as stored."""
        return sum(f.file_size - f.data_start for f in self._files)

    def __repr__(self) -> str:
        return f"Checkpoint({str(self.path)!r}, {len(self)} tensors in {len(self._files)} file(s))"


def open_checkpoint(path) -> Checkpoint:
    """Open a model directory (model.safetensors or model.safetensors.index.json) or a single file."""
    return Checkpoint(path)
