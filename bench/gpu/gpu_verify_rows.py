"""Which decode-step op gives a sequence's first verify row other bits than a plain step does
(issue 50, exact MTP in bf16 by default): each op at SmolLM2 and Llama-1B shapes, run once as a
k = 0 step (B rows, one query a sequence) and once as a k = 3 verify (4B rows, the same first
query of each sequence followed by three others), and the first rows compared bit for bit. Each
call runs inside `kernels._dispatch.rows_a_sequence` as the runner's step does. An op can agree here
and the engine's answers still differ (BENCHMARKS.md): gpu_deterministic.py is the check that counts.

    python bench/gpu/gpu_verify_rows.py [--variants default,...]

Variants (module constants patched for both calls, to find what would make the bits equal):
  default   the code as it is
  bm        the linear kernels' row tile of the plain step for the verify too
  gemv4     the one-row GEMV kernel for up to 4 rows (batch 1's verify)
  nopre     attention reads no key tile before the PDL wait
  norope    the step's keys written by rope_and_cache before the attention kernel
  invariant the batch-invariant mode (`--deterministic`) for both calls
Prints a line per (variant, op, shape, batch): rows whose bits differ, out of B.
"""

from __future__ import annotations

import argparse
import contextlib

import torch

import kernels.gemv as gemv
import kernels.linear as lin
import kernels.paged_attention as pa
from engine.runner.model_runner import decode_splits
from kernels._dispatch import batch_invariant, rows_a_sequence
from kernels.norm import rms_norm
from kernels.rotary import rope_and_cache

SHAPES = {  # hidden, q heads, kv heads, head dim, intermediate, vocab
    "smollm2": (576, 9, 3, 64, 1536, 49152),
    "llama-1b": (2048, 32, 8, 64, 8192, 128256),
}
K = 3
BLOCK = 16


@contextlib.contextmanager
def patched(variant: str, plain_rows: int):
    saved = (lin._block_m, gemv.GEMV_MAX_M, pa.PRELOAD_KV_MAX_ROWS)
    if variant == "bm":
        bm = saved[0](plain_rows)
        lin._block_m = lambda m: bm
    elif variant == "gemv4":
        gemv.GEMV_MAX_M = K + 1
    elif variant == "nopre":
        pa.PRELOAD_KV_MAX_ROWS = 0
    try:
        with batch_invariant(variant == "invariant"):
            yield
    finally:
        lin._block_m, gemv.GEMV_MAX_M, pa.PRELOAD_KV_MAX_ROWS = saved


def first_rows(y: torch.Tensor, b: int) -> torch.Tensor:
    return y.reshape(b, K + 1, *y.shape[1:])[:, 0]


