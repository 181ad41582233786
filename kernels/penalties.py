"""Penalties and logit bias of a decode step, read straight from the per-slot state (the
formulas: engine/sampling/penalties.py), and the counts the step's emitted tokens add to that state.

    penalize_rows(logits [R, K1, V], rows [R], drafts [R, K1-1], presence, frequency, repetition [S],
                  bias [S, V] fp32, counts [S, V] int32, prompt [S, V] bool) -> [R, K1, V] fp32:
        verify position i of row r penalized with slot rows[r]'s state, drafts d_1..d_i counted
        as output (`penalize` on the gathered rows)
    count_emitted(counts, rows, tokens [R, K1], n [R]): counts[rows[r], tokens[r, j]] += 1, j < n[r]

One launch each where torch takes ~30 (six gathers of the slot rows, three of them [R, V], the
drafts' scatter and cumsum, the formula's elementwise ops, the counts' index arithmetic and
scatter-add). The sums are integer (atomic adds of counts) and the float ops are those of the
torch formula in its order, unfused (`enable_fp_fusion=False`): the same fp32 results.
A row may repeat in `rows` only if it emits nothing (the spare padding row: n = 0).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels._dispatch import use_triton
from kernels.pdl import pdl_args, wait_for_previous

BLOCK_V = 1024


def penalize(x: Tensor, bias: Tensor, prompt: Tensor, counts: Tensor, presence: Tensor, frequency: Tensor,
             repetition: Tensor) -> Tensor:
    """The formulas on fp32 logits `x`; every other argument broadcasts to it."""
    x = x + bias
    seen = prompt | (counts > 0)
    x = torch.where(seen, torch.where(x > 0, x / repetition, x * repetition), x)
    return x - frequency * counts - presence * (counts > 0).to(x.dtype)


def verify_penalize(logits: Tensor, drafts: Tensor, presence: Tensor, frequency: Tensor, repetition: Tensor,
                    bias: Tensor, counts: Tensor, prompt: Tensor) -> Tensor:
    """`penalize` at each of the K1 verify positions of R rows whose state is given per row
    ([R] scalars, [R, V] bias, counts, prompt), drafts before the position counted as output."""
    rows, k1, vocab = logits.shape
    counts = counts[:, None, :].expand(rows, k1, vocab)
    if k1 > 1:
        drafted = torch.zeros(rows, k1 - 1, vocab, dtype=counts.dtype, device=logits.device)
        drafted.scatter_(2, drafts[:, :, None].to(torch.int64), 1)
        before = torch.cat([torch.zeros_like(drafted[:, :1]), drafted.cumsum(1, dtype=counts.dtype)], 1)
        counts = counts + before
    return penalize(logits.float(), bias[:, None], prompt[:, None], counts, presence[:, None, None],
                    frequency[:, None, None], repetition[:, None, None])


@triton.jit
def _penalize_kernel(logits_ptr, rows_ptr, drafts_ptr, pres_ptr, freq_ptr, rep_ptr, bias_ptr, counts_ptr, prompt_ptr,
                     out_ptr, V, stride_l, K1: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    pid = tl.program_id(0)  # r * K1 + i
    r, i = pid // K1, pid % K1
    v = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = v < V
    row = tl.load(rows_ptr + r).to(tl.int64)
    state = row * V + v
    x = tl.load(logits_ptr + pid.to(tl.int64) * stride_l + v, mask=ok, other=0.0).to(tl.float32)
    x = x + tl.load(bias_ptr + state, mask=ok, other=0.0)
    counts = tl.load(counts_ptr + state, mask=ok, other=0)
    for j in tl.static_range(K1 - 1):  # the drafts before position i count as output
        d = tl.load(drafts_ptr + r * (K1 - 1) + j)
        counts += ((v == d) & (j < i)).to(tl.int32)
    seen = (tl.load(prompt_ptr + state, mask=ok, other=0) != 0) | (counts > 0)
    rep = tl.load(rep_ptr + row)
    x = tl.where(seen, tl.where(x > 0, tl.math.div_rn(x, tl.zeros_like(x) + rep), x * rep), x)  # IEEE, as torch
    x = x - tl.load(freq_ptr + row) * counts.to(tl.float32)
    x = x - tl.load(pres_ptr + row) * (counts > 0).to(tl.float32)
    tl.store(out_ptr + pid.to(tl.int64) * V + v, x, mask=ok)


@triton.jit
def _count_kernel(counts_ptr, rows_ptr, tokens_ptr, n_ptr, V, stride_t, K1: tl.constexpr, KB: tl.constexpr,
                  PDL: tl.constexpr):
    wait_for_previous(PDL)
    r = tl.program_id(0)
    j = tl.arange(0, KB)
    emitted = j < tl.load(n_ptr + r)
    tokens = tl.load(tokens_ptr + r * stride_t + j, mask=emitted & (j < K1), other=0)
    row = tl.load(rows_ptr + r).to(tl.int64)
    tl.atomic_add(counts_ptr + row * V + tokens, tl.full([KB], 1, tl.int32), mask=emitted & (j < K1))


def penalize_rows_triton(logits, rows, drafts, presence, frequency, repetition, bias, counts, prompt) -> Tensor:
    r, k1, vocab = logits.shape
    out = torch.empty(r, k1, vocab, dtype=torch.float32, device=logits.device)
    if r == 0:
        return out
    flat = logits.reshape(r * k1, vocab)
    assert flat.stride(-1) == 1 and bias.is_contiguous() and counts.is_contiguous() and prompt.is_contiguous()
    _penalize_kernel[(r * k1, triton.cdiv(vocab, BLOCK_V))](
        flat, rows, drafts.contiguous() if k1 > 1 else rows, presence, frequency, repetition, bias, counts,
        prompt.view(torch.uint8), out, vocab, flat.stride(0),
        K1=k1, BLOCK=BLOCK_V, num_warps=4, enable_fp_fusion=False, **pdl_args(logits))
    return out


def penalize_rows_ref(logits, rows, drafts, presence, frequency, repetition, bias, counts, prompt) -> Tensor:
    return verify_penalize(logits, drafts, presence[rows], frequency[rows], repetition[rows], bias[rows],
                           counts[rows], prompt[rows])


def penalize_rows(logits: Tensor, rows: Tensor, drafts: Tensor, presence: Tensor, frequency: Tensor,
                  repetition: Tensor, bias: Tensor, counts: Tensor, prompt: Tensor) -> Tensor:
    """See the module docstring."""
    args = (logits, rows, drafts, presence, frequency, repetition, bias, counts, prompt)
    if use_triton(logits, rows, counts):
        return penalize_rows_triton(*args)
    return penalize_rows_ref(*args)


def count_emitted_triton(counts: Tensor, rows: Tensor, tokens: Tensor, n: Tensor) -> None:
    r, k1 = tokens.shape
    if r == 0:
        return
    assert tokens.stride(-1) == 1 and counts.is_contiguous()
    _count_kernel[(r,)](counts, rows, tokens, n, counts.shape[1], tokens.stride(0),
                        K1=k1, KB=triton.next_power_of_2(k1), num_warps=1, **pdl_args(counts))


def count_emitted_ref(counts: Tensor, rows: Tensor, tokens: Tensor, n: Tensor) -> None:
    cols = torch.arange(tokens.shape[1], device=tokens.device)
    emitted = (cols[None, :] < n[:, None]).to(counts.dtype)
    index = rows[:, None] * counts.shape[1] + tokens.clamp(min=0)
    counts.view(-1).scatter_add_(0, index.reshape(-1), emitted.reshape(-1))


def count_emitted(counts: Tensor, rows: Tensor, tokens: Tensor, n: Tensor) -> None:
    """See the module docstring; in place, stream-ordered."""
    if use_triton(counts, rows, tokens):
        return count_emitted_triton(counts, rows, tokens, n)
    return count_emitted_ref(counts, rows, tokens, n)
