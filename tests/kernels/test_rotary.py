"""The fused rotary + KV-cache write: the Triton launcher matches the torch reference (q/k/v
as strided views of one fused projection, odd head sizes, repeated trash slots, cache dtype
casts), the reference is `RotaryEmbedding` + `write_kv` bit for bit, and the public function
dispatches to the reference off CUDA and inside `reference_kernels()`."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kernels import _dispatch, rotary

MAX_POSITIONS, NUM_BLOCKS, BLOCK_SIZE = 64, 5, 4


def make_case(tokens, hq, hkv, dim, dtype, device, cache_dtype=None, seed=0) -> SimpleNamespace:
    """q, k, v as views of one fused [T, (Hq + 2 Hkv) D] projection; distinct slots outside
    the trash block; a cache full of noise (slots not written must keep it)."""
    g = torch.Generator().manual_seed(seed)
    fused = torch.randn(tokens, (hq + 2 * hkv) * dim, generator=g).to(dtype=dtype, device=device)
    q, k, v = (p.view(tokens, -1, dim) for p in fused.split([hq * dim, hkv * dim, hkv * dim], dim=-1))
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, dim, 2).float() / dim))
    freqs = torch.outer(torch.arange(MAX_POSITIONS).float(), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1).to(device)
    slots = BLOCK_SIZE + torch.randperm((NUM_BLOCKS - 1) * BLOCK_SIZE, generator=g)[:tokens]
    cache = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, hkv, dim, generator=g)
    return SimpleNamespace(
        q=q, k=k, v=v, cos=emb.cos(), sin=emb.sin(),
        positions=torch.randint(0, MAX_POSITIONS, (tokens,), generator=g).to(device),
        slots=slots.to(device), cache=cache.to(dtype=cache_dtype or dtype, device=device),
    )


def run(fn, c: SimpleNamespace) -> tuple[torch.Tensor, torch.Tensor]:
    cache = c.cache.clone()
    return fn(c.q, c.k, c.v, c.positions, c.cos, c.sin, cache, c.slots), cache


def assert_same(actual: torch.Tensor, expected: torch.Tensor, exact: bool) -> None:
    """The kernel does the reference's fp32 ops in its order (built without FMA contraction),
    so it matches bit for bit, except where a value went through an fp32 -> bf16 cast under
    Triton's interpreter, which truncates where GPUs round to nearest even (an ulp)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if exact or actual.is_cuda:
        assert torch.equal(actual, expected)
    else:
        torch.testing.assert_close(actual.float(), expected.float(), rtol=2**-7, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 4, 2, 16), (5, 6, 2, 12), (3, 8, 1, 64)], ids=str)
def test_rope_and_cache_kernel_matches_reference(device, dtype, shape):
    c = make_case(*shape, dtype, device)
    q, cache = run(rotary.rope_and_cache_triton, c)
    ref_q, ref_cache = run(rotary.rope_and_cache_ref, c)
    assert q.is_contiguous() and q.shape == c.q.shape
    assert_same(q, ref_q, exact=dtype == torch.float32)
    assert_same(cache, ref_cache, exact=dtype == torch.float32)


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)])
def test_rope_and_cache_kernel_casts_k_and_v_to_the_cache_dtype(device, dtype, cache_dtype):
    c = make_case(4, 4, 2, 16, dtype, device, cache_dtype)
    q, cache = run(rotary.rope_and_cache_triton, c)
    ref_q, ref_cache = run(rotary.rope_and_cache_ref, c)
    assert q.dtype == dtype and cache.dtype == cache_dtype
    assert_same(q, ref_q, exact=dtype == torch.float32)
    assert_same(cache, ref_cache, exact=False)


def test_repeated_trash_slots_hold_one_of_their_writers(device):
    c = make_case(6, 4, 2, 16, torch.float32, device)
    c.slots[3:] = 0  # three masked rows, all on the trash block's first slot
    q, cache = run(rotary.rope_and_cache_triton, c)
    ref_q, ref_cache = run(rotary.rope_and_cache_ref, c)
    assert torch.equal(q, ref_q)
    flat, ref_flat = cache.flatten(1, 2), ref_cache.flatten(1, 2)  # [2, slots, Hkv, D]
    assert torch.equal(flat[:, 1:], ref_flat[:, 1:])
    writers = (rotary._rotate_ref(c.k, c.positions, c.cos, c.sin)[3:], c.v[3:])
    for plane, rows in enumerate(writers):  # writers race there: each element is one of theirs
        assert (flat[plane, 0][None] == rows).any(0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_equals_rotary_embedding_and_write_kv_bit_for_bit(dtype):
    from engine.model.attention import write_kv
    from engine.model.config import ArchConfig
    from engine.model.llama import RotaryEmbedding

    config = ArchConfig(
        vocab_size=32, hidden_size=48, intermediate_size=64, num_hidden_layers=1, num_attention_heads=6,
        num_key_value_heads=2, head_dim=8, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
    )
    rope = RotaryEmbedding(config, MAX_POSITIONS)
    c = make_case(5, 6, 2, 8, dtype, "cpu")
    c.slots[3:] = 0
    cache = c.cache.clone()
    q = rotary.rope_and_cache_ref(c.q, c.k, c.v, c.positions, rope.cos, rope.sin, cache, c.slots)
    model_cache = c.cache.clone()
    write_kv(model_cache, rope(c.positions, c.k), c.v, c.slots)
    assert torch.equal(q, rope(c.positions, c.q))
    assert torch.equal(cache, model_cache)


def test_public_function_runs_the_reference_off_cuda_and_in_reference_kernels(device):
    c = make_case(5, 6, 2, 12, torch.bfloat16, device)
    ref_q, ref_cache = run(rotary.rope_and_cache_ref, c)
    with _dispatch.reference_kernels():
        q, cache = run(rotary.rope_and_cache, c)
        assert torch.equal(q, ref_q) and torch.equal(cache, ref_cache)
    q, cache = run(rotary.rope_and_cache, c)
    assert_same(q, ref_q, exact=device == "cpu")  # the kernel on CUDA: bit for bit as well
    assert_same(cache, ref_cache, exact=device == "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_with_k_also_returns_the_rotated_k_it_wrote(device, dtype):
    """`rope_and_cache_with_k` (fresh prefill's flash attention reads it): the kernel's k_rot
    equals the reference's and the rotated k in the cache, and q_rot and the cache are those of
    `rope_and_cache`."""
    c = make_case(9, 6, 2, 32, dtype, device, seed=5)
    with _dispatch.triton_on_cpu():
        (q_rot, k_rot), cache = run(rotary.rope_and_cache_with_k, c)
        q_plain, cache_plain = run(rotary.rope_and_cache, c)
    (q_ref, k_ref), _ = run(with_k_ref, c)
    assert torch.equal(q_rot, q_plain) and torch.equal(cache, cache_plain)
    assert_same(k_rot, k_ref, exact=dtype == torch.float32)
    flat = cache.view(2, -1, 2, 32)
    assert torch.equal(flat[0][c.slots], k_rot.to(cache.dtype))


def with_k_ref(q, k, v, positions, cos, sin, kv_cache, slots):
    """The reference path of `rope_and_cache_with_k` (what it runs off CUDA)."""
    with _dispatch.reference_kernels():
        return rotary.rope_and_cache_with_k(q, k, v, positions, cos, sin, kv_cache, slots)
