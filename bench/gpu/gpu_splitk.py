"""Short prefill steps' plain GEMMs (M = 128..512) of Llama-3.2-1B and SmolLM2 on a GPU: cuBLAS
(addmm_ with the residual, as kernels/linear.py runs it) against kernels/gemm_splitk.py over a
sweep of tiles and K splits, and against its `default_config`.

Each case runs inside a CUDA graph over enough weight copies that they do not fit in L2 (as in a
prefill step, where every layer's weights come from HBM), timed with events (gpu_gemv.graph_us).
Usage: python bench/gpu/gpu_splitk.py
"""

from __future__ import annotations

import itertools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench.gpu.gpu_gemv import graph_us  # noqa: E402
from kernels.gemm_splitk import Config, default_config, splitk_gemm, splitk_gemm_ref  # noqa: E402

DEV, DT = "cuda", torch.bfloat16
SHAPES = {  # name: (N, K, residual)
    "llama o": (2048, 2048, True), "llama down": (2048, 8192, True), "llama qkv": (3072, 2048, False),
    "smol o": (576, 576, True), "smol down": (576, 1536, True),
}
CONFIGS = [Config(bm, bn, bk, s) for bm, bn, bk, s in itertools.product((64, 128), (32, 64, 128), (64, 128), (1, 2, 4, 8))]


def case(name: str, n: int, k: int, res: bool, m: int) -> dict:
    copies = max(2, -(-(120 << 20) // (k * n * 2)))
    ws = [torch.randn(n, k, device=DEV, dtype=DT) * 0.05 for _ in range(copies)]
    x = torch.randn(m, k, device=DEV, dtype=DT)
    r = torch.randn(m, n, device=DEV, dtype=DT) if res else None
    ref = splitk_gemm_ref(x, ws[0], r).float()

    r_c = r.clone() if r is not None else None  # cuBLAS adds into its own copy, in place

    def cublas(w):
        return r_c.addmm_(x, w.t()) if r_c is not None else torch.nn.functional.linear(x, w)

    t_cublas = graph_us(lambda: [cublas(w) for w in ws], copies)
    results = []
    for c in [default_config(m, n, k), *CONFIGS]:
        if c.split * c.bk > k:
            continue
        try:
            y = splitk_gemm(x, ws[0], r, config=c).float()
        except Exception as e:  # noqa: BLE001 - e.g. out of shared memory for the widest tiles
            print(f"  {name} M={m} {c}: {type(e).__name__}", file=sys.stderr)
            continue
        if not ((y - ref).norm() / ref.norm()).item() < 1e-2:
            print(f"  {name} M={m} {c}: wrong", file=sys.stderr)
            continue
        results.append((graph_us(lambda c=c: [splitk_gemm(x, w, r, config=c) for w in ws], copies), c))
    default_us = results[0][0]
    best = min(results, key=lambda p: p[0])
    row = {"case": name, "M": m, "cublas_us": round(t_cublas, 2), "default_us": round(default_us, 2),
           "best_us": round(best[0], 2), "best": best[1]._asdict(), "tb_s_best": round(n * k * 2 / best[0] / 1e6, 2)}
    print(json.dumps(row), flush=True)
    return row


def main() -> int:
    rows = [case(name, *SHAPES[name], m) for name in SHAPES for m in (128, 256, 512)]
    print(f"\n{'case':12} | M   | cuBLAS us | default us | best us | TB/s | best (bm, bn, bk, split)")
    for r in rows:
        b = r["best"]
        print(f"{r['case']:12} | {r['M']:<3} | {r['cublas_us']:9.2f} | {r['default_us']:10.2f} | {r['best_us']:7.2f} "
              f"| {r['tb_s_best']:4.2f} | {b['bm']}, {b['bn']}, {b['bk']}, {b['split']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
