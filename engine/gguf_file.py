"""GGUFFile: a GGUF file's metadata as plain Python values and its tensors as views of the map.

Receives a GGUF path (versions 2 and 3, little-endian: what llama.cpp writes); hands
engine/gguf_loader.py `fields` (key -> str, int, float, bool, or a list of them) and `tensors`
(name, GGML type, dims in GGUF order, the raw data as a numpy view shaped as `gguf.GGUFReader`
shapes it: elements for float/int types, bytes per row for quantized ones).

Why not `gguf.GGUFReader`: it builds a numpy view per array element, a million of them for a
49k-token vocabulary and its merges, which took 7.7 s per open on the 2-core CPU (in the router
and in every node, on the start-up path); this reads the same metadata with `struct` in well under
a second. tests/engine/test_gguf_file.py checks it against GGUFReader field by field and tensor by
tensor. Never writes; never copies tensor data.
"""

from __future__ import annotations

import struct
from typing import Any, NamedTuple

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType
from gguf.constants import GGML_QUANT_SIZES, GGUF_MAGIC
from gguf.quants import quant_shape_to_byte_shape

VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
_SCALARS = {GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
            GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
            GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
            GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d"}
_ELEMENT_TYPES = {GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
                  GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
                  GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
                  GGMLQuantizationType.I64: np.int64}


class GGUFTensor(NamedTuple):
    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray  # dims in GGUF order (fastest first), uint64
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray  # a view of the map


class GGUFFile:
    def __init__(self, path: str) -> None:
        self.data = np.memmap(path, mode="r")
        self._buf = self.data.data  # a memoryview of the map
        magic, version = struct.unpack_from("<II", self._buf, 0)
        if magic != GGUF_MAGIC:
            raise ValueError(f"{path}: not a GGUF file")
        if version not in VERSIONS:
            raise ValueError(f"{path}: GGUF version {version} (this reads {VERSIONS}, little-endian)")
        n_tensors, n_kv = struct.unpack_from("<QQ", self._buf, 8)
        self.fields: dict[str, Any] = {}
        offs = self._read_fields(24, n_kv)
        infos, offs = self._read_tensor_infos(offs, n_tensors)
        align = self.fields.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(align, int) or align <= 0 or align & (align - 1):
            raise ValueError(f"{path}: bad general.alignment {align!r}")
        self.data_offset = offs + (-offs % align)
        self.tensors = [self._tensor(*info) for info in infos]

    def _read_fields(self, offs: int, count: int) -> int:
        for _ in range(count):
            key, offs = self._str(offs)
            (vtype,) = struct.unpack_from("<I", self._buf, offs)
            value, offs = self._value(vtype, offs + 4)
            if key in self.fields:
                raise KeyError(f"duplicate GGUF key {key!r}")
            self.fields[key] = value
        return offs

    def _str(self, offs: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", self._buf, offs)
        start = offs + 8
        return str(self._buf[start : start + n], "utf-8"), start + n

    def _value(self, vtype: int, offs: int) -> tuple[Any, int]:
        kind = GGUFValueType(vtype)
        if kind == GGUFValueType.STRING:
            return self._str(offs)
        if kind in _SCALARS:
            fmt = _SCALARS[kind]
            return struct.unpack_from(fmt, self._buf, offs)[0], offs + struct.calcsize(fmt)
        if kind != GGUFValueType.ARRAY:
            raise ValueError(f"unknown GGUF value type {vtype}")
        itype, n = struct.unpack_from("<IQ", self._buf, offs)
        offs += 12
        item = GGUFValueType(itype)
        if item in _SCALARS:  # numbers: one view, one tolist
            dtype = np.dtype(_SCALARS[item])
            values = np.frombuffer(self._buf, dtype, n, offs).tolist()
            return values, offs + n * dtype.itemsize
        out = []
        for _ in range(n):
            value, offs = self._value(itype, offs)
            out.append(value)
        return out, offs

    def _read_tensor_infos(self, offs: int, count: int) -> tuple[list[tuple[str, np.ndarray, int, int]], int]:
        infos = []
        for _ in range(count):
            name, offs = self._str(offs)
            (n_dims,) = struct.unpack_from("<I", self._buf, offs)
            dims = np.frombuffer(self._buf, "<u8", n_dims, offs + 4).copy()
            offs += 4 + 8 * n_dims
            ttype, toff = struct.unpack_from("<IQ", self._buf, offs)
            infos.append((name, dims, ttype, toff))
            offs += 12
        if len({i[0] for i in infos}) != len(infos):
            raise ValueError("duplicate GGUF tensor names")
        return infos, offs

    def _tensor(self, name: str, dims: np.ndarray, ttype: int, offset: int) -> GGUFTensor:
        kind = GGMLQuantizationType(ttype)
        n_elems = int(np.prod(dims))
        block, type_size = GGML_QUANT_SIZES[kind]
        n_bytes = n_elems * type_size // block
        shape: tuple[int, ...] = tuple(reversed(dims.tolist()))
        start = self.data_offset + offset
        item = _ELEMENT_TYPES.get(kind)
        if item is None:
            item, shape = np.uint8, quant_shape_to_byte_shape(shape, kind)
        data = self.data[start : start + n_bytes].view(item).reshape(shape)
        return GGUFTensor(name, kind, dims, n_elems, n_bytes, start, data)