def differing(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((a.reshape(a.shape[0], -1) != b.reshape(b.shape[0], -1)).any(-1).sum())


def linear_ops(shape, gen):
    h, hq, hkv, d, inter, vocab = shape
    w = lambda n, k: (torch.randn(n, k, generator=gen) * k ** -0.5).cuda().bfloat16()  # noqa: E731
    qkv, o, gate_up, down, head = w((hq + 2 * hkv) * d, h), w(h, hq * d), w(2 * inter, h), w(h, inter), w(vocab, h)
    norm_w = (1 + 0.1 * torch.randn(h, generator=gen)).cuda().bfloat16()
    return {
        "norm": lambda x, r: rms_norm(x, norm_w, 1e-5),
        "qkv": lambda x, r: lin.linear(x, qkv),
        "o+res": lambda x, r: lin.linear(x[:, : hq * d].contiguous() if hq * d != h else x, o, residual=r.clone()),
        "gate_up": lambda x, r: lin.linear_glu(x, gate_up),
        "down+res": lambda x, r: lin.linear(torch.cat([x] * (inter // h + 1), -1)[:, :inter].contiguous(), down,
                                            residual=r.clone()),
        "head argmax": lambda x, r: lin.linear_argmax(x, head),
    }


def run_linear(variant: str, name: str, shape, batches, gen) -> list[tuple]:
    rows = []
    ops = linear_ops(shape, gen)
    h = shape[0]
    for b in batches:
        x = torch.randn(b * (K + 1), h, generator=gen).cuda().bfloat16()
        r = torch.randn(b * (K + 1), h, generator=gen).cuda().bfloat16()
        plain_x, plain_r = first_rows(x, b).contiguous(), first_rows(r, b).contiguous()
        for op, fn in ops.items():
            with patched(variant, b), rows_a_sequence(1):  # as the runner runs a step's target forward
                want = fn(plain_x, plain_r)
            with patched(variant, b), rows_a_sequence(K + 1):
                got = first_rows(fn(x, r), b)
            rows.append((variant, op, name, b, differing(want, got)))
    return rows


def attention_case(shape, b: int, ctx: int, q_len: int, gen, rope_in_kernel: bool = True):
    """b rows at context ctx (the first query at position ctx - 1), q_len queries a row."""
    _, hq, hkv, d, _, _ = shape
    width = -(-(ctx + K) // BLOCK) + 1
    blocks = 1 + b * width
    kv = torch.randn(2, blocks, BLOCK, hkv, d, generator=gen).cuda().bfloat16()
    table = (1 + torch.arange(b * width).view(b, width)).cuda()
    q = torch.randn(b, K + 1, hq, d, generator=gen).cuda().bfloat16()
    kn = torch.randn(b, K + 1, hkv, d, generator=gen).cuda().bfloat16()
    vn = torch.randn(b, K + 1, hkv, d, generator=gen).cuda().bfloat16()
    ang = torch.arange(ctx + K + 1).float()[:, None] * torch.rand(d // 2, generator=gen)[None, :]
    cos, sin = torch.cat([ang.cos()] * 2, -1).cuda(), torch.cat([ang.sin()] * 2, -1).cuda()

    def run() -> torch.Tensor:
        cache = kv.clone()
        pos = (ctx - 1 + torch.arange(q_len)).repeat(b).cuda()
        rows = torch.arange(b).repeat_interleave(q_len).cuda()
        slots = table[rows, pos // BLOCK] * BLOCK + pos % BLOCK
        take = lambda t: t[:, :q_len].reshape(b * q_len, *t.shape[2:])  # noqa: E731
        new = pa.NewKV(take(kn), take(vn), pos, cos, sin, slots)
        seq_lens = torch.full((b,), ctx - 1 + q_len, dtype=torch.int64, device="cuda")
        starts = torch.arange(b + 1, device="cuda") * q_len
        splits = decode_splits(b, hkv, width)
        if rope_in_kernel:
            out = pa.paged_attention_rope(take(q), new, cache, table, seq_lens, starts, q_len, d ** -0.5, splits)
        else:
            q_rot = rope_and_cache(take(q), new.k, new.v, pos, cos, sin, cache, slots)
            out = pa.paged_attention(q_rot, cache, table, seq_lens, starts, q_len, d ** -0.5, splits)
        return out.view(b, q_len, hq, d)[:, 0]

    return run


def run_attention(variant: str, name: str, shape, batches, contexts, gen) -> list[tuple]:
    rows = []
    for b in batches:
        for ctx in contexts:
            seed = int(torch.randint(0, 2**31, (1,), generator=gen))
            rope = variant != "norope"
            with patched(variant, b):
                want = attention_case(shape, b, ctx, 1, torch.Generator().manual_seed(seed), rope)()
            with patched(variant, b):
                got = attention_case(shape, b, ctx, K + 1, torch.Generator().manual_seed(seed), rope)()
            rows.append((variant, f"attn ctx {ctx}", name, b, differing(want, got)))
    return rows


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--variants", default="default,bm,gemv4,nopre,norope,invariant")
    p.add_argument("--batches", default="1,4,16,32")
    p.add_argument("--contexts", default="100,700,2500")
    args = p.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    rows = []
    with torch.no_grad():
        for variant in args.variants.split(","):
            for name, shape in SHAPES.items():
                rows += run_linear(variant, name, shape, batches, torch.Generator().manual_seed(0))
                rows += run_attention(variant, name, shape, batches, contexts, torch.Generator().manual_seed(1))
    print(f"{'variant':9} | {'op':14} | {'model':8} | rows differing, B = {args.batches}")
    cases: dict[tuple, list[str]] = {}
    for variant, op, name, b, n in rows:
        cases.setdefault((variant, op, name), []).append(f"{n}/{b}")
    for (variant, op, name), counts in cases.items():
        print(f"{variant:9} | {op:14} | {name:8} | {' '.join(counts)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
