"""engine.model.gguf_file against gguf's own reader: the shipped SmolLM2 file and a synthetic file
with every value type, arrays (nested, of strings, empty), a custom alignment and several
tensor types give equal fields (values and Python types) and equal tensor bytes and shapes.
Bad and truncated files raise ValueError, never anything else."""

from __future__ import annotations

import random
import struct
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as VT
from gguf.quants import quantize

from engine.model.gguf_file import GGUFFile

RNG = np.random.default_rng(0)


def reference_fields(reader: gguf.GGUFReader) -> dict[str, Any]:
    return {key: field.contents() for key, field in reader.fields.items()}


def assert_same_value(ours: Any, theirs: Any, key: str) -> None:
    """Equal, and of the same Python type all the way down (1 == 1.0 == True would hide a type)."""
    assert type(ours) is type(theirs), (key, type(ours), type(theirs))
    if isinstance(ours, list):
        assert len(ours) == len(theirs), key
        for a, b in zip(ours, theirs, strict=True):
            assert_same_value(a, b, key)
    elif isinstance(ours, float) and np.isnan(theirs):
        assert np.isnan(ours), key
    else:
        assert ours == theirs, key


def assert_reads_like_gguf(path: Path | str) -> GGUFFile:
    ours, theirs = GGUFFile(path), gguf.GGUFReader(path)
    expected = reference_fields(theirs)
    assert list(ours.fields) == list(expected)
    for key, value in expected.items():
        assert_same_value(ours.fields[key], value, key)
    assert ours.data_offset == theirs.data_offset
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert a.shape == tuple(b.shape.tolist()) and a.tensor_type == b.tensor_type, a.name
        assert (a.n_elements, a.data_offset) == (b.n_elements, b.data_offset), a.name
        assert a.data.shape == b.data.shape and a.data.dtype == b.data.dtype, a.name
        assert a.data.tobytes() == np.asarray(b.data).tobytes(), a.name
    return ours


@pytest.mark.smollm2
def test_shipped_smollm2_reads_like_gguf(smollm2_gguf: str) -> None:
    f = assert_reads_like_gguf(smollm2_gguf)
    assert len(f.fields["tokenizer.ggml.tokens"]) == 49152
    assert f.fields["tokenizer.ggml.merges"][0] == "Ġ t"


# -- a synthetic file ------------------------------------------------------------------


