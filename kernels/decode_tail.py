"""The decode step's tail: accept drafts, cut at stops and max_tokens, advance the batch state.

For each row r of a step (state row `rows[r]`, k drafts, k+1 verify positions):

    greedy (n_emit is None): `ids` [R, k+1] are the target's argmax at the verify positions;
        a = leading count of drafts[row, j] == ids[r, j] (j < k);  tokens = ids, -1 after column a;
        n = a + 1
    otherwise: `ids` are the tokens rejection sampling emitted and n_emit[r] their count
    n        -> cut after the first emitted token that is a stop id of the row, then to the
                row's room (max_tokens - num_generated); 0 for a row already done
    finished = (a stop was emitted or num_generated + n >= max_tokens) and the row was not done
    state[row]: last_token = tokens[n-1] (kept when n = 0), seq_lens += n, num_generated += n,
                done |= finished

Returns (tokens [R, k+1], n [R], finished [R], new seq_lens [R], last_at [R]); `tokens` keep every
column verification produced (the MTP redraft reads them all), the host reads the first n;
last_at = r * (k+1) + max(n-1, 0), the flat index of the row's last kept token (the MTP redraft
continues from its hidden). tokens, n and finished (int64, 0/1) are written where the host reads
them: the first R*(k+2) elements of `out` (int64, 1-D), in that order (engine/runner/step_output.py).
Shapes: state tensors are per slot ([S], drafts [S, k], stop_ids [S, M], M a power of two),
int64 except `done` (bool). One program per row: the torch version is ~35 launches.
A row may repeat in `rows` only if it is done (the spare padding row): its writes agree.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._dispatch import use_triton
from kernels.pdl import pdl_args, wait_for_previous


@triton.jit
def _tail_kernel(ids_ptr, n_in_ptr, rows_ptr, drafts_ptr, stops_ptr, max_tokens_ptr, num_gen_ptr,
                 seq_ptr, last_ptr, done_ptr, tok_out_ptr, n_out_ptr, fin_out_ptr, len_out_ptr, at_out_ptr,
                 K1: tl.constexpr, KB: tl.constexpr, M: tl.constexpr, GREEDY: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    r = tl.program_id(0)
    row = tl.load(rows_ptr + r)
    j = tl.arange(0, KB)
    ids = tl.load(ids_ptr + r * K1 + j, mask=j < K1, other=-1)
    if GREEDY:
        drafts = tl.load(drafts_ptr + row * (K1 - 1) + j, mask=j < K1 - 1, other=-2)
        miss = (drafts != ids) & (j < K1 - 1)
        accepted = tl.min(tl.where(miss, j, K1 - 1), axis=0)
        tokens = tl.where(j <= accepted, ids, -1)
        n = accepted + 1
    else:
        tokens = ids
        n = tl.load(n_in_ptr + r).to(tl.int32)
    stops = tl.load(stops_ptr + row * M + tl.arange(0, M))
    hit = tl.sum((tokens[:, None] == stops[None, :]).to(tl.int32), axis=1)
    is_stop = (hit > 0) & (j < n)
    has_stop = tl.max(is_stop.to(tl.int32), axis=0) > 0
    n = tl.where(has_stop, tl.min(tl.where(is_stop, j, KB), axis=0) + 1, n).to(tl.int64)
    num_gen = tl.load(num_gen_ptr + row)
    max_tokens = tl.load(max_tokens_ptr + row)
    done = tl.load(done_ptr + row).to(tl.int1)
    n = tl.where(done, 0, tl.minimum(n, max_tokens - num_gen))
    finished = (has_stop | (num_gen + n >= max_tokens)) & (done == 0)
    last = tl.sum(tl.where(j == n - 1, tokens, 0), axis=0)
    last = tl.where(n > 0, last, tl.load(last_ptr + row))
    new_len = tl.load(seq_ptr + row) + n
    tl.store(tok_out_ptr + r * K1 + j, tokens, mask=j < K1)
    tl.store(n_out_ptr + r, n)
    tl.store(fin_out_ptr + r, tl.where(finished, 1, 0).to(tl.int64))  # int64 0/1 in the packed outputs
    tl.store(len_out_ptr + r, new_len)
    tl.store(at_out_ptr + r, r * K1 + tl.maximum(n - 1, 0))
    tl.store(last_ptr + row, last)
    tl.store(seq_ptr + row, new_len)
    tl.store(num_gen_ptr + row, num_gen + n)
    tl.store(done_ptr + row, done | finished)


Tail = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _outputs(ids: torch.Tensor, out: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """(tokens [R, k+1], n [R], finished [R]) as views of `out` (made when None), new_len, last_at."""
    r, k1 = ids.shape
    if out is None:
        out = torch.empty(r * (k1 + 2), dtype=torch.long, device=ids.device)
    assert out.dtype == torch.long and out.is_contiguous() and out.numel() >= r * (k1 + 2)
    tokens, n, finished = out[: r * (k1 + 2)].split([r * k1, r, r])
    new_len, last_at = torch.empty(2, r, dtype=torch.long, device=ids.device)
    return tokens.view(r, k1), n, finished, new_len, last_at


def accept_and_advance_triton(ids, n_emit, rows, drafts, stop_ids, max_tokens, num_generated, seq_lens,
                              last_token, done, out=None) -> Tail:
    r, k1 = ids.shape
    m = stop_ids.shape[1]
    assert m == triton.next_power_of_2(m), "stop_ids width must be a power of two"
    res = _outputs(ids, out)
    if r == 0:
        return res  # type: ignore[return-value]
    tokens, n, finished, new_len, last_at = res
    _tail_kernel[(r,)](
        ids.contiguous(), n_emit if n_emit is not None else n, rows, drafts, stop_ids, max_tokens, num_generated,
        seq_lens, last_token, done, tokens, n, finished, new_len, last_at,
        K1=k1, KB=triton.next_power_of_2(k1), M=m, GREEDY=n_emit is None, num_warps=1, **pdl_args(ids),
    )
    return tokens, n, finished, new_len, last_at


def accept_and_advance_ref(ids, n_emit, rows, drafts, stop_ids, max_tokens, num_generated, seq_lens,
                           last_token, done, out=None) -> Tail:
    k1 = ids.shape[1]
    cols = torch.arange(k1, device=ids.device)
    if n_emit is None:
        matches = drafts[rows].to(torch.int64) == ids[:, : k1 - 1]
        accepted = torch.cumprod(matches.to(torch.int64), dim=1).sum(dim=1)
        tokens = torch.where(cols[None, :] <= accepted[:, None], ids, torch.full_like(ids, -1))
        n_emit = accepted + 1
    else:
        tokens = ids
    was_done = done[rows]
    valid = cols.unsqueeze(0) < n_emit.unsqueeze(1)
    is_stop = (tokens.unsqueeze(-1) == stop_ids[rows].unsqueeze(1)).any(-1) & valid
    has_stop = is_stop.any(1)
    n = torch.where(has_stop, is_stop.float().argmax(1) + 1, n_emit)
    n = torch.minimum(n, max_tokens[rows] - num_generated[rows])
    n = torch.where(was_done, torch.zeros_like(n), n)
    finished = (has_stop | (num_generated[rows] + n >= max_tokens[rows])) & ~was_done
    new_len = seq_lens[rows] + n
    last = tokens.gather(1, (n - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
    last_token[rows] = torch.where(n > 0, last, last_token[rows])
    seq_lens[rows] = new_len
    num_generated[rows] += n
    done[rows] = was_done | finished
    res = _outputs(ids, out)
    for dst, src in zip(res, (tokens, n, finished, new_len), strict=False):
        dst.copy_(src)
    res[4].copy_(torch.arange(ids.shape[0], device=ids.device) * k1 + (n - 1).clamp(min=0))
    return res  # type: ignore[return-value]


def accept_and_advance(ids, n_emit, rows, drafts, stop_ids, max_tokens, num_generated, seq_lens,
                       last_token, done, out=None) -> Tail:
    """See the module docstring; `n_emit` None means greedy verification of `ids`; `out` the
    packed output buffer (made when None)."""
    args = (ids, n_emit, rows, drafts, stop_ids, max_tokens, num_generated, seq_lens, last_token, done, out)
    if use_triton(ids, rows, seq_lens):
        return accept_and_advance_triton(*args)
    return accept_and_advance_ref(*args)
