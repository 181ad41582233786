"""Grammar masks on the logits: a token whose bit is 0 in its row's packed bitmask gets -inf.

    mask_logits(logits [..., V], bitmask [..., W] int32, W = ceil(V / 32)) -> [..., V]
        bit j of word w allows token 32 * w + j (xgrammar's layout: engine/grammar/compiler.py)
    mask_rows(logits [R, K1, V], rows [R], bitmask [S, K1, W]) -> [R, K1, V]
        verify position i of row r masked with state row rows[r]'s bitmask i
        (`mask_logits(logits, bitmask[rows])`, without the [R, K1, W] gather)
    state_rows, tile_words, tile_allowed: the same bits for a tile of flat rows r * K1 + i and
        tokens, inside another kernel (kernels/linear.py's masked argmax, where no logits are
        written at all)

The torch version unpacks the bits with shifts and ands (an arithmetic shift of a word with bit
31 set smears the sign in, and `& 1` keeps the one bit asked for either way); the kernel is one
launch that reads each word once per token it covers. Both run inside the decode step's CUDA
graphs: no sync, no value-dependent shape. The values kept are copied, never recomputed: the
same results bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels._dispatch import use_triton
from kernels.pdl import pdl_args, wait_for_previous

BLOCK_V = 1024


def allowed(bitmask: Tensor, vocab: int) -> Tensor:
    """[..., V] bool: the tokens `bitmask` [..., W] allows."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask[..., :, None] >> shifts) & 1  # [..., W, 32]
    return bits.flatten(-2)[..., :vocab].bool()


def mask_logits(logits: Tensor, bitmask: Tensor) -> Tensor:
    """`logits` with -inf at every token its row's bitmask disallows (a new tensor)."""
    return logits.masked_fill(~allowed(bitmask, logits.shape[-1]), float("-inf"))


@triton.jit
def _mask_kernel(logits_ptr, rows_ptr, mask_ptr, out_ptr, V, W, stride_l, K1: tl.constexpr, BLOCK: tl.constexpr,
                 PDL: tl.constexpr):
    wait_for_previous(PDL)
    pid = tl.program_id(0)  # r * K1 + i
    r, i = pid // K1, pid % K1
    v = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = v < V
    row = tl.load(rows_ptr + r).to(tl.int64)
    words = tl.load(mask_ptr + (row * K1 + i) * W + v // 32, mask=ok, other=0)
    keep = ((words >> (v % 32)) & 1) != 0
    x = tl.load(logits_ptr + pid.to(tl.int64) * stride_l + v, mask=ok, other=0.0)
    tl.store(out_ptr + pid.to(tl.int64) * V + v, tl.where(keep, x, float("-inf")), mask=ok)


@triton.jit
def state_rows(rows_ptr, rm, M, K1):
    """[BM] int64: the state row of each flat row rm (verify position rm % K1 of request row
    rm // K1, whose state row is rows[rm // K1]); 0 past M."""
    return tl.load(rows_ptr + rm // K1, mask=rm < M, other=0).to(tl.int64)


@triton.jit
def tile_words(state, mask_ptr, rm, n0, M, N, K1, stride_s, stride_i, BN: tl.constexpr):
    """The words of `mask` [S, >= K1, W] (strides stride_s, stride_i, 1) that hold the bits of
    tokens n0 .. n0 + BN - 1 for flat rows rm (`state_rows`'s state rows): a tuple of [BM] int32,
    one per 32 tokens (one when BN <= 32: such a tile lies within a word). Rows past M and words
    past N read nothing (-1: the caller masks those tokens itself). A row's words, not a [BM, BN]
    gather of them: the gather's layout is not the GEMM's, and Triton then reduced the whole tile
    in its layout."""
    live = rm < M
    at = mask_ptr + state * stride_s + (rm % K1) * stride_i + n0 // 32
    words = ()
    for w in tl.static_range(0, BN, 32):  # a where, not `&`: Triton's interpreter refuses a scalar & a tensor mask
        words = words + (tl.load(at + w // 32, mask=tl.where(n0 + w < N, live, False), other=-1),)  # type: ignore[assignment]
    return words


@triton.jit
def tile_allowed(words, rn, n0, BN: tl.constexpr):
    """[BM, BN] bool: whether each row of `tile_words(..., n0, ..., BN)` may take token rn (rn
    from n0 on)."""
    at = (rn // 32 - n0 // 32)[None, :]  # which of the row's words holds token rn
    word = tl.where(at == 0, words[0][:, None], -1)
    for w in tl.static_range(32, BN, 32):
        word = tl.where(at == w // 32, words[w // 32][:, None], word)
    return ((word >> (rn[None, :] % 32)) & 1) != 0


def mask_rows_triton(logits: Tensor, rows: Tensor, bitmask: Tensor) -> Tensor:
    r, k1, vocab = logits.shape
    out = torch.empty_like(logits, memory_format=torch.contiguous_format)
    if r == 0:
        return out
    flat = logits.reshape(r * k1, vocab)
    assert flat.stride(-1) == 1 and bitmask.is_contiguous() and bitmask.shape[1] == k1
    _mask_kernel[(r * k1, triton.cdiv(vocab, BLOCK_V))](
        flat, rows, bitmask, out, vocab, bitmask.shape[2], flat.stride(0),
        K1=k1, BLOCK=BLOCK_V, num_warps=4, **pdl_args(logits))
    return out


def mask_rows_ref(logits: Tensor, rows: Tensor, bitmask: Tensor) -> Tensor:
    return mask_logits(logits, bitmask[rows])


def mask_rows(logits: Tensor, rows: Tensor, bitmask: Tensor) -> Tensor:
    """See the module docstring."""
    if use_triton(logits, rows, bitmask):
        return mask_rows_triton(logits, rows, bitmask)
    return mask_rows_ref(logits, rows, bitmask)