def write_synthetic(path: Path, alignment: int = 64) -> None:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_custom_alignment(alignment)
    for kind, value in ((VT.UINT8, 200), (VT.INT8, -100), (VT.UINT16, 60000), (VT.INT16, -30000),
                        (VT.UINT32, 4_000_000_000), (VT.INT32, -2_000_000_000), (VT.FLOAT32, 1e-5),
                        (VT.UINT64, 2**64 - 1), (VT.INT64, -(2**63)), (VT.FLOAT64, 1 / 3), (VT.BOOL, True),
                        (VT.STRING, "héllo, 世界 🙂")):
        w.add_key_value(f"test.{kind.name.lower()}", value, kind)
    w.add_key_value("test.empty_string", "", VT.STRING)
    w.add_key_value("test.nan", float("nan"), VT.FLOAT32)
    for kind, values in ((VT.UINT8, [0, 255, 7]), (VT.INT16, [-1, 2]), (VT.INT32, [3, -3, 0]),
                         (VT.UINT64, [2**64 - 1, 0]), (VT.FLOAT32, [0.1, -2.5]), (VT.FLOAT64, [0.1]),
                         (VT.BOOL, [True, False, True]), (VT.STRING, ["a", "", "Ġ t", "日本"])):
        w.add_key_value(f"test.array_{kind.name.lower()}", values, VT.ARRAY, sub_type=kind)
    w.add_key_value("test.array_nested", [[1, 2], [3], [4, 5, 6]], VT.ARRAY)
    w.add_key_value("test.array_nested_strings", [["x", "yz"], ["w"]], VT.ARRAY)
    _add_tensors(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _add_tensors(w: gguf.GGUFWriter) -> None:
    values = RNG.standard_normal((4, 64)).astype(np.float32)
    w.add_tensor("f32", values)
    w.add_tensor("f32_vector", values[0])
    w.add_tensor("f16", values.astype(np.float16))
    w.add_tensor("i32", RNG.integers(-9, 9, (3, 5)).astype(np.int32))
    for kind in (Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1):
        w.add_tensor(kind.name.lower(), quantize(values, kind), raw_dtype=kind)
    # a K-quant (no torch path: dequantized by gguf): random blocks with finite scales
    blocks = RNG.integers(0, 256, (2, gguf.GGML_QUANT_SIZES[Q.Q6_K][1]), dtype=np.uint8)
    blocks[:, -2:] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    w.add_tensor("q6_k", blocks, raw_dtype=Q.Q6_K)
    w.add_tensor("f32_3d", RNG.standard_normal((2, 3, 4)).astype(np.float32))


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "synthetic.gguf"
    write_synthetic(path)
    return path


def test_synthetic_file_reads_like_gguf(synthetic: Path) -> None:
    f = assert_reads_like_gguf(synthetic)
    assert f.alignment == 64 and f.data_offset % 64 == 0
    assert f.fields["test.array_nested"] == [1, 2, 3, 4, 5, 6]  # flattened, as gguf's reader does
    assert {t.tensor_type for t in f.tensors} >= {Q.F32, Q.F16, Q.I32, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q6_K}


def test_default_alignment_reads_like_gguf(tmp_path: Path) -> None:
    w = gguf.GGUFWriter(str(tmp_path / "plain.gguf"), "llama")
    w.add_tensor("w", RNG.standard_normal((3, 32)).astype(np.float32))
    w.add_tensor("q", quantize(RNG.standard_normal((2, 64)).astype(np.float32), Q.Q4_1), raw_dtype=Q.Q4_1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert assert_reads_like_gguf(tmp_path / "plain.gguf").alignment == 32


def test_hand_built_edge_values_read_like_gguf(tmp_path: Path) -> None:
    """What GGUFWriter will not write: empty arrays, a bool byte of 2, a tensor with no dims."""
    kvs = [_kv(b"empty", VT.ARRAY, struct.pack("<IQ", VT.INT32, 0)),
           _kv(b"empty_strings", VT.ARRAY, struct.pack("<IQ", VT.STRING, 0)),
           _kv(b"bool2", VT.BOOL, b"\x02"),
           _kv(b"bools", VT.ARRAY, struct.pack("<IQ", VT.BOOL, 3) + b"\x00\x01\x05")]
    data = _header(tensors=1, kvs=len(kvs)) + b"".join(kvs) + _tensor_info(b"scalar", (), Q.F32, 0)
    data += bytes(-len(data) % 32) + struct.pack("<f", 2.5)
    (tmp_path / "edge.gguf").write_bytes(data)
    f = assert_reads_like_gguf(tmp_path / "edge.gguf")
    assert f.fields["empty"] == [] and f.fields["bool2"] is True
    assert f.tensors[0].data.tolist() == 2.5  # a 0-d view, as gguf gives it


# -- bad files ---------------------------------------------------------------------------


def test_every_truncation_is_a_value_error(synthetic: Path, tmp_path: Path) -> None:
    whole = synthetic.read_bytes()
    cut = tmp_path / "cut.gguf"
    f = GGUFFile(synthetic)
    data_end = max(t.data_offset + t.data.nbytes for t in f.tensors)  # then the writer's padding
    ends = list(range(0, f.data_offset + 8)) + [data_end - 1]
    for end in ends:
        cut.write_bytes(whole[:end])
        with pytest.raises(ValueError):
            GGUFFile(cut)


def test_random_corruption_is_parsed_or_a_value_error(synthetic: Path, tmp_path: Path) -> None:
    whole = bytearray(synthetic.read_bytes())
    header_end = GGUFFile(synthetic).data_offset
    rng = random.Random(1)
    bad = tmp_path / "bad.gguf"
    for _ in range(300):
        data = bytearray(whole)
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(header_end)] = rng.randrange(256)
        bad.write_bytes(bytes(data))
        try:
            GGUFFile(bad)
        except ValueError:
            pass


def _header(version: int = 3, tensors: int = 0, kvs: int = 1) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, tensors, kvs)


