"""GGUF tensor blocks -> float32 torch tensors, computed on the device the model runs on.

Receives one tensor's bytes as `engine.model.gguf_file` views them (numpy, in gguf's reader shape)
and its `GGMLQuantizationType`. Hands on the dequantized values as a float32 torch tensor in
numpy (row-major) shape, on `device`. F32, F16, BF16, Q8_0, Q4_0 and Q4_1 are done in torch
where the values are wanted (only the quantized bytes cross to a GPU, not 4 bytes a weight);
every other type falls back to `gguf.quants.dequantize` (numpy, on the host).

Careful: the results must equal gguf's numpy ones bit for bit (tests compare them), so each
formula keeps numpy's order of fp32 operations and roundings: Q4_1 is `d * q + m` as a
multiply then an add, never a fused `addcmul` (an FMA rounds once and differs in the last bit).
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

T = GGMLQuantizationType


def dequantize_to_torch(data: np.ndarray, kind: GGMLQuantizationType, device: str | torch.device = "cpu") -> torch.Tensor:
    """One tensor's values as float32 on `device`, in numpy order (GGUF lists dims reversed).
    Never a view of `data`: the result outlives the file's map."""
    if kind == T.F32:
        return _shared(data).to(device, copy=True)
    if kind == T.F16:
        return _shared(data).to(device).float()
    if kind not in _BLOCK_KINDS:
        values = np.asarray(dequantize(data, kind), dtype=np.float32)
        return torch.from_numpy(np.array(values)).to(device)  # np.array: a copy, never the map
    blocks = _shared(data).to(device).reshape(-1, GGML_QUANT_SIZES[kind][1])
    return _BLOCK_KINDS[kind](blocks).reshape(_value_shape(data.shape, kind))


def _shared(data: np.ndarray) -> torch.Tensor:
    """`data` as a tensor over the same memory, read-only arrays (views of a file's map) too:
    it is only read here, by a copy or by the ops that compute new tensors from it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(data)


def can_dequantize_in_torch(kind: GGMLQuantizationType) -> bool:
    return kind in (T.F32, T.F16) or kind in _BLOCK_KINDS


def _value_shape(byte_shape: tuple[int, ...], kind: GGMLQuantizationType) -> tuple[int, ...]:
    block_size, type_size = GGML_QUANT_SIZES[kind]
    return (*byte_shape[:-1], byte_shape[-1] // type_size * block_size)


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 scale at byte `start` of every block, as an fp32 column [blocks, 1]."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[blocks, 16] packed bytes -> [blocks, 32] values 0..15: low nibbles first, then high."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=1)


def _bf16(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.contiguous().view(torch.bfloat16).float()


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    return blocks[:, 2:].contiguous().view(torch.int8).float() * _f16(blocks, 0)


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    return _f16(blocks, 0) * (_nibbles(blocks[:, 2:]).to(torch.int8) - 8).float()


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    scaled = _f16(blocks, 0) * _nibbles(blocks[:, 4:]).float()
    return scaled.add_(_f16(blocks, 2))


_BLOCK_KINDS = {T.BF16: _bf16, T.Q8_0: _q8_0, T.Q4_0: _q4_0, T.Q4_1: _q4_1}
