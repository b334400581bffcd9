"""Read a GGUF file's header, checking every count, length and dimension against the file size.

Layout (little-endian, version 2 and 3):

    "GGUF"  u32 version  u64 tensor_count  u64 kv_count
    kv_count x   string key, u32 value_type, value          (string = u64 length + UTF-8 bytes;
                                                            array = u32 element type, u64 count, elements)
    tensor_count x   string name, u32 n_dims, u64 dims[n_dims] (fastest first), u32 ggml_type, u64 offset
    padding to `general.alignment` (default 32), then the tensor data; offsets are relative to it

A file is untrusted input: a 68-byte file can claim an array of 2^62 elements. Every count is
checked against the bytes left before anything is read or allocated (each element needs at least
its minimal encoded size), every tensor must lie inside the file, and anything wrong raises
`GGUFFormatError` naming the field and its offset. Tensor data is not read here: `TensorInfo.data`
is a view of its bytes in the read-only memory map of the file.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

__all__ = ["GGUFFormatError", "GGUFFile", "TensorInfo", "read_gguf"]

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
MAX_DIMS = 4                    # GGML_MAX_DIMS
MAX_ARRAY_DEPTH = 4             # arrays of arrays exist in the format; no model nests deeper
MAX_ALIGNMENT = 1 << 16
STRING, ARRAY = 8, 9
# scalar value type -> (numpy dtype, struct format): uint8 int8 uint16 int16 uint32 int32 float32 bool
# uint64 int64 float64
SCALARS = {0: ("<u1", "<B"), 1: ("<i1", "<b"), 2: ("<u2", "<H"), 3: ("<i2", "<h"), 4: ("<u4", "<I"),
           5: ("<i4", "<i"), 6: ("<f4", "<f"), 7: ("<u1", "<B"), 10: ("<u8", "<Q"), 11: ("<i8", "<q"),
           12: ("<f8", "<d")}
BOOL = 7
MIN_VALUE_BYTES = {**{t: struct.calcsize(fmt) for t, (_, fmt) in SCALARS.items()}, STRING: 8, ARRAY: 12}
MIN_KV_BYTES = 8 + 4 + 1        # empty key, type, smallest value
MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8


class GGUFFormatError(ValueError):
    """The file is not a well-formed GGUF file."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    tensor_type: GGMLQuantizationType
    dims: tuple[int, ...]          # as stored: fastest-varying first (ne0 = row length)
    offset: int                    # absolute, in the file
    nbytes: int
    _file: GGUFFile = field(repr=False, compare=False)

    @property
    def shape(self) -> tuple[int, ...]:
        """Row-major (PyTorch/NumPy) order: the stored dims reversed."""
        return tuple(reversed(self.dims))

    @property
    def data(self) -> np.ndarray:
        """uint8 [rows, bytes per row]: what gguf.quants.dequantize takes."""
        rows = self.nbytes // self._row_bytes
        raw = np.frombuffer(self._file.buffer, dtype=np.uint8, count=self.nbytes, offset=self.offset)
        return raw.reshape(rows, self._row_bytes)

    @property
    def _row_bytes(self) -> int:
        block, type_size = GGML_QUANT_SIZES[self.tensor_type]
        return self.dims[0] // block * type_size