def _string(s: bytes) -> bytes:
    return struct.pack("<Q", len(s)) + s


def _kv(key: bytes, kind: int, payload: bytes) -> bytes:
    return _string(key) + struct.pack("<I", kind) + payload


BAD_FILES = {
    "empty": (b"", "empty"),
    "bad magic": (b"GGML" + bytes(20), "bad magic"),
    "big-endian": (b"GGUF" + struct.pack(">IQQ", 3, 0, 0), "big-endian"),
    "version 1": (_header(version=1, kvs=0), "version 1"),
    "unknown value type": (_header() + _kv(b"k", 99, b""), "unknown value type 99"),
    "unknown array item type": (_header() + _kv(b"k", VT.ARRAY, struct.pack("<IQ", 99, 1)), "unknown item type"),
    "string past the end": (_header() + _kv(b"k", VT.STRING, struct.pack("<Q", 2**63) + b"ab"), "value of 'k'"),
    "huge array": (_header() + _kv(b"k", VT.ARRAY, struct.pack("<IQ", VT.UINT64, 2**61)), "items of 'k'"),
    "huge string array": (_header() + _kv(b"k", VT.ARRAY, struct.pack("<IQ", VT.STRING, 2**40)), "items of 'k'"),
    "deep nesting": (_header() + _kv(b"k", VT.ARRAY, struct.pack("<IQ", VT.ARRAY, 1) * 12), "nested deeper"),
    "not utf-8": (_header() + _kv(b"k", VT.STRING, _string(b"\xff\xfe")), "not UTF-8"),
    "duplicate key": (_header(kvs=2) + _kv(b"k", VT.UINT8, b"\x01") * 2, "duplicate metadata key 'k'"),
    "alignment type": (_header() + _kv(b"general.alignment", VT.UINT64, struct.pack("<Q", 32)), "uint32"),
    "alignment 0": (_header() + _kv(b"general.alignment", VT.UINT32, struct.pack("<I", 0)), "power of two"),
    "alignment 48": (_header() + _kv(b"general.alignment", VT.UINT32, struct.pack("<I", 48)), "power of two"),
}


def _tensor_info(name: bytes, dims: tuple[int, ...], kind: int, offset: int) -> bytes:
    return _string(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, kind, offset)


BAD_TENSORS = {
    "too many dims": (_tensor_info(b"t", (1,) * 5, Q.F32, 0), "5 dims"),
    "unknown tensor type": (_tensor_info(b"t", (4,), 1234, 0), "unknown type 1234"),
    "data past the end": (_tensor_info(b"t", (4,), Q.F32, 64), "runs past the end"),
    "huge shape": (_tensor_info(b"t", (2**40, 2**40), Q.F32, 0), "runs past the end"),
    "partial block": (_tensor_info(b"t", (20,), Q.Q4_0, 0), "block size"),
    "duplicate tensor": (_tensor_info(b"t", (1,), Q.F32, 0) * 2, "appears twice"),
}


@pytest.mark.parametrize("name", list(BAD_FILES))
def test_bad_header_or_metadata_says_what(name: str, tmp_path: Path) -> None:
    data, message = BAD_FILES[name]
    (tmp_path / "bad.gguf").write_bytes(data)
    with pytest.raises(ValueError, match=message):
        GGUFFile(tmp_path / "bad.gguf")


@pytest.mark.parametrize("name", list(BAD_TENSORS))
def test_bad_tensor_table_says_what(name: str, tmp_path: Path) -> None:
    infos, message = BAD_TENSORS[name]
    count = 2 if name == "duplicate tensor" else 1
    data = _header(tensors=count, kvs=0) + infos
    data += bytes(-len(data) % 32) + bytes(16)  # aligned data section: 16 bytes
    (tmp_path / "bad.gguf").write_bytes(data)
    with pytest.raises(ValueError, match=message):
        GGUFFile(tmp_path / "bad.gguf")
