"""Skinny GEMMs (decode: M = 1..32 rows) of the SmolLM2 and Llama-3.2-1B shapes on a GPU:
cuBLAS (F.linear) against kernels/linear.py's split-K kernel over a sweep of tile configurations
(`--sweep`; what `tile_config` was chosen from).

Each case runs inside a CUDA graph over enough weight copies that they do not fit in L2 (as in
a decode step, where every layer's weights come from HBM), timed with events; us per call and
the weight-read bandwidth it reaches. Prints the best Triton config per (shape, M) beside cuBLAS.
First the fused kernel of kernels/linear.py against the composition it replaces, at M = 1..64.
`--draft`: only the draft heads of an FR-Spec vocabulary (the MTP's argmax GEMM over N = 32768 or
16384 rows of the LM head), fused against cuBLAS + argmax and swept over the tile configurations
(SPLIT 1: the argmax needs whole sums), with the best per shape as `tile_config` would return it.
`--prefill`: the short-prefill sizes (M = 128, 256) of both shapes, cuBLAS against the kernel over
row tiles BM too (kernels.linear.MAX_BM), to choose the tiles prefill steps of a few hundred tokens take.
`--pipeline`: Llama-1B's decode GEMMs as a step runs them (q/k/v plain, o and down with the
residual add, gate/up with silu * up), M = 1 and 4, over warps and pipeline stages as well: the
default (4 warps, 3 stages) first, then the best.
`--pipeline-wide`: q/k/v and o at M = 1 over wider tiles, 8 warps and up to 8 stages.
Usage: python bench/gpu/gpu_gemv.py [--sweep | --draft | --prefill | --pipeline | --pipeline-wide]
"""

from __future__ import annotations

import itertools
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

DEV, DT = "cuda", torch.bfloat16
SHAPES = {  # name: (K, N)
    "smol qkv": (576, 960), "smol o": (576, 576), "smol gate_up": (576, 3072), "smol down": (1536, 576),
    "smol head": (576, 49152),
    "llama qkv": (2048, 3072), "llama o": (2048, 2048), "llama gate_up": (2048, 16384),
    "llama down": (8192, 2048), "llama head": (2048, 128256),
}
DRAFT_SHAPES = {  # name: (K, N): the MTP head over a draft vocabulary of N tokens
    "llama draft 32k": (2048, 32768), "llama draft 16k": (2048, 16384), "smol draft 16k": (576, 16384),
}
CONFIGS = [dict(BN=bn, BK=bk, SPLIT=s) for bn, bk, s in itertools.product((16, 32, 64), (128, 256), (1, 2, 4, 8))]
ARGMAX_CONFIGS = [dict(BN=bn, BK=bk, SPLIT=1) for bn, bk in itertools.product((16, 32, 64, 128), (64, 128, 256))]


def sweep(x: torch.Tensor, w: torch.Tensor, c: dict) -> torch.Tensor:
    """kernels.linear's kernel with the tile configuration `c` instead of its own choice."""
    from kernels.linear import linear_triton

    return linear_triton(x, w, config=(c["BN"], c["BK"], c["SPLIT"], 4, 3))


def sweep_argmax(x: torch.Tensor, w: torch.Tensor, c: dict) -> torch.Tensor:
    """The in-GEMM argmax with the tile configuration `c`."""
    from kernels.linear import linear_argmax_triton

    return linear_argmax_triton(x, w, config=(c["BN"], c["BK"], 1, 4, 3))


def graph_us(fn, copies: int) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(7):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(5):
            g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / 5 / copies)
    return sorted(times)[3]


def _error(y: torch.Tensor, ref: torch.Tensor, argmax: bool) -> float:
    """Relative error; for an argmax (`ref`: the fp32 logits) the share of rows whose chosen logit
    is more than two bf16 roundings below the row's best (a near-tie may go either way)."""
    if argmax:
        best = ref.max(-1).values
        return float((best - ref.gather(1, y[:, None])[:, 0] > 2**-6 * best.abs()).float().mean())
    return ((y.float() - ref).norm() / ref.norm()).item()


PREFILL_CONFIGS = [dict(BN=bn, BK=bk, SPLIT=s, BM=bm) for bm, bn, bk, s
                   in itertools.product((64, 128), (16, 32, 64, 128), (64, 128), (1, 2, 4, 8))]


