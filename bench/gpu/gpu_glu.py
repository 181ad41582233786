"""The prefill gate/up GEMM with SwiGLU fused (kernels/gemm_glu.py) against cuBLAS + silu_and_mul.

For each (tokens, intermediate, hidden) of SmolLM2 and Llama-3.2-1B: the cuBLAS GEMM alone,
cuBLAS + kernels.activation.silu_and_mul (today's prefill path), and the fused Triton kernel at
each tile configuration of SWEEP, pointer loads and TMA. Each variant is one CUDA graph of REPS
calls, replayed (median of 10 replays, per call), so launch gaps are those of a prefill graph.
Prints a table: ms per call, TFLOP/s, and the best fused config against cuBLAS + silu.
Usage: python bench/gpu/gpu_glu.py [--check]
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from kernels.activation import silu_and_mul  # noqa: E402
from kernels.gemm_glu import Config, default_config, glu_gemm, glu_gemm_ref  # noqa: E402

REPS = 20
SHAPES = [(128, 1536, 576), (512, 1536, 576), (2048, 1536, 576), (8192, 1536, 576), (16384, 1536, 576),
          (128, 8192, 2048), (512, 8192, 2048), (2048, 8192, 2048), (8192, 8192, 2048), (16384, 8192, 2048)]
SWEEP = [Config(64, 64, 64, 4, 4), Config(64, 128, 64, 4, 3), Config(128, 64, 64, 4, 4),
         Config(128, 64, 64, 8, 4), Config(128, 128, 64, 8, 3), Config(128, 128, 64, 8, 4),
         Config(128, 128, 32, 8, 4), Config(64, 128, 64, 8, 4), Config(128, 64, 128, 8, 3)]


def graph_ms(fn: Callable[[], object]) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(REPS):
            fn()
    times = []
    for _ in range(12):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / REPS)
    return statistics.median(times[2:])


def measure(m: int, inter: int, k: int) -> tuple:
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2 * inter, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    want = glu_gemm_ref(x, w).float()
    gemm = graph_ms(lambda: torch.mm(x, w.t()))
    both = graph_ms(lambda: silu_and_mul(torch.mm(x, w.t())))
    res: dict[str, float] = {}
    for cfg in [*SWEEP, *[c._replace(tma=True) for c in SWEEP]]:
        name = f"{cfg.bm}x{cfg.bn}x{cfg.bk} w{cfg.warps} s{cfg.stages}{' tma' if cfg.tma else ''}"
        try:
            got = glu_gemm(x, w, cfg).float()
            if not torch.allclose(got, want, rtol=2**-6, atol=1e-2):
                print(f"WRONG {m}x{inter}x{k} {name}: max err {(got - want).abs().max().item():.3g}", flush=True)
                continue
            res[name] = graph_ms(lambda cfg=cfg: glu_gemm(x, w, cfg))
        except Exception as e:  # a tile that does not fit this GPU's shared memory
            print(f"FAIL {m}x{inter}x{k} {name}: {type(e).__name__}: {str(e)[:120]}", flush=True)
    dflt = graph_ms(lambda: glu_gemm(x, w))
    print(f"{m}x{inter}x{k}: " + ", ".join(f"{n} {v * 1e3:.1f}" for n, v in sorted(res.items(), key=lambda t: t[1])),
          flush=True)
    return gemm, both, dflt, min((v, n) for n, v in res.items())


def main() -> None:
    torch.manual_seed(0)
    rows = [(m, inter, k, *measure(m, inter, k)) for m, inter, k in SHAPES]
    print("\n| M x I x K | cuBLAS gemm us | cuBLAS+silu us | fused default us | fused best us (config) "
          "| best/cuBLAS+silu | best TFLOP/s |")
    print("|---|---|---|---|---|---|---|")
    for m, inter, k, gemm, both, dflt, (bv, bn) in rows:
        flops = 2 * m * k * 2 * inter
        print(f"| {m}x{inter}x{k} | {gemm * 1e3:.1f} | {both * 1e3:.1f} | {dflt * 1e3:.1f} | {bv * 1e3:.1f} ({bn}) | "
              f"{bv / both:.2f} | {flops / bv / 1e9:.0f} |")
    print(f"default configs: {[default_config(m, i, k) for m, i, k, *_ in rows]}")


if __name__ == "__main__":
    main()
