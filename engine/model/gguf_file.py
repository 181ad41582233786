"""A GGUF file's header, metadata and tensor table, read from one memory map.

Receives the path of a GGUF file (llama.cpp's format, versions 2 and 3, little-endian).
Hands on a `GGUFFile`: `fields` (every metadata key -> its value as a Python object, as
`gguf.GGUFReader`'s `ReaderField.contents()` gives it, with the reader's `GGUF.version`,
`GGUF.tensor_count` and `GGUF.kv_count` entries) and `tensors` (name, GGUF-order shape,
`GGMLQuantizationType`, and `data`: a numpy view of the map shaped as the reader shapes it).

Why not `gguf.GGUFReader`: it slices the map once per array item (SmolLM2's ~49k tokens and
~49k merges), which takes seconds; this parses with `struct` over the same bytes, decoding
each string once. The `gguf` package stays the reference: tests/engine/test_gguf_file.py reads
files with both. Nothing read from the file is trusted: every length and offset is checked
against the file's size, and a bad or truncated file raises ValueError saying where.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import (
    GGML_QUANT_SIZES,
    GGUF_DEFAULT_ALIGNMENT,
    GGUF_MAGIC,
    GGMLQuantizationType,
)
from gguf.constants import GGUFValueType as VT
from gguf.quants import quant_shape_to_byte_shape

SUPPORTED_VERSIONS = (2, 3)
MAX_DIMS = 4  # llama.cpp's GGML_MAX_DIMS
MAX_ARRAY_NESTING = 8

# Scalar value types: struct format (little-endian) and the numpy dtype of an array of them.
_SCALARS: dict[int, tuple[struct.Struct, str]] = {
    VT.UINT8: (struct.Struct("<B"), "<u1"), VT.INT8: (struct.Struct("<b"), "<i1"),
    VT.UINT16: (struct.Struct("<H"), "<u2"), VT.INT16: (struct.Struct("<h"), "<i2"),
    VT.UINT32: (struct.Struct("<I"), "<u4"), VT.INT32: (struct.Struct("<i"), "<i4"),
    VT.FLOAT32: (struct.Struct("<f"), "<f4"), VT.BOOL: (struct.Struct("<?"), "?"),
    VT.UINT64: (struct.Struct("<Q"), "<u8"), VT.INT64: (struct.Struct("<q"), "<i8"),
    VT.FLOAT64: (struct.Struct("<d"), "<f8"),
}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
# Tensor types the reader views as elements, not bytes (every other type: uint8 blocks).
_PLAIN_DTYPES = {
    GGMLQuantizationType.F16: "<f2", GGMLQuantizationType.F32: "<f4", GGMLQuantizationType.F64: "<f8",
    GGMLQuantizationType.I8: "<i1", GGMLQuantizationType.I16: "<i2", GGMLQuantizationType.I32: "<i4",
    GGMLQuantizationType.I64: "<i8",
}


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor: `shape` in GGUF order (innermost dim first), `data` a view of the map at
    byte `data_offset` of the file."""

    name: str
    shape: tuple[int, ...]
    tensor_type: GGMLQuantizationType
    data: np.ndarray
    data_offset: int

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)


