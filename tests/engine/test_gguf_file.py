"""engine/gguf_file.py reads what gguf's own GGUFReader reads: every metadata field (scalars of every
type, strings, arrays of numbers and of strings, nested arrays) and every tensor (name, type,
dims, the raw data's shape, dtype and bytes), on a file written here and on the embedded SmolLM2."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from engine.gguf_file import GGUFFile


def same_as_gguf_reader(path: str, nested: tuple[str, ...] = ()) -> None:
    """`nested`: arrays of arrays, which GGUFReader flattens (its FIXME) and GGUFFile keeps."""
    mine, theirs = GGUFFile(path), gguf.GGUFReader(path)
    expected = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert {k: v for k, v in mine.fields.items() if k not in nested} == {
        k: v for k, v in expected.items() if k not in nested}
    assert all([x for row in mine.fields[k] for x in row] == expected[k] for k in nested)
    assert [t.name for t in mine.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(mine.tensors, theirs.tensors, strict=True):
        assert (a.tensor_type, a.shape.tolist(), a.n_elements, a.n_bytes) == (b.tensor_type, b.shape.tolist(),
                                                                              b.n_elements, b.n_bytes)
        assert a.data.shape == b.data.shape and a.data.dtype == b.data.dtype
        assert np.array_equal(np.asarray(a.data), np.asarray(b.data))


def test_every_value_type_and_tensor_kind_reads_as_gguf_reader_does(tmp_path: Path) -> None:
    path = tmp_path / "kinds.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint8("k.u8", 200)
    w.add_int8("k.i8", -5)
    w.add_uint16("k.u16", 60000)
    w.add_int16("k.i16", -300)
    w.add_uint32("k.u32", 4_000_000_000)
    w.add_int32("k.i32", -70000)
    w.add_float32("k.f32", 1e-5)
    w.add_uint64("k.u64", 2**63 + 5)
    w.add_int64("k.i64", -(2**40))
    w.add_float64("k.f64", 0.1)
    w.add_bool("k.bool", True)
    w.add_string("k.str", "héllo 世界")
    w.add_array("k.ints", [1, 2, 3])
    w.add_array("k.floats", [0.5, -1.25])
    w.add_array("k.strs", ["a", "", "ü"])
    w.add_array("k.nested", [[1, 2], [3]])
    w.add_array("k.empty", [])
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((4, 64)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((3, 32)).astype(np.float16))
    q8 = gguf.quants.quantize(rng.standard_normal((2, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("q8", q8, raw_shape=q8.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    same_as_gguf_reader(str(path), nested=("k.nested",))
    assert GGUFFile(str(path)).fields["k.nested"] == [[1, 2], [3]]


def test_not_a_gguf_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "x.gguf"
    path.write_bytes(b"NOPE" + bytes(40))
    with pytest.raises(ValueError, match="not a GGUF"):
        GGUFFile(str(path))


@pytest.mark.smollm2
def test_the_embedded_smollm2_reads_as_gguf_reader_does() -> None:
    from engine.weights import resolve_model

    try:
        path = resolve_model("smollm2")
    except ModuleNotFoundError as e:
        pytest.skip(str(e))
    same_as_gguf_reader(path)