def case(name: str, k: int, n: int, m: int, argmax: bool = False, configs: list[dict] | None = None) -> dict:
    copies = max(2, -(-(120 << 20) // (k * n * 2)))
    ws_list = [torch.randn(n, k, device=DEV, dtype=DT) * 0.05 for _ in range(copies)]
    x = torch.randn(m, k, device=DEV, dtype=DT)
    ref = F.linear(x.float(), ws_list[0].float())
    if argmax:
        run, configs = sweep_argmax, ARGMAX_CONFIGS
        cublas = graph_us(lambda: [F.linear(x, w).argmax(-1) for w in ws_list], copies)
    else:
        run, configs = sweep, configs or CONFIGS
        cublas = graph_us(lambda: [F.linear(x, w) for w in ws_list], copies)
    bytes_ = k * n * 2
    best = (float("inf"), None)
    for c in configs:
        if c["SPLIT"] * c["BK"] > k:
            continue
        if "BM" in c:
            import kernels.linear as kl
            kl.MAX_BM = c["BM"]
        y = run(x, ws_list[0], c)
        err = _error(y, ref, argmax)
        if not err < 1e-2:
            print(f"  {name} M={m} {c}: rel err {err:.2e}", file=sys.stderr)
            continue
        t = graph_us(lambda c=c: [run(x, w, c) for w in ws_list], copies)
        best = min(best, (t, c), key=lambda p: p[0])
    row = {"case": name + (" argmax" if argmax else ""), "M": m, "cublas_us": round(cublas, 2), "cublas_tb_s": round(bytes_ / cublas / 1e6, 2),
           "triton_us": round(best[0], 2), "triton_tb_s": round(bytes_ / best[0] / 1e6, 2), "config": best[1]}
    print(json.dumps(row), flush=True)
    return row


def fused_case(name: str, k: int, n: int, m: int, op: str) -> dict:
    """kernels.linear.linear (one launch) against the torch composition it replaces (norm
    kernel, cuBLAS, add; cuBLAS + silu * up; or cuBLAS + argmax), weights rotated as above."""
    from kernels.activation import silu_and_mul
    from kernels.linear import linear, linear_argmax, linear_glu, linear_glu_ref, linear_ref
    from kernels.norm import rms_norm

    copies = max(2, -(-(120 << 20) // (k * n * 2)))
    w_list = [torch.randn(n, k, device=DEV, dtype=DT) * 0.05 for _ in range(copies)]
    x = torch.randn(m, k, device=DEV, dtype=DT)
    nw = (torch.rand(k, device=DEV, dtype=DT) + 0.5, 1e-5)
    r = torch.randn(m, n, device=DEV, dtype=DT)
    if op == "norm":
        fused, comp = (lambda w: linear(x, w, norm=nw)), (lambda w: F.linear(rms_norm(x, *nw), w))
        ref = linear_ref(x.float(), w_list[0].float(), norm=(nw[0].float(), nw[1]))
    elif op == "res":
        fused, comp = (lambda w: linear(x, w, residual=r)), (lambda w: r + F.linear(x, w))
        ref = linear_ref(x.float(), w_list[0].float(), residual=r.float())
    elif op == "glu":  # w = [gate; up]
        fused, comp = (lambda w: linear_glu(x, w)), (lambda w: silu_and_mul(F.linear(x, w)))
        ref = linear_glu_ref(x.float(), w_list[0].float())
    else:  # argmax
        fused, comp = (lambda w: linear_argmax(x, w)), (lambda w: F.linear(x, w).argmax(-1))
        ref = None
    out = fused(w_list[0])
    if ref is None:
        err = float((out != comp(w_list[0])).float().mean())  # share of rows whose argmax differs
    else:
        err = ((out.float() - ref).norm() / ref.norm()).item()
    t_f = graph_us(lambda: [fused(w) for w in w_list], copies)
    t_c = graph_us(lambda: [comp(w) for w in w_list], copies)
    row = {"case": f"{name} {op}", "M": m, "err": round(err, 5), "fused_us": round(t_f, 2), "composed_us": round(t_c, 2)}
    print(json.dumps(row), flush=True)
    return row


FUSED = [("smol", 576, 960, "norm"), ("smol", 576, 576, "res"), ("smol", 1536, 576, "res"), ("smol", 576, 3072, "glu"),
         ("llama", 2048, 16384, "glu"),
         ("smol", 576, 49152, "argmax"), ("llama", 2048, 3072, "norm"), ("llama", 2048, 16384, "norm"),
         ("llama", 8192, 2048, "res"), ("llama", 2048, 2048, "res"), ("llama", 2048, 128256, "argmax")]


PIPE_OPS = {"llama qkv": (2048, 3072, "plain"), "llama o": (2048, 2048, "res"),
            "llama gate_up": (2048, 16384, "glu"), "llama down": (8192, 2048, "res")}


def pipe_configs(op: str, k: int) -> list[tuple[int, int, int, int, int]]:
    """(BN, BK, SPLIT, WARPS, STAGES) to try; SPLIT 1 where the step's op needs whole sums."""
    splits = (1,) if op == "glu" else (1, 2, 4, 8) if k >= 4096 else (1, 2, 4)
    return [c for c in itertools.product((16, 32), (128, 256), splits, (4,), (3, 4, 6)) if c[1] * c[2] <= k]


def wide_configs(op: str, k: int) -> list[tuple[int, int, int, int, int]]:
    """`--pipeline-wide`: wider tiles, 8 warps and up to 8 stages for q/k/v and o."""
    splits = (1,) if op == "plain" else (2, 4)
    bks = (128, 256, 512) if op == "plain" else (128, 256)
    return list(itertools.product((32, 64), bks, splits, (4, 8), (4, 6, 8)))


def pipe_case(name: str, m: int, wide: bool = False) -> dict:
    """The step's op at M rows: us per call from HBM for the default launch and the best config."""
    from kernels.linear import linear_glu_triton, linear_triton

    k, n, op = PIPE_OPS[name]
    copies = max(2, -(-(120 << 20) // (k * n * 2)))
    ws_list = [torch.randn(n, k, device=DEV, dtype=DT) * 0.05 for _ in range(copies)]
    x = torch.randn(m, k, device=DEV, dtype=DT)
    res = torch.randn(m, n, device=DEV, dtype=DT) if op == "res" else None

    def run(w, c):
        if op == "glu":
            return linear_glu_triton(x, w, config=c)
        return linear_triton(x, w, residual=res, config=c)

    ref = run(ws_list[0], None).float()
    default = graph_us(lambda: [run(w, None) for w in ws_list], copies)
    best: tuple[float, tuple[int, ...] | None] = (default, None)
    for c in (wide_configs if wide else pipe_configs)(op, k):
        try:
            y = run(ws_list[0], c).float()
        except Exception as exc:  # a config past the shared memory or registers
            print(f"  {name} M={m} {c}: {type(exc).__name__}", file=sys.stderr)
            continue
        if not ((y - ref).norm() / ref.norm()).item() < 1e-2:
            print(f"  {name} M={m} {c}: wrong result", file=sys.stderr)
            continue
        t = graph_us(lambda c=c: [run(w, c) for w in ws_list], copies)
        best = min(best, (t, c), key=lambda p: p[0])
    gb = k * n * 2 / 1e3
    row = {"case": name, "M": m, "default_us": round(default, 2), "default_tb_s": round(gb / default / 1e3, 2),
           "best_us": round(best[0], 2), "best_tb_s": round(gb / best[0] / 1e3, 2), "best": best[1]}
    print(json.dumps(row), flush=True)
    return row


def print_sweep(rows: list[dict]) -> None:
    print(f"\n{'case':22} | M  | cuBLAS us | TB/s | triton us | TB/s | best config")
    for r in rows:
        c = r["config"] or {}
        print(f"{r['case']:22} | {r['M']:<2} | {r['cublas_us']:9.2f} | {r['cublas_tb_s']:4.2f} | {r['triton_us']:9.2f} "
              f"| {r['triton_tb_s']:4.2f} | BN={c.get('BN')} BK={c.get('BK')} split={c.get('SPLIT')} BM={c.get('BM', '-')}")


def print_fused(rows: list[dict]) -> None:
    print(f"\n{'fused case':28} | M  | err      | fused us | composed us")
    for r in rows:
        print(f"{r['case']:28} | {r['M']:<2} | {r['err']:.2e} | {r['fused_us']:8.2f} | {r['composed_us']:8.2f}")


def draft_heads() -> None:
    """The FR-Spec draft heads: tile_config's choice (fused) and the argmax sweep, M = 1..16."""
    from kernels.linear import tile_config

    print_fused([fused_case(name, k, n, m, "argmax") for name, (k, n) in DRAFT_SHAPES.items() for m in (1, 4, 16)])
    print_sweep([case(name, k, n, m, argmax=True) for name, (k, n) in DRAFT_SHAPES.items() for m in (1, 4, 16)])
    for name, (k, n) in DRAFT_SHAPES.items():
        print(f"tile_config({n}, {k}) = (BN, BK, SPLIT) {tile_config(n, k)}  [{name}]")


def main() -> int:
    if "--prefill" in sys.argv:
        shapes = [s for s in SHAPES if "head" not in s and "gate_up" not in s]
        print_sweep([case(name, *SHAPES[name], m, configs=PREFILL_CONFIGS) for name in shapes for m in (128, 256)])
        return 0
    if "--draft" in sys.argv:
        draft_heads()
        return 0
    if "--pipeline" in sys.argv or "--pipeline-wide" in sys.argv:
        wide = "--pipeline-wide" in sys.argv
        rows = ([pipe_case(name, 1, wide=True) for name in ("llama qkv", "llama o")] if wide
                else [pipe_case(name, m) for name in PIPE_OPS for m in (1, 4)])
        print(f"\n{'case':14} | M | default us | TB/s | best us | TB/s | best (BN, BK, SPLIT, WARPS, STAGES)")
        for r in rows:
            print(f"{r['case']:14} | {r['M']} | {r['default_us']:10.2f} | {r['default_tb_s']:4.2f} | {r['best_us']:7.2f} "
                  f"| {r['best_tb_s']:4.2f} | {r['best']}")
        return 0
    print_fused([fused_case(name, k, n, m, op) for name, k, n, op in FUSED for m in (1, 4, 16, 32, 64)])
    if "--sweep" in sys.argv:
        print_sweep([case(name, k, n, m) for name, (k, n) in SHAPES.items() for m in (1, 4, 16)])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