class GGUFFile:
    """The parsed file. `data` views keep the map open; it closes when they are all gone."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        self.map = _map_file(self.path)
        cursor = _Cursor(self.map, self.path)
        self.version, tensor_count, kv_count = _read_header(cursor)
        self.fields: dict[str, Any] = {
            "GGUF.version": self.version, "GGUF.tensor_count": tensor_count, "GGUF.kv_count": kv_count,
        }
        for _ in range(kv_count):
            key, value = _read_kv(cursor)
            if key in self.fields:
                raise cursor.error(f"duplicate metadata key {key!r}")
            self.fields[key] = value
        infos = [_read_tensor_info(cursor) for _ in range(tensor_count)]
        self.data_offset = _align(cursor.pos, self.alignment)
        self.tensors = [_tensor(self.map, self.path, self.data_offset, *info) for info in infos]
        _check_unique([t.name for t in self.tensors], self.path)

    @property
    def alignment(self) -> int:
        return int(self.fields.get("general.alignment", GGUF_DEFAULT_ALIGNMENT))


def _map_file(path: str) -> mmap.mmap:
    """A read-only map of the whole file (tensor `data` views are read-only arrays)."""
    with open(path, "rb") as f:
        if Path(path).stat().st_size == 0:
            raise ValueError(f"{path!r} is empty: not a GGUF file")
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)


class _Cursor:
    """Reads little-endian values at `pos`, never past the end of the map."""

    def __init__(self, buf: mmap.mmap, path: str) -> None:
        self.buf, self.path, self.pos, self.size = buf, path, 0, len(buf)

    def error(self, what: str) -> ValueError:
        return ValueError(f"bad GGUF file {self.path!r} at byte {self.pos}: {what}")

    def room(self, n: int, what: str) -> None:
        """Raise unless `n` bytes follow `pos`."""
        if n < 0 or self.pos + n > self.size:
            raise self.error(f"{what} needs {n} bytes, the file ends {self.size - self.pos} bytes on")

    def need(self, n: int, what: str) -> int:
        """Check that `n` bytes follow; return where they start and step over them."""
        self.room(n, what)
        self.pos += n
        return self.pos - n

    def scalar(self, fmt: struct.Struct, what: str) -> Any:
        return fmt.unpack_from(self.buf, self.need(fmt.size, what))[0]

    def string(self, what: str) -> str:
        n = self.scalar(_U64, f"{what} length")
        start = self.need(n, what)
        return _decode(self.buf[start : start + n], self, what)

    def strings(self, count: int, what: str) -> list[str]:
        """`count` strings in a row: the hot loop for tokenizer vocabularies (one pass)."""
        self.room(8 * count, what)  # each is at least its length word: refuse absurd counts early
        buf, size, pos, unpack = self.buf, self.size, self.pos, _U64.unpack_from
        raw: list[bytes] = []
        for _ in range(count):
            if pos + 8 > size:
                break
            n = unpack(buf, pos)[0]
            pos += 8
            if pos + n > size:
                break
            raw.append(buf[pos : pos + n])
            pos += n
        self.pos = pos
        if len(raw) < count:
            raise self.error(f"{what}: string {len(raw)} of {count} runs past the end of the file")
        return [_decode(b, self, what) for b in raw]


def _decode(raw: bytes, cursor: _Cursor, what: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise cursor.error(f"{what} is not UTF-8 ({e.reason})") from None


def _read_header(cursor: _Cursor) -> tuple[int, int, int]:
    if cursor.scalar(_U32, "magic") != GGUF_MAGIC:
        raise cursor.error("not a GGUF file (bad magic)")
    version = cursor.scalar(_U32, "version")
    if version & 0xFFFF == 0 and version != 0:
        raise cursor.error("big-endian GGUF files are not supported")
    if version not in SUPPORTED_VERSIONS:
        raise cursor.error(f"GGUF version {version} is not supported (known: 2, 3)")
    return version, cursor.scalar(_U64, "tensor count"), cursor.scalar(_U64, "metadata count")


def _read_kv(cursor: _Cursor) -> tuple[str, Any]:
    key = cursor.string("metadata key")
    kind = cursor.scalar(_U32, f"type of {key!r}")
    value = _read_value(cursor, kind, key, depth=0)
    if key == "general.alignment":
        _check_alignment(cursor, kind, value)
    return key, value


def _read_value(cursor: _Cursor, kind: int, key: str, depth: int) -> Any:
    if kind in _SCALARS:
        return cursor.scalar(_SCALARS[kind][0], f"value of {key!r}")
    if kind == VT.STRING:
        return cursor.string(f"value of {key!r}")
    if kind == VT.ARRAY:
        return _read_array(cursor, key, depth)
    raise cursor.error(f"unknown value type {kind} for {key!r}")


def _read_array(cursor: _Cursor, key: str, depth: int) -> list[Any]:
    """An array's items as a list; arrays of arrays come back flattened, as gguf's reader does."""
    if depth >= MAX_ARRAY_NESTING:
        raise cursor.error(f"arrays nested deeper than {MAX_ARRAY_NESTING} in {key!r}")
    kind = cursor.scalar(_U32, f"item type of {key!r}")
    count = cursor.scalar(_U64, f"length of {key!r}")
    if kind in _SCALARS:
        dtype = np.dtype(_SCALARS[kind][1])
        start = cursor.need(count * dtype.itemsize, f"items of {key!r}")
        return np.frombuffer(cursor.buf, dtype, count, start).tolist()
    if kind == VT.STRING:
        return cursor.strings(count, f"items of {key!r}")
    if kind == VT.ARRAY:
        cursor.room(12 * count, f"items of {key!r}")  # each nested array has its type and length
        return [x for _ in range(count) for x in _read_array(cursor, key, depth + 1)]
    raise cursor.error(f"unknown item type {kind} in {key!r}")


def _check_alignment(cursor: _Cursor, kind: int, value: Any) -> None:
    if kind != VT.UINT32:
        raise cursor.error("general.alignment must be a uint32")
    if value == 0 or value & (value - 1):
        raise cursor.error(f"general.alignment {value} is not a power of two")


def _read_tensor_info(cursor: _Cursor) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
    name = cursor.string("tensor name")
    n_dims = cursor.scalar(_U32, f"dims of {name!r}")
    if n_dims > MAX_DIMS:
        raise cursor.error(f"tensor {name!r} has {n_dims} dims (at most {MAX_DIMS})")
    shape = tuple(cursor.scalar(_U64, f"shape of {name!r}") for _ in range(n_dims))
    raw_type = cursor.scalar(_U32, f"type of {name!r}")
    try:
        kind = GGMLQuantizationType(raw_type)
    except ValueError:
        raise cursor.error(f"tensor {name!r} has unknown type {raw_type}") from None
    return name, shape, kind, cursor.scalar(_U64, f"offset of {name!r}")


def _align(pos: int, alignment: int) -> int:
    return pos + (-pos % alignment)


def _tensor(buf: mmap.mmap, path: str, data_offset: int, name: str, shape: tuple[int, ...],
            kind: GGMLQuantizationType, offset: int) -> GGUFTensor:
    """The tensor's bytes as gguf's reader views them: elements for plain types, else uint8
    blocks with the innermost dim in bytes (`quant_shape_to_byte_shape`)."""
    np_shape = tuple(reversed(shape))
    block_size, type_size = GGML_QUANT_SIZES[kind]
    n_elements = math.prod(shape)
    start, n_bytes = data_offset + offset, n_elements * type_size // block_size
    if start + n_bytes > len(buf):
        raise ValueError(f"bad GGUF file {path!r}: tensor {name!r} ({n_bytes} bytes at {start}) "
                         f"runs past the end of the file ({len(buf)} bytes)")
    if kind in _PLAIN_DTYPES:
        data = np.frombuffer(buf, _PLAIN_DTYPES[kind], n_elements, start)
    else:
        try:
            np_shape = quant_shape_to_byte_shape(np_shape, kind) if np_shape else (n_bytes,)
        except ValueError as e:
            raise ValueError(f"bad GGUF file {path!r}: tensor {name!r}: {e}") from None
        data = np.frombuffer(buf, np.uint8, n_bytes, start)
    return GGUFTensor(name, shape, kind, data.reshape(np_shape), start)


def _check_unique(names: list[str], path: str) -> None:
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise ValueError(f"bad GGUF file {path!r}: tensor {dup!r} appears twice")
