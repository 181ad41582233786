"""The fresh-prefill q/k/v GEMM with rotary and the K/V write fused (kernels/qkv_rope.py) against
cuBLAS + kernels.rotary.rope_and_cache_with_k (the two-kernel path it replaces).

For SmolLM2's and Llama-3.2-1B's attention shapes at several token counts: the cuBLAS GEMM alone,
cuBLAS + the rotary kernel, and the fused kernel at each tile configuration of SWEEP, pointer
loads and TMA; each timed as a CUDA graph of calls (bench/gpu/gpu_glu.py's `graph_ms`).
Usage: python bench/gpu/gpu_qkv_rope.py   (prints a table)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.gpu.gpu_glu import graph_ms  # noqa: E402
from kernels.qkv_rope import Config, default_config, qkv_rope, qkv_rope_ref  # noqa: E402
from kernels.rotary import rope_and_cache_with_k  # noqa: E402

SHAPES = [(128, (9, 3, 64), 576), (512, (9, 3, 64), 576), (2048, (9, 3, 64), 576), (8192, (9, 3, 64), 576),
          (128, (32, 8, 64), 2048), (512, (32, 8, 64), 2048), (2048, (32, 8, 64), 2048), (8192, (32, 8, 64), 2048),
          (16384, (32, 8, 64), 2048)]
SWEEP = [Config(64, 2, 64, 4, 4), Config(64, 4, 64, 4, 3), Config(128, 2, 64, 4, 4), Config(128, 2, 64, 8, 4),
         Config(128, 4, 64, 8, 3), Config(128, 4, 64, 8, 4), Config(64, 1, 64, 4, 4), Config(128, 2, 128, 8, 3)]


def operands(t: int, heads: tuple[int, int, int], k: int):
    hq, hkv, d = heads
    x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn((hq + 2 * hkv) * d, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    positions = torch.arange(t, device="cuda") % 4096
    ang = torch.arange(4096, device="cuda").float()[:, None] * torch.rand(d // 2, device="cuda")[None, :]
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    cache = torch.zeros(2, t // 16 + 2, 16, hkv, d, device="cuda", dtype=torch.bfloat16)
    slots = torch.arange(t, device="cuda") + 16
    return x, w, None, heads, positions, cos, sin, cache, slots


def two_kernels(x, w, b, heads, positions, cos, sin, cache, slots):
    hq, hkv, d = heads
    t = x.shape[0]
    q, k, v = torch.mm(x, w.t()).split([hq * d, hkv * d, hkv * d], dim=-1)
    return rope_and_cache_with_k(q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d), positions, cos, sin,
                                 cache, slots)


def measure(t: int, heads: tuple[int, int, int], k: int) -> tuple:
    args = operands(t, heads, k)
    want = qkv_rope_ref(*args).float()
    gemm = graph_ms(lambda: torch.mm(args[0], args[1].t()))
    both = graph_ms(lambda: two_kernels(*args))
    res: dict[str, float] = {}
    for cfg in [*SWEEP, *[c._replace(tma=True) for c in SWEEP]]:
        name = f"{cfg.bm}x{cfg.bh}hx{cfg.bk} w{cfg.warps} s{cfg.stages}{' tma' if cfg.tma else ''}"
        try:
            got = qkv_rope(*args, config=cfg).float()
            if not torch.allclose(got, want, rtol=2**-6, atol=2e-2):
                print(f"WRONG {t} {heads} {name}: max err {(got - want).abs().max().item():.3g}", flush=True)
                continue
            res[name] = graph_ms(lambda cfg=cfg: qkv_rope(*args, config=cfg))
        except Exception as e:  # a tile that does not fit this GPU's shared memory
            print(f"FAIL {t} {heads} {name}: {type(e).__name__}: {str(e)[:160]}", flush=True)
    dflt = graph_ms(lambda: qkv_rope(*args))
    print(f"{t} {heads} {k}: " + ", ".join(f"{n} {v * 1e3:.1f}" for n, v in sorted(res.items(), key=lambda i: i[1])),
          flush=True)
    return gemm, both, dflt, min((v, n) for n, v in res.items())


def main() -> None:
    torch.manual_seed(0)
    rows = [(t, heads, k, *measure(t, heads, k)) for t, heads, k in SHAPES]
    print("\n| T, heads, K | cuBLAS gemm us | cuBLAS+rotary us | fused default us | fused best us (config) "
          "| best/two kernels |")
    print("|---|---|---|---|---|---|")
    for t, heads, k, gemm, both, dflt, (bv, bn) in rows:
        print(f"| {t}, {heads}, {k} | {gemm * 1e3:.1f} | {both * 1e3:.1f} | {dflt * 1e3:.1f} | {bv * 1e3:.1f} ({bn}) "
              f"| {bv / both:.2f} |")
    print(f"default configs: {[default_config(t, sum(h[:2]) + h[1], h[2], k) for t, h, k, *_ in rows]}")


if __name__ == "__main__":
    main()
