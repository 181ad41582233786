"""engine.model.gguf_dequant against gguf.quants.dequantize, bit for bit: every tensor of the shipped
SmolLM2 file, random blocks of every type with a torch path (scales of every size, fp16
subnormals, infinities and NaNs included), and a type that falls back to gguf's numpy."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quant_shape_to_byte_shape

from engine.model.gguf_dequant import can_dequantize_in_torch, dequantize_to_torch
from engine.model.gguf_file import GGUFFile

TORCH_KINDS = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1)
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def assert_same_bits(ours: torch.Tensor, data: np.ndarray, kind: Q, what: str) -> None:
    expected = np.ascontiguousarray(dequantize(np.asarray(data), kind), dtype=np.float32)
    assert ours.dtype == torch.float32 and tuple(ours.shape) == expected.shape, what
    got = ours.cpu().numpy()
    nan = np.isnan(expected)
    np.testing.assert_array_equal(np.isnan(got), nan, err_msg=what)
    np.testing.assert_array_equal(got[~nan].view(np.uint32), expected[~nan].view(np.uint32), err_msg=what)


@pytest.mark.smollm2
@pytest.mark.parametrize("device", DEVICES)
def test_every_shipped_tensor_equals_gguf(smollm2_gguf: str, device: str) -> None:
    f = GGUFFile(smollm2_gguf)
    assert {t.tensor_type for t in f.tensors} == {Q.F32, Q.Q8_0, Q.Q4_1}
    for t in f.tensors:
        assert_same_bits(dequantize_to_torch(t.data, t.tensor_type, device), t.data, t.tensor_type, t.name)


def random_raw(kind: Q, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Random bytes in gguf's reader layout: any bit pattern, scales of every magnitude included."""
    if kind in (Q.F32, Q.F16):
        dtype = np.float32 if kind == Q.F32 else np.float16
        return rng.integers(0, 256, (*shape[:-1], shape[-1] * np.dtype(dtype).itemsize), np.uint8).view(dtype)
    return rng.integers(0, 256, quant_shape_to_byte_shape(shape, kind), np.uint8)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", TORCH_KINDS, ids=lambda k: k.name)
def test_random_blocks_equal_gguf(kind: Q, device: str) -> None:
    rng = np.random.default_rng(int(kind))
    for shape in ((64,), (3, 96), (2, 5, 32)):
        raw = random_raw(kind, shape, rng)
        assert_same_bits(dequantize_to_torch(raw, kind, device), raw, kind, f"{kind.name} {shape}")


@pytest.mark.parametrize("kind", [Q.Q4_0, Q.Q4_1, Q.Q8_0], ids=lambda k: k.name)
def test_plain_scales_give_exact_values(kind: Q) -> None:
    """A hand-made block: scale 0.5 (and min -1 for Q4_1), quants 0..15 / -128..127."""
    block_size, type_size = GGML_QUANT_SIZES[kind]
    block = np.zeros(type_size, np.uint8)
    block[:2] = np.frombuffer(np.float16(0.5).tobytes(), np.uint8)
    if kind == Q.Q8_0:
        q = np.arange(-16, 16, dtype=np.int8)
        block[2:] = q.view(np.uint8)
        expected = 0.5 * q
    else:
        start = 4 if kind == Q.Q4_1 else 2
        if kind == Q.Q4_1:
            block[2:4] = np.frombuffer(np.float16(-1).tobytes(), np.uint8)
        q = np.arange(32) % 16
        block[start:] = q[:16] | (q[16:] << 4)
        expected = 0.5 * q - 1 if kind == Q.Q4_1 else 0.5 * (q - 8)
    np.testing.assert_array_equal(dequantize_to_torch(block, kind).numpy(), expected.astype(np.float32))


def test_other_types_fall_back_to_gguf() -> None:
    assert not can_dequantize_in_torch(Q.Q6_K) and all(can_dequantize_in_torch(k) for k in TORCH_KINDS)
    rng = np.random.default_rng(3)
    raw = rng.integers(0, 256, (2, GGML_QUANT_SIZES[Q.Q6_K][1]), np.uint8)
    raw[:, -2:] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    assert_same_bits(dequantize_to_torch(raw, Q.Q6_K), raw, Q.Q6_K, "Q6_K")


def test_result_is_never_a_view_of_the_file(tmp_path) -> None:
    """F32 comes back as a copy: the loaded weights must not pin (or alias) the file's map."""
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "f.gguf"), "llama")
    w.add_tensor("w", np.ones((2, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    t = GGUFFile(tmp_path / "f.gguf").tensors[0]
    out = dequantize_to_torch(t.data, t.tensor_type)
    out += 1
    assert t.data.tolist() == [[1.0] * 4] * 2
