"""Linear layers of a decode step, with the ops around them fused in, and a batch-invariant mode.

    linear(x, w, b=None, norm=None, residual=None) = residual + F.linear(pre(x), w, b)
        pre(x) = rms_norm(x, *norm)   with norm = (weight [K], eps), else x
    linear_argmax(x, w, norm=None)  = argmax over n of linear(x, w, norm=norm)   (first on ties),
                                      mapped through id_map [N] when given; with mask = (rows, bitmask),
                                      of the grammar-masked logits (kernels/token_mask.py mask_rows)
    linear_glu(x, w, norm=None)     = silu(g) * u,  [g | u] = linear(x, w, norm=norm)  (w = [gate; up])

    x [M, K] (rows contiguous in K), w [N, K] (an nn.Linear weight), b [N]; residual [M, N]

Rounding follows the torch composition (`linear_ref`): the norm's output and the GEMM's are
rounded to the model dtype, the residual add rounds once more, and `linear_argmax` takes the
argmax of the rounded logits. The kernel differs only in the order of its fp32 sums. Above
decode sizes on CUDA, a residual add runs in cuBLAS's epilogue (`_addmm`), rounded once.

One Triton kernel serves all three (`_skinny_kernel`): a program computes a BM x BN output
tile over a fixed share of K (split-K: SPLIT shares, summed in order by a second launch), with
the bias, residual add, silu(gate) * up (the program reads a block of gate rows and the
matching up rows into two accumulators) or a per-tile argmax in its epilogue: at decode sizes
(M <= FUSED_MAX_M) one launch where cuBLAS + an elementwise op takes two, and no logits
written for an argmax. A grammar-constrained greedy step's argmax reads its tokens' bits in the
same epilogue (`MASK`: a disallowed column is -inf before the tile's argmax): no logits are
written, masked in a pass of their own, then read again by an argmax. Its rows' words of the
bitmask are asked for before the K loop (their state rows before the PDL wait: kernels/pdl.py), a
[BM] vector per 32 columns, so the tile's argmax stays in the GEMM's register layout. It runs up to
MASKED_MAX_M rows whatever the weight: where a plain argmax leaves a large weight to cuBLAS,
the masked composition would add the mask's pass over the logits to that. A weighted norm
stays its own kernel (`kernels.norm.rms_norm`): applied to the A operand as it is loaded, it
keeps Triton from pipelining the weight loads (several times slower), as silu * up does on the
down projection's A, and so does summing A's squares in the K loop (BENCHMARKS.md). A weightless norm (its
weight folded into w: `engine.model.llama.fold_norms`) runs in the epilogue instead, as a row scale on
the sums, from x's row sums of squares that the GEMM which wrote x (a residual add: this kernel,
or its split-K sum) stored per column tile (`kernels.norm.store_partial_sumsq`, carried on the
output tensor: `row_sumsq_of`); the main loop is untouched. Where x has none (cuBLAS wrote it, or
it changed in place since), the norm runs as its own kernel.

Launches of one sequence (kernels.gemv.GEMV_MAX_M) over small weights (SmolLM2's layers at batch
1) take the register-tile GEMV of kernels/gemv.py instead, with the same epilogue
(kernels/epilogue.py), outside the batch-invariant mode.

Exact MTP: within a decode step's target forward (`kernels._dispatch.rows_a_sequence`), what a
launch's configuration depends on is its sequences, not its rows: the GEMV, the row tile (a
plain step's rows take the tile a verify of VERIFY_ROWS rows a sequence takes: `_block_m`) and
the argmax's kernel up to MASKED_MAX_M rows. A verify row then runs the sums of the plain step of
its batch, and greedy decoding with drafts gives the answers of greedy decoding without, in bf16
too. The preload (below) follows the rows: it changes when a block is read, not the order of the
sums, and a verify of more than PRELOAD_MAX_M rows is faster without it. Where they may differ
still: a verify past the fused kernel's rows (`_fused`: 64, 128 for small weights), where cuBLAS
picks its kernels by M.

Under programmatic dependent launch (kernels/pdl.py) the kernel starts while the one before it
still runs; before its wait it asks for its share of the weights in L2 (`_prefetch_rows`, whole
rows up to PREFETCH_BYTES a launch), for weights of at most PREFETCH_MAX bytes: a small model's
step is a chain of latency-bound launches, and the prefetch hides part of each one's weight
read; larger weights gain nothing and evict each other from L2. For weights up to PRELOAD_MAX
and up to PRELOAD_MAX_M rows, each program also reads its first K block into registers before
the wait (`PRELOAD`), and takes that block's product ahead of the loop, in the loop's order;
with larger weights or more rows the held registers cost more than the early read saves.

Batch-invariant mode (`kernels._dispatch.batch_invariant()`, `--deterministic`): a row's result
must not depend on how many rows share the call. cuBLAS and CPU BLAS pick tiling, split-K and
kernels by M, so there:
  * CUDA: the same kernel with BM = 16 for every M and the tile configuration chosen by the
    weight's shape alone (`tile_config`): each output is summed in the same order whatever M is;
  * elsewhere: one GEMV per row (`linear_invariant_ref`; slow, and exactly as invariant).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels import gemm_glu
from kernels._dispatch import VERIFY_ROWS, invariant, rows_per_sequence, sequences, use_triton
from kernels.activation import silu_and_mul, silu_and_mul_ref
from kernels.epilogue import gemm_epilogue
from kernels.gemv import gemv_config, launch_gemv
from kernels.norm import (
    attach_row_sumsq,
    rms_norm,
    rms_norm_ref,
    row_sumsq_of,
    rstd_of_partials,
)
from kernels.pdl import pdl_args, prefetch_l2, wait_for_previous
from kernels.token_mask import mask_rows, state_rows, tile_allowed, tile_words

FUSED_MAX_M = 64  # rows up to which the kernel runs by default (decode sizes)
SMALL_MAX_M = 128  # and up to this many rows for weights
SMALL_WEIGHT = 2**21  # of at most this many elements
MAX_BM = 64  # the kernel's row tile: rows above it take more tiles
INVARIANT_BM = 16
PREFETCH_BYTES = 4 * 2**20  # L2 prefetch per launch, at most: more evicts what the step reads next
# weights above PREFETCH_MAX get none: their own reads already keep the memory busy
PREFETCH_MAX = 8 * 2**20
# a program's first K block of weights read into registers before the PDL wait, for weights up to
# PRELOAD_MAX and launches of up to PRELOAD_MAX_M rows (see the module's text)
PRELOAD_MAX = 4 * 2**20
PRELOAD_MAX_M = 32
# rows up to which a masked argmax, or a verify's whose plain step takes the kernel, runs the kernel
# whatever the weight (batch 32 at k = 3)
MASKED_MAX_M = 128

Norm = tuple[torch.Tensor | None, float]  # (weight, or None where it is folded into the GEMM's; eps)
RowNorm = tuple[float, torch.Tensor]  # (eps, x's partial row sums of squares [M, tiles]): the kernel's own norm
# a grammar mask for an argmax over x [R * K1, K]: (rows [R], the state row of each request row;
# bitmask [S, K1, W] int32, xgrammar's layout); flat row r * K1 + i takes bitmask[rows[r], i]. Under PDL
# rows are read before the wait: they must not come from the kernel launched just before (kernels/pdl.py)
TokenMask = tuple[torch.Tensor, torch.Tensor]


Config = tuple[int, int, int, int, int]  # (BN, BK, SPLIT, WARPS, STAGES): tile_config's, or a sweep's instead


def tile_config(n: int, k: int, interpreted: bool = False) -> Config:
    """(BN, BK, SPLIT, WARPS, STAGES) for a weight [n, k], from sweeps on an H100
    (bench/gpu/gpu_gemv.py): narrow tiles keep enough programs in flight for the small weights,
    wide ones suit the large; long rows are split in four so that a short N still fills the GPU.
    Mid-sized weights (8-48 MB: Llama-1B's q/k/v, o and down) take 32-column tiles and deeper
    pipelines. `interpreted` (CPU tensors, Triton's interpreter): tiles up to 128 columns wide, as
    the interpreter runs programs one after another at a fixed cost per op. Shape only: the
    batch-invariant mode relies on it not depending on M."""
    size = 2 * n * k
    if 8 * 2**20 <= size <= 48 * 2**20:
        return (32, 128, 1, 4, 6) if n > k else (32, 128, 4, 4, 4)
    bn = 64 if n >= 8192 else 16
    if interpreted:
        bn = max(bn, min(128, triton.next_power_of_2(n)))
    bk = 256 if k >= 256 else max(16, triton.next_power_of_2(k))
    split = 4 if k >= 4096 else 1
    return bn, bk, split, 4, 3


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, b_ptr, r_ptr, y_ptr, ws_ptr, val_ptr, idx_ptr, ssi_ptr, sso_ptr,
                   rows_ptr, bits_ptr,
                   M, N, K, stride_x, stride_w, stride_r, stride_y, k_per_split, eps, NTI,
                   K1, stride_bs, stride_bi,
                   HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
                   ARGMAX: tl.constexpr, MASK: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr,
                   GLU: tl.constexpr,
                   NORM: tl.constexpr, NTP: tl.constexpr, SS_OUT: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr,
                   PREFETCH: tl.constexpr = False, LINES: tl.constexpr = 1, PER_LINE: tl.constexpr = 64,
                   PRELOAD: tl.constexpr = False):
    if PREFETCH:  # the weights are never written: ask for this program's share in L2 while the kernel before runs
        _prefetch_rows(w_ptr, tl.program_id(1) * BN + tl.arange(0, BN), tl.program_id(2) * k_per_split,
                       k_per_split, N, K, stride_w, GLU, LINES, PER_LINE)
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    k_lo = pid_k * k_per_split
    if PRELOAD:  # the first K block of weights into registers while the kernel before runs
        w_mask0 = (rn[:, None] < N) & (k_lo + rk[None, :] < K)
        w_rows0 = w_ptr + rn[:, None].to(tl.int64) * stride_w + k_lo + rk[None, :]
        w0 = tl.load(w_rows0, mask=w_mask0, other=0.0)
        u0 = tl.load(w_rows0 + N * stride_w, mask=w_mask0 & GLU, other=0.0)
    if MASK:  # the grammar's state rows: written before the step began (kernels/pdl.py)
        state = state_rows(rows_ptr, rm, M, K1)
    wait_for_previous(PDL)
    if MASK:  # this tile's words of the bitmask, asked for ahead of the K loop, which hides their latency
        words = tile_words(state, bits_ptr, rm, pid_n * BN, M, N, K1, stride_bs, stride_bi, BN)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    acc_up = tl.zeros([BM, BN], dtype=tl.float32)  # GLU: the up half's columns (weight rows N + rn)
    k_first = k_lo
    if PRELOAD:  # that block's product first: the same order of sums as the loop's
        a0 = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_x + k_lo + rk[None, :],
                     mask=(rm[:, None] < M) & (k_lo + rk[None, :] < K), other=0.0)
        acc += tl.dot(a0, tl.trans(w0), input_precision=PRECISION)
        if GLU:
            acc_up += tl.dot(a0, tl.trans(u0), input_precision=PRECISION)
        k_first = k_lo + BK
    for k0 in range(k_first, k_lo + k_per_split, BK):  # in order: the same sum whatever M is
        kk = k0 + rk
        a = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_x + kk[None, :],
                    mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        w_rows = w_ptr + rn[:, None].to(tl.int64) * stride_w + kk[None, :]
        w_mask = (rn[:, None] < N) & (kk[None, :] < K)
        acc += tl.dot(a, tl.trans(tl.load(w_rows, mask=w_mask, other=0.0)), input_precision=PRECISION)
        if GLU:
            w_up = tl.load(w_rows + N * stride_w, mask=w_mask, other=0.0)
            acc_up += tl.dot(a, tl.trans(w_up), input_precision=PRECISION)
    if NORM:  # a weightless RMSNorm of x, applied to the sums (SPLIT == 1: they are whole)
        rstd = rstd_of_partials(ssi_ptr, rm, M, NTI, K, eps, NTP)[:, None]
        acc *= rstd
        acc_up *= rstd
    if ARGMAX:  # this tile's best column per row, of the logits rounded as torch would
        keep = rn[None, :] < N
        if MASK:  # the grammar's: -inf where mask_rows would put it, the kept logits unchanged
            keep &= tile_allowed(words, rn, pid_n * BN, BN)
        logit = tl.where(keep, acc.to(y_ptr.dtype.element_ty).to(tl.float32), float("-inf"))
        best, at = tl.max(logit, axis=1, return_indices=True, return_indices_tie_break_left=True)
        n_tiles = tl.num_programs(1)
        tl.store(val_ptr + rm * n_tiles + pid_n, best, mask=rm < M)
        tl.store(idx_ptr + rm * n_tiles + pid_n, pid_n * BN + at, mask=rm < M)
    elif SPLIT == 1:
        gemm_epilogue(acc, acc_up, rm, rn, M, N, b_ptr, r_ptr, stride_r, y_ptr, stride_y, sso_ptr,
                      HAS_BIAS, HAS_RES, GLU, SS_OUT)
    else:
        part = ws_ptr + pid_k * M * N + rm[:, None] * N + rn[None, :]
        tl.store(part, acc, mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def _prefetch_rows(w_ptr, rn, k_lo, k_len, N, K, stride_w, GLU: tl.constexpr, LINES: tl.constexpr,
                   PER_LINE: tl.constexpr):
    """L2 prefetch of weight rows `rn` (and their up rows N + rn with GLU), columns k_lo to
    k_lo + k_len: one request per 128-byte line of PER_LINE elements (LINES >= lines per row;
    extra ones repeat the last)."""
    cols = tl.minimum(k_lo + tl.arange(0, LINES) * PER_LINE, tl.minimum(k_lo + k_len, K) - 1)
    rows = tl.minimum(rn, N - 1).to(tl.int64)
    prefetch_l2(w_ptr + rows[:, None] * stride_w + cols[None, :])
    if GLU:
        prefetch_l2(w_ptr + (rows[:, None] + N) * stride_w + cols[None, :])


@triton.jit
def _sum_splits_kernel(ws_ptr, b_ptr, r_ptr, y_ptr, sso_ptr, M, N, stride_r, stride_y,
                       HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, SPLIT: tl.constexpr, SS_OUT: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for s in range(SPLIT):  # in order
        acc += tl.load(ws_ptr + s * M * N + rm[:, None] * N + rn[None, :], mask=mask, other=0.0)
    gemm_epilogue(acc, acc, rm, rn, M, N, b_ptr, r_ptr, stride_r, y_ptr, stride_y, sso_ptr, HAS_BIAS, HAS_RES, False, SS_OUT)


@triton.jit
def _argmax_tiles_kernel(val_ptr, idx_ptr, map_ptr, out_ptr, n_tiles, BLOCK: tl.constexpr, HAS_MAP: tl.constexpr,
                         PDL: tl.constexpr):
    """Per row, the best of the tiles' best columns (the first tile on ties: the lowest id),
    through `map` when given (a draft vocabulary's row -> full-vocabulary id)."""
    wait_for_previous(PDL)
    row = tl.program_id(0)
    t = tl.arange(0, BLOCK)
    v = tl.load(val_ptr + row * n_tiles + t, mask=t < n_tiles, other=float("-inf"))
    _, at = tl.max(v, axis=0, return_indices=True, return_indices_tie_break_left=True)
    best = tl.load(idx_ptr + row * n_tiles + at).to(tl.int64)
    if HAS_MAP:
        best = tl.load(map_ptr + best).to(tl.int64)
    tl.store(out_ptr + row, best)


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _block_m(m: int) -> int:
    """The row tile of a launch of m rows. Within a decode step's target forward it follows the
    step's sequences: a plain step's rows take the tile of a verify of VERIFY_ROWS rows a
    sequence over the same batch, so a verify row and a plain step's row run the same compiled
    kernel (another tile is another MMA shape, whose fp32 sums may round differently)."""
    if invariant():
        return INVARIANT_BM
    if rows_per_sequence() is not None:
        m = VERIFY_ROWS * sequences(m)
    return min(MAX_BM, max(16, triton.next_power_of_2(m)))


def _split(w: torch.Tensor, config: Config | None, whole: bool) -> int:
    """The launch's split-K count; `whole` (an argmax, silu * up): 1, they need the whole sum."""
    return 1 if whole else (config or tile_config(*w.shape))[2]


def _launch(x2, w, b, residual, y, argmax_out=None, config: Config | None = None,
            glu: bool = False, id_map=None, norm: RowNorm | None = None, sumsq: bool = False,
            mask: TokenMask | None = None) -> torch.Tensor | None:
    """One GEMM launch (and its split-K sum or argmax pass). `glu`: y = silu(x @ gate.T) * (x @ up.T)
    with w = [gate; up] stacked by rows, one output column per gate/up row pair. `id_map`: the
    argmax pass writes id_map[argmax]; `mask`, the grammar mask it applies. `norm`: x is normalized
    (a weightless RMSNorm) by the kernel, from its rows' partial sums of squares, the row scale
    applied to the sums (the launch must not split K). With a residual add (or `sumsq`), returns y's rows' partial sums of squares
    [M, tiles] (for the next GEMM's norm)."""
    m, (n, k) = x2.shape[0], w.shape
    assert w.stride(-1) == 1 and x2.shape[1] == k, f"weight {tuple(w.shape)} does not take {x2.shape[1]} inputs"
    if glu:
        assert n % 2 == 0 and b is None and residual is None, "gate/up GEMM: an even weight, no bias or add"
    gemv = None if argmax_out is not None or config is not None or invariant() else gemv_config(m, w, glu)
    if gemv is not None:  # one row over a small weight (kernels/gemv.py)
        return launch_gemv(x2, w, b, residual, y, gemv, glu, norm, sumsq)
    # not the argmax's: numpy's matmul (the interpreter's tl.dot) may round a column by its place in
    # the tile, and equal columns in two tiles must tie there as on the GPU
    bn, bk, _, warps, stages = config or tile_config(n, k, interpreted=not x2.is_cuda and argmax_out is None)
    split = _split(w, config, argmax_out is not None or glu)
    assert norm is None or split == 1, "a norm in the GEMM needs the whole of K in one program"
    bm, n_out = _block_m(m), n
    if glu:
        n_out, bn = n // 2, max(16, bn // 2)  # each program reads bn rows of gate and bn of up
    room = 49152 if stages <= 3 else 90112  # elements of shared memory for the stages (96 / 176 KB)
    while (bm * bk + (2 if glu else 1) * bn * bk) * max(stages, 3) > room and bk > 16:
        bk //= 2  # keep the stages in shared memory
    k_per = triton.cdiv(triton.cdiv(k, split), bk) * bk
    grid = (triton.cdiv(m, bm), triton.cdiv(n_out, bn), split)
    ws = torch.empty(split, m, n_out, dtype=torch.float32, device=x2.device) if split > 1 else y
    val = idx = y
    if argmax_out is not None:
        val = torch.empty(m, grid[1], dtype=torch.float32, device=x2.device)
        idx = torch.empty(m, grid[1], dtype=torch.int32, device=x2.device)
    r = residual if residual is not None else y
    sso = torch.empty(m, grid[1], dtype=torch.float32, device=x2.device) if residual is not None or sumsq else None
    eps, ssi = norm if norm is not None else (0.0, None)
    nti = ssi.shape[1] if ssi is not None else 1
    rows, bits, k1, stride_bs, stride_bi = _mask_args(mask, m, n_out, y)
    pdl = pdl_args(x2)
    size = w.numel() * w.element_size()
    pf = _prefetch_args(w, k_per, split) if pdl["PDL"] and size <= PREFETCH_MAX else {}
    preload = m <= PRELOAD_MAX_M and size <= PRELOAD_MAX
    _skinny_kernel[grid](
        x2, w, b if b is not None else w, r, y, ws, val, idx, ssi if ssi is not None else y,
        sso if sso is not None else y, rows, bits,
        m, n_out, k, x2.stride(0), w.stride(0), r.stride(0), y.stride(0), k_per, eps, nti, k1, stride_bs, stride_bi,
        HAS_BIAS=b is not None, HAS_RES=residual is not None,
        ARGMAX=argmax_out is not None, MASK=mask is not None, SPLIT=split,
        PRECISION="ieee" if x2.dtype == torch.float32 else "tf32",
        GLU=glu, NORM=ssi is not None, NTP=triton.next_power_of_2(nti), SS_OUT=sso is not None and split == 1,
        BM=bm, BN=bn, BK=bk, num_warps=warps, num_stages=stages, PRELOAD=preload, **pdl, **pf)
    if argmax_out is not None:
        _argmax_tiles_kernel[(m,)](val, idx, id_map if id_map is not None else idx, argmax_out, grid[1],
                                   BLOCK=triton.next_power_of_2(grid[1]), HAS_MAP=id_map is not None, **pdl)
    elif split > 1:
        _sum_splits_kernel[(triton.cdiv(m, bm), triton.cdiv(n_out, bn))](
            ws, b if b is not None else ws, r, y, sso if sso is not None else ws, m, n_out, r.stride(0), y.stride(0),
            HAS_BIAS=b is not None, HAS_RES=residual is not None, SPLIT=split, SS_OUT=sso is not None,
            BM=bm, BN=bn, **pdl)
    return sso


def _mask_args(mask: TokenMask | None, m: int, n: int, unused: torch.Tensor) -> tuple:
    """The kernel's grammar-mask arguments: (rows, bitmask, K1, the bitmask's state-row and
    position strides); `unused` in place of the tensors without a mask."""
    if mask is None:
        return unused, unused, 1, 0, 0
    rows, bits = mask
    k1 = m // max(rows.shape[0], 1)
    assert rows.shape[0] * k1 == m and bits.shape[1] == k1, f"{m} rows do not take {rows.shape[0]} x {bits.shape[1]}"
    assert bits.dtype == torch.int32 and bits.stride(2) == 1 and 32 * bits.shape[2] >= n
    return rows, bits, k1, bits.stride(0), bits.stride(1)


def _prefetch_args(w: torch.Tensor, k_per: int, split: int) -> dict:
    """The L2 prefetch of a launch's weights: whole rows up to PREFETCH_BYTES in all, else the
    first lines of each program's row share (a weight larger than L2 prefetched whole evicts
    its own lines before the program reads them)."""
    per_line = 128 // w.element_size()
    lines = triton.cdiv(k_per, per_line)
    fit = max(1, PREFETCH_BYTES // (w.shape[0] * split * 128))
    if lines > fit:
        lines = 1 << (fit.bit_length() - 1)  # a power of two at most `fit`
    return {"PREFETCH": True, "LINES": triton.next_power_of_2(lines), "PER_LINE": per_line}


def linear_triton(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, norm: Norm | None = None,
                  residual: torch.Tensor | None = None, config: Config | None = None,
                  sumsq: bool = False) -> torch.Tensor:
    """`config`: (BN, BK, SPLIT, WARPS, STAGES) instead of `tile_config`'s (bench/gpu/gpu_gemv.py
    sweeps them)."""
    x2, row_norm = _pre(x, norm, _split(w, config, False))
    y = torch.empty(x2.shape[0], w.shape[0], dtype=x.dtype, device=x.device)
    sso = None
    if x2.shape[0]:
        sso = _launch(x2, w, b, _rows(residual) if residual is not None else None, y, config=config, norm=row_norm,
                      sumsq=sumsq)
    out = y.view(*x.shape[:-1], w.shape[0])
    if sso is not None:
        attach_row_sumsq(out, sso)
    return out


def linear_glu_triton(x: torch.Tensor, w: torch.Tensor, norm: Norm | None = None,
                      config: Config | None = None) -> torch.Tensor:
    x2, row_norm = _pre(x, norm, 1)
    y = torch.empty(x2.shape[0], w.shape[0] // 2, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        _launch(x2, w, None, None, y, config=config, glu=True, norm=row_norm)
    return y.view(*x.shape[:-1], w.shape[0] // 2)


def linear_argmax_triton(x: torch.Tensor, w: torch.Tensor, norm: Norm | None = None, id_map: torch.Tensor | None = None,
                         out: torch.Tensor | None = None, config: Config | None = None,
                         mask: TokenMask | None = None) -> torch.Tensor:
    """`out`: a contiguous int64 tensor of x's rows to write into (made when None)."""
    assert mask is None or id_map is None, "a grammar mask is in the full vocabulary, not a draft vocabulary's"
    x2, row_norm = _pre(x, norm, 1)
    if out is None:
        out = torch.empty(x.shape[:-1], dtype=torch.int64, device=x.device)
    assert out.is_contiguous() and out.dtype == torch.int64 and out.numel() == x2.shape[0]
    if x2.shape[0]:
        _launch(x2, w, None, None, torch.empty(0, 1, dtype=x.dtype, device=x.device), out, config=config,
                id_map=id_map, norm=row_norm, mask=mask)
    return out


def _pre(x: torch.Tensor, norm: Norm | None, split: int) -> tuple[torch.Tensor, RowNorm | None]:
    """x's rows for a launch of `split` K shares, and the norm for the kernel to apply itself: a
    weightless one where the GEMM that wrote x left its rows' partial sums of squares. Else the
    norm (if any) runs as its own kernel first."""
    if norm is not None and norm[0] is None and split == 1:
        partials = row_sumsq_of(x)
        if partials is not None and partials.shape[0] == x.numel() // x.shape[-1]:
            return _rows(x), (norm[1], partials)
    return _rows(_norm(x, norm)), None


def _norm(x: torch.Tensor, norm: Norm | None) -> torch.Tensor:
    return x if norm is None else rms_norm(x, *norm)


def linear_ref(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, norm: Norm | None = None,
               residual: torch.Tensor | None = None) -> torch.Tensor:
    """The torch composition; one GEMV per row (`linear_invariant_ref`) in batch-invariant mode."""
    h = rms_norm_ref(x, *norm) if norm is not None else x
    y = linear_invariant_ref(h, w, b) if invariant() else F.linear(h, w, b)
    return y if residual is None else residual + y


def linear_invariant_ref(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """One F.linear per row: every row is computed as a batch of one."""
    x2 = x.reshape(-1, x.shape[-1])
    rows = [F.linear(x2[i : i + 1], w, b) for i in range(x2.shape[0])]
    y = torch.cat(rows) if rows else F.linear(x2, w, b)
    return y.view(*x.shape[:-1], w.shape[0])


def _fused(x: torch.Tensor, w: torch.Tensor, plain: bool = False) -> bool:
    """Whether the Triton kernel runs: always in the batch-invariant mode; else at decode sizes,
    except for a plain GEMM (no epilogue) of a weight under 8192 x 2048 without programmatic
    dependent launch (kernels/pdl.py), where cuBLAS is as fast or faster (bench/gpu/gpu_gemv.py
    --sweep). With PDL the kernel's launch overlaps the kernel before it, which a cuBLAS launch
    does not. Up to SMALL_MAX_M rows for small weights, where a short prefill is launch-bound and
    one launch per GEMM wins; larger weights are bandwidth-bound there, and cuBLAS wins."""
    if not use_triton(x, w):
        return False
    if invariant():
        return True
    big = w.shape[0] >= 8192 and w.shape[1] >= 2048
    m = x.numel() // x.shape[-1]
    rows_ok = m <= FUSED_MAX_M or (m <= SMALL_MAX_M and w.numel() <= SMALL_WEIGHT)
    return rows_ok and (big or not plain or pdl_args(x)["PDL"])


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, norm: Norm | None = None,
           residual: torch.Tensor | None = None, sumsq: bool = False) -> torch.Tensor:
    """residual + F.linear(pre(x), w, b): one Triton launch on CUDA at decode sizes and in the
    batch-invariant mode; the torch composition otherwise (its norm still a Triton kernel on CUDA,
    its add in cuBLAS's epilogue). `residual` may come back updated in place (`_addmm`): pass
    one that is not read afterwards (the decoder's residual stream). `sumsq`: where the kernel
    runs, the output carries its rows' sums of squares, so a weightless norm of it runs inside the
    next GEMM (the MTP's eh_proj output, read by its block's folded input norm)."""
    # x's norm can run inside the kernel (where x's writer left its sums of squares): not a plain GEMM
    own_norm = norm is not None and norm[0] is None and row_sumsq_of(x) is not None
    if _fused(x, w, plain=residual is None and not own_norm and not sumsq):
        return linear_triton(x, w, b, norm, residual, sumsq=sumsq)
    if norm is not None and use_triton(x, w):
        x, norm = rms_norm(x, *norm), None
    if residual is not None and b is None and x.is_cuda and not invariant():
        return _addmm(x, w, residual)
    return linear_ref(x, w, b, norm, residual)


def _addmm(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """residual + x @ w.T as one cuBLAS GEMM with the add in its epilogue (beta = 1), at
    prefill sizes: one launch and one pass over the output fewer. Outside autograd the sum is
    written into `residual` itself (C = D: no copy of C first) and it is returned. It rounds
    once where the torch composition rounds the product first (fp32 sums either way)."""
    n = w.shape[0]
    x2, r2 = x.reshape(-1, x.shape[-1]), residual.reshape(-1, n)
    grads = torch.is_grad_enabled() and (x.requires_grad or w.requires_grad or residual.requires_grad)
    if grads or r2.data_ptr() != residual.data_ptr() or not r2.is_contiguous():
        return torch.addmm(r2, x2, w.t()).view(*residual.shape[:-1], n)
    r2.addmm_(x2, w.t())
    return residual


def linear_glu(x: torch.Tensor, w: torch.Tensor, norm: Norm | None = None) -> torch.Tensor:
    """silu(gate) * up of linear(x, w, norm=norm) with w = [gate; up] (a fused [2I, K] weight):
    one launch where the kernel runs; at prefill sizes on CUDA `kernels.gemm_glu` (the same in
    one launch); the GEMM then `kernels.activation.silu_and_mul` otherwise."""
    if _fused(x, w):
        return linear_glu_triton(x, w, norm)
    if use_triton(x, w):  # prefill sizes: SwiGLU in the GEMM's epilogue
        return gemm_glu.glu_gemm(_rows(_norm(x, norm)), w).view(*x.shape[:-1], w.shape[0] // 2)
    return silu_and_mul(linear(x, w, norm=norm))


def linear_glu_ref(x: torch.Tensor, w: torch.Tensor, norm: Norm | None = None) -> torch.Tensor:
    return silu_and_mul_ref(linear_ref(x, w, norm=norm))


def linear_argmax(x: torch.Tensor, w: torch.Tensor, norm: Norm | None = None, id_map: torch.Tensor | None = None,
                  out: torch.Tensor | None = None, mask: TokenMask | None = None) -> torch.Tensor:
    """The argmax row ids of linear(x, w, norm=norm) [..., N] (first on ties), without
    writing the logits where the kernel runs; id_map[argmax] with `id_map` [N] int64 (a draft
    vocabulary's ids), written into `out` when given (one launch fewer each). `mask`: of the
    logits `mask_rows` masks with it (a row that allows nothing gets id 0, as torch's argmax of
    all -inf gives), x's rows [R * K1] read as R requests of K1 verify positions."""
    m = x.numel() // x.shape[-1]
    masked = mask is not None and use_triton(x, w, *mask) and m <= MASKED_MAX_M
    # a verify's rows past FUSED_MAX_M whose plain step runs the kernel: the kernel, for its bits
    verify = m <= MASKED_MAX_M and sequences(m) <= FUSED_MAX_M and use_triton(x, w)
    if _fused(x, w) or masked or verify:
        return linear_argmax_triton(x, w, norm, id_map, out, mask=mask)
    logits = linear(x, w, norm=norm)
    if mask is not None:
        rows, bits = mask
        logits = mask_rows(logits.reshape(rows.shape[0], -1, logits.shape[-1]), rows, bits).view(logits.shape)
    ids = logits.argmax(dim=-1)
    ids = id_map[ids] if id_map is not None else ids
    return out.copy_(ids) if out is not None else ids
