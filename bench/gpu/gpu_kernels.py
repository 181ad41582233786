"""The Triton kernels against their torch references at real shapes, on a GPU (device tool).

For each kernel and shape: the largest absolute difference from the reference (bf16 inputs,
the reference in the same dtype), and the time of each (triton.testing.do_bench, median us).
Prefill attention is also timed against torch's flash SDPA on contiguous K/V, the library
kernel a prefill without a cached prefix could use. Prints one table; exits 1 if any
difference is over its tolerance. Usage: python bench/gpu/gpu_kernels.py
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from kernels._dispatch import batch_invariant
from kernels.activation import silu_and_mul_ref, silu_and_mul_triton
from kernels.linear import linear_triton
from kernels.norm import add_rms_norm_ref, add_rms_norm_triton, rms_norm_ref, rms_norm_triton
from kernels.paged_attention import paged_attention_ref, paged_attention_triton
from kernels.rotary import rope_and_cache_ref, rope_and_cache_triton

DEV, DT, BS = "cuda", torch.bfloat16, 16
SHAPES = {"smollm2": (9, 3, 64, 576, 1536), "llama-1b": (32, 8, 64, 2048, 8192)}  # Hq, Hkv, D, hidden, inter
ROWS: list[tuple] = []
FAILED: list[str] = []


def record(name: str, err: float, tol: float, fast, ref) -> None:
    t_fast, t_ref = do_bench(fast, return_mode="median") * 1e3, do_bench(ref, return_mode="median") * 1e3
    ROWS.append((name, f"{err:.2e}", f"{t_fast:.1f}", f"{t_ref:.1f}", f"{t_ref / t_fast:.1f}x"))
    if not err <= tol:
        FAILED.append(f"{name}: max abs diff {err} > {tol}")


def paged_case(shape: str, rows: int, ctx: int, q_len: int, splits: int) -> None:
    hq, hkv, d, _, _ = SHAPES[shape]
    g = torch.Generator(device=DEV).manual_seed(0)
    blocks_per_row = -(-ctx // BS)
    nb = rows * blocks_per_row + 1
    cache = torch.randn(2, nb, BS, hkv, d, device=DEV, dtype=DT, generator=g)
    tables = (torch.randperm(nb - 1, device=DEV, generator=g)[: rows * blocks_per_row] + 1).view(rows, -1)
    seq_lens = torch.full((rows,), ctx, device=DEV, dtype=torch.long)
    starts = torch.arange(0, (rows + 1) * q_len, q_len, device=DEV)
    q = torch.randn(rows * q_len, hq, d, device=DEV, dtype=DT, generator=g)
    args = (q, cache, tables, seq_lens, starts, q_len, d**-0.5, splits)
    err = (paged_attention_triton(*args).float() - paged_attention_ref(*args).float()).abs().max().item()
    record(f"attn {shape} R={rows} ctx={ctx} q={q_len} splits={splits}", err, 2e-2,
           lambda: paged_attention_triton(*args), lambda: paged_attention_ref(*args))


def prefill_case(shape: str, n: int) -> None:
    """One prompt of n tokens, no cached prefix: the paged kernel against flash SDPA."""
    hq, hkv, d, _, _ = SHAPES[shape]
    g = torch.Generator(device=DEV).manual_seed(1)
    nb = -(-n // BS) + 1
    cache = torch.randn(2, nb, BS, hkv, d, device=DEV, dtype=DT, generator=g)
    tables = torch.arange(1, nb, device=DEV).view(1, -1)
    q = torch.randn(n, hq, d, device=DEV, dtype=DT, generator=g)
    seq = torch.tensor([n], device=DEV)
    starts = torch.tensor([0, n], device=DEV)
    args = (q, cache, tables, seq, starts, n, d**-0.5, 1)
    k = cache[0, 1:].reshape(-1, hkv, d)[:n].transpose(0, 1).unsqueeze(0)
    v = cache[1, 1:].reshape(-1, hkv, d)[:n].transpose(0, 1).unsqueeze(0)
    qs = q.transpose(0, 1).unsqueeze(0)

    def sdpa():
        return F.scaled_dot_product_attention(qs, k, v, is_causal=True, enable_gqa=True)

    ours = paged_attention_triton(*args)
    err = (ours.float() - sdpa()[0].transpose(0, 1).float()).abs().max().item()
    record(f"prefill {shape} n={n} (ref = flash SDPA)", err, 2e-2, lambda: paged_attention_triton(*args), sdpa)


def norm_cases(shape: str, t: int) -> None:
    hidden = SHAPES[shape][3]
    g = torch.Generator(device=DEV).manual_seed(2)
    x = torch.randn(t, hidden, device=DEV, dtype=DT, generator=g)
    r = torch.randn(t, hidden, device=DEV, dtype=DT, generator=g)
    w = torch.randn(hidden, device=DEV, dtype=DT, generator=g)
    err = (rms_norm_triton(x, w, 1e-5).float() - rms_norm_ref(x, w, 1e-5).float()).abs().max().item()
    record(f"rms_norm {shape} T={t}", err, 6e-2, lambda: rms_norm_triton(x, w, 1e-5), lambda: rms_norm_ref(x, w, 1e-5))
    a, b = add_rms_norm_triton(x, r, w, 1e-5), add_rms_norm_ref(x, r, w, 1e-5)
    err = max((a[i].float() - b[i].float()).abs().max().item() for i in range(2))
    record(f"add_rms_norm {shape} T={t}", err, 6e-2, lambda: add_rms_norm_triton(x, r, w, 1e-5),
           lambda: add_rms_norm_ref(x, r, w, 1e-5))


def rope_case(shape: str, t: int) -> None:
    hq, hkv, d, _, _ = SHAPES[shape]
    g = torch.Generator(device=DEV).manual_seed(3)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, device=DEV, dtype=DT, generator=g)
    q, k, v = (x.view(t, -1, d) for x in qkv.split([hq * d, hkv * d, hkv * d], dim=-1))
    pos = torch.randint(0, 4000, (t,), device=DEV, generator=g)
    freqs = torch.outer(torch.arange(8192, device=DEV).float(), 1.0 / (10000 ** (torch.arange(0, d, 2, device=DEV) / d)))
    cos, sin = torch.cat([freqs, freqs], -1).cos(), torch.cat([freqs, freqs], -1).sin()
    nb = -(-t // BS) + 1
    c1, c2 = (torch.zeros(2, nb, BS, hkv, d, device=DEV, dtype=DT) for _ in range(2))
    slots = torch.randperm((nb - 1) * BS, device=DEV, generator=g)[:t] + BS
    q1 = rope_and_cache_triton(q, k, v, pos, cos, sin, c1, slots)
    q2 = rope_and_cache_ref(q, k, v, pos, cos, sin, c2, slots)
    err = max((q1.float() - q2.float()).abs().max().item(), (c1.float() - c2.float()).abs().max().item())
    record(f"rope_and_cache {shape} T={t}", err, 2e-2, lambda: rope_and_cache_triton(q, k, v, pos, cos, sin, c1, slots),
           lambda: rope_and_cache_ref(q, k, v, pos, cos, sin, c2, slots))


def silu_case(shape: str, t: int) -> None:
    inter = SHAPES[shape][4]
    x = torch.randn(t, 2 * inter, device=DEV, dtype=DT)
    err = (silu_and_mul_triton(x).float() - silu_and_mul_ref(x).float()).abs().max().item()
    record(f"silu_and_mul {shape} T={t}", err, 2e-2, lambda: silu_and_mul_triton(x), lambda: silu_and_mul_ref(x))


def invariant_linear_case(shape: str, m: int) -> None:
    """--deterministic's GEMM: a row alone gives the same bits as in a batch of m (tolerance 0),
    timed at m rows against cuBLAS (the `ref us` column)."""
    _, _, _, hidden, inter = SHAPES[shape]
    g = torch.Generator(device=DEV).manual_seed(4)
    x = torch.randn(m, hidden, device=DEV, dtype=DT, generator=g)
    w = torch.randn(2 * inter, hidden, device=DEV, dtype=DT, generator=g)
    with batch_invariant():
        batch = linear_triton(x, w)
        err = max((linear_triton(x[i : i + 1], w) - batch[i : i + 1]).abs().max().item() for i in (0, m - 1))
        record(f"invariant gate_up {shape} M={m} (ref = cuBLAS)", err, 0.0, lambda: linear_triton(x, w),
               lambda: F.linear(x, w))


def main() -> int:
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    with torch.no_grad():
        for shape in SHAPES:
            for rows, ctx, q_len, splits in ((1, 128, 1, 1), (1, 128, 4, 1), (1, 4096, 1, 1), (1, 4096, 1, 16),
                                             (1, 4096, 4, 16), (32, 512, 4, 1), (128, 128, 1, 1), (64, 1024, 4, 2)):
                paged_case(shape, rows, ctx, q_len, splits)
            for n in (512, 2048):
                prefill_case(shape, n)
            for t in (1, 128, 2048):
                norm_cases(shape, t)
            for t in (1, 128):
                rope_case(shape, t)
                silu_case(shape, t)
            for m in (4, 64, 512):
                invariant_linear_case(shape, m)
    widths = [max(len(str(r[i])) for r in ROWS + [("case", "max diff", "triton us", "ref us", "speedup")])
              for i in range(5)]
    for r in [("case", "max diff", "triton us", "ref us", "speedup")] + ROWS:
        print(" | ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)))
    for f in FAILED:
        print("FAILED", f)
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