class _Cursor:
    """Reads fields from a buffer; every read first checks that the bytes are there."""

    def __init__(self, buffer, size: int):
        self.buffer, self.size, self.pos = buffer, size, 0

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise GGUFFormatError(f"{what} at byte {self.pos} needs {n:,} bytes, the file has "
                                  f"{max(self.size - self.pos, 0):,} left (truncated or corrupt)")

    def take(self, n: int, what: str) -> bytes:
        self.need(n, what)
        start, self.pos = self.pos, self.pos + n
        return bytes(self.buffer[start:self.pos])

    def scalar(self, value_type: int, what: str):
        fmt = SCALARS[value_type][1]
        value = struct.unpack(fmt, self.take(MIN_VALUE_BYTES[value_type], what))[0]
        return bool(value) if value_type == BOOL else value

    def u32(self, what: str) -> int:
        return self.scalar(4, what)

    def u64(self, what: str) -> int:
        return self.scalar(10, what)

    def count(self, what: str, min_bytes_each: int) -> int:
        """A u64 count of items that each take at least min_bytes_each bytes further on."""
        start = self.pos
        n = self.u64(what)
        if n * min_bytes_each > self.size - self.pos:
            raise GGUFFormatError(f"{what} at byte {start} is {n:,}, but {n:,} items need at least "
                                  f"{n * min_bytes_each:,} bytes and the file has {self.size - self.pos:,} left")
        return n

    def string(self, what: str) -> str:
        start = self.pos
        n = self.count(f"length of {what}", 1)
        raw = self.take(n, what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise GGUFFormatError(f"{what} at byte {start} is not valid UTF-8: {e}") from None

    def value(self, value_type: int, what: str, depth: int = 0):
        if value_type in SCALARS:
            return self.scalar(value_type, what)
        if value_type == STRING:
            return self.string(what)
        if value_type == ARRAY:
            if depth >= MAX_ARRAY_DEPTH:
                raise GGUFFormatError(f"{what}: arrays nested deeper than {MAX_ARRAY_DEPTH}")
            element_type = self.value_type(f"element type of {what}")
            n = self.count(f"element count of {what}", MIN_VALUE_BYTES[element_type])
            if element_type in SCALARS:   # one vectorized read
                dtype, size = SCALARS[element_type][0], MIN_VALUE_BYTES[element_type]
                values = np.frombuffer(self.take(n * size, what), dtype=dtype).tolist()
                return [bool(v) for v in values] if element_type == BOOL else values
            return [self.value(element_type, f"{what}[{i}]", depth + 1) for i in range(n)]
        raise AssertionError(value_type)   # value_type() let an unknown type through

    def value_type(self, what: str) -> int:
        start = self.pos
        value_type = self.u32(what)
        if value_type not in MIN_VALUE_BYTES:
            raise GGUFFormatError(f"{what} at byte {start} is {value_type}, not a GGUF value type")
        return value_type


class GGUFFile:
    """The header of a GGUF file: `metadata` (key -> value) and `tensors` (TensorInfo, in file order).

    `buffer` is the whole file (a read-only mmap from `read_gguf`, or bytes)."""

    def __init__(self, buffer, name: str = "<memory>"):
        self.buffer, self.name = buffer, name
        size = len(buffer)
        if size < 24:
            raise GGUFFormatError(f"{size} bytes is too short for a GGUF header (24 bytes)")
        cursor = _Cursor(memoryview(buffer), size)
        self.metadata = self._read_metadata(cursor)
        self.tensors = self._read_tensor_infos(cursor, size)

    def _read_metadata(self, cursor: _Cursor) -> dict:
        magic = cursor.take(4, "magic")
        if magic != MAGIC:
            raise GGUFFormatError(f"not a GGUF file (starts with {magic!r}, expected {MAGIC!r})")
        version = cursor.u32("version")
        if version not in SUPPORTED_VERSIONS:
            hint = " (a big-endian file?)" if version.to_bytes(4, "little")[::-1] in (b"\0\0\0\2", b"\0\0\0\3") else ""
            raise GGUFFormatError(f"GGUF version {version} is not supported{hint}; "
                                  f"supported: {', '.join(map(str, SUPPORTED_VERSIONS))}")
        self.tensor_count = cursor.count("tensor count", MIN_TENSOR_INFO_BYTES)
        kv_count = cursor.count("metadata key count", MIN_KV_BYTES)
        metadata = {}
        for i in range(kv_count):
            start = cursor.pos
            key = cursor.string(f"metadata key #{i}")
            if key in metadata:
                raise GGUFFormatError(f"metadata key {key!r} appears twice (second at byte {start})")
            metadata[key] = cursor.value(cursor.value_type(f"type of {key!r}"), repr(key))
        return metadata

    def _read_tensor_infos(self, cursor: _Cursor, size: int) -> list[TensorInfo]:
        alignment = self.metadata.get("general.alignment", 32)
        if not (isinstance(alignment, int) and 0 < alignment <= MAX_ALIGNMENT and alignment & (alignment - 1) == 0):
            raise GGUFFormatError(f"general.alignment {alignment!r} is not a power of two up to {MAX_ALIGNMENT}")
        infos = []
        for i in range(self.tensor_count):
            start = cursor.pos
            name = cursor.string(f"name of tensor #{i}")
            n_dims = cursor.u32(f"dimension count of {name!r}")
            if not 1 <= n_dims <= MAX_DIMS:
                raise GGUFFormatError(f"tensor {name!r} (byte {start}) has {n_dims} dimensions; "
                                      f"GGUF allows 1..{MAX_DIMS}")
            dims = tuple(cursor.u64(f"dimension {d} of {name!r}") for d in range(n_dims))
            type_id = cursor.u32(f"type of {name!r}")
            try:
                tensor_type = GGMLQuantizationType(type_id)
                block, type_size = GGML_QUANT_SIZES[tensor_type]
            except (ValueError, KeyError):
                raise GGUFFormatError(f"tensor {name!r} has unknown GGML type id {type_id}") from None
            offset = cursor.u64(f"offset of {name!r}")
            if any(d == 0 for d in dims) or dims[0] % block:
                raise GGUFFormatError(f"tensor {name!r} has dimensions {list(dims)}: each must be positive and "
                                      f"the first a multiple of {tensor_type.name}'s block of {block}")
            nbytes = dims[0] // block * type_size
            for d in dims[1:]:
                nbytes *= d   # Python ints: no overflow; checked against the file below
            infos.append((name, tensor_type, dims, offset, nbytes))
        data_start = -(-cursor.pos // alignment) * alignment
        tensors, names = [], set()
        for name, tensor_type, dims, offset, nbytes in infos:
            if name in names:
                raise GGUFFormatError(f"tensor {name!r} appears twice")
            names.add(name)
            if offset % alignment:
                raise GGUFFormatError(f"tensor {name!r} offset {offset} is not a multiple of the alignment {alignment}")
            if data_start + offset + nbytes > size:
                raise GGUFFormatError(f"tensor {name!r} ({nbytes:,} bytes at data offset {offset:,}) runs past the "
                                      f"end of the file ({size:,} bytes): truncated or corrupt")
            tensors.append(TensorInfo(name, tensor_type, dims, data_start + offset, nbytes, self))
        return tensors


def read_gguf(path) -> GGUFFile:
    """Memory-map `path` read-only and read its header."""
    try:
        with open(path, "rb") as f:
            if Path(path).stat().st_size < 24:
                return GGUFFile(f.read(), str(path))   # mmap refuses empty files; GGUFFile explains
            buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as e:
        raise GGUFFormatError(f"cannot open {path}: {e}") from None
    return GGUFFile(buffer, str(path))
