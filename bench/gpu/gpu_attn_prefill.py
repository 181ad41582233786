"""Prefill attention on one GPU: pdserve's varlen path against torch's SDPA backends.

For fresh prompts (no cached prefix) pdserve runs `kernels.flash_varlen.flash_varlen` over the
packed step; the issue's bar is torch's flash SDPA on the same prompts as a padded batch.
Cases are (batch, prompt, query heads, KV heads, head dim) of SmolLM2 and Llama-3.2-1B; each
variant is timed with CUDA events (median of 20 after warm-up) and reported as ms and TFLOP/s
of causal attention (4 x Hq x D x N^2 / 2 per prompt). Variants:
  varlen        flash_varlen with max_q = the prompt length
  varlen@T      the same with max_q = all tokens of the step (what a graph of one bucket passed)
  sdpa-flash    F.scaled_dot_product_attention, flash backend, [B, H, N, D], K/V heads repeated
  sdpa-cudnn    the same, cuDNN backend
  sdpa-eff      the same, memory-efficient backend
  cudnn-varlen  cuDNN over the packed step (aten._cudnn_attention_forward with cumulative
                lengths), K/V heads as stored (GQA); "wrong" where it disagrees with varlen
                (torch 2.11 builds its plan on every call, ~50 ms; a capture of it in a CUDA
                graph fails: the stream capture is invalidated, 2026-11-24)
  triton        kernels.flash_prefill (pdserve's Triton kernel), its default tiles
  triton BM/BN/W/S   the same with BLOCK_M, BLOCK_N, warps and stages given (a sweep)
  fa4-varlen    FlashAttention 4's varlen forward (flash_attn.cute, the package torch's
                activate_flash_attention_impl("FA4") loads), where it is installed
Usage: python bench/gpu/gpu_attn_prefill.py   (prints a table)
"""

from __future__ import annotations

import functools
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from kernels.flash_prefill import Config, flash_prefill  # noqa: E402
from kernels.flash_varlen import flash_varlen  # noqa: E402

SWEEP: list[Config] = [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 3), (64, 32, 4, 4),
                       (128, 32, 4, 4), (64, 64, 4, 4)]
CASES = [(1, 2048, 9, 3, 64), (16, 512, 9, 3, 64), (4, 4096, 9, 3, 64),
         (1, 512, 32, 8, 64), (1, 2048, 32, 8, 64), (16, 512, 32, 8, 64), (4, 4096, 32, 8, 64)]


def timed(fn: Callable[[], object], iters: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def variants(b: int, n: int, hq: int, hkv: int, d: int) -> dict[str, Callable[[], Callable[[], object]]]:
    """name -> a maker of the variant's call (a maker may raise: the backend does not take it)."""
    t = b * n
    q = torch.randn(t, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(t, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(t, hkv, d, device="cuda", dtype=torch.bfloat16)
    cu = torch.arange(0, t + 1, n, device="cuda", dtype=torch.int32)
    scale = d**-0.5
    qb = q.view(b, n, hq, d).transpose(1, 2)
    kb = k.view(b, n, hkv, d).transpose(1, 2).repeat_interleave(hq // hkv, dim=1)
    vb = v.view(b, n, hkv, d).transpose(1, 2).repeat_interleave(hq // hkv, dim=1)

    def sdpa(backend: SDPBackend) -> Callable[[], object]:
        def run() -> object:
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale)
        return run

    def cudnn(kk: torch.Tensor, vv: torch.Tensor) -> Callable[[], object]:
        def run() -> torch.Tensor:
            return torch.ops.aten._cudnn_attention_forward(q, kk, vv, None, cu, cu, n, n, False, 0.0, True, False,
                                                           scale=scale)[0]
        ref = flash_varlen(q, k, v, cu, n, scale)
        if (run().float() - ref.float()).abs().max().item() > 2e-2:
            raise ValueError("wrong")
        return run

    def fa4() -> Callable[[], object]:
        from flash_attn.cute.interface import flash_attn_varlen_func

        def run() -> torch.Tensor:
            out = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=n, max_seqlen_k=n,
                                         softmax_scale=scale, causal=True)
            return out[0] if isinstance(out, tuple) else out
        ref = flash_varlen(q, k, v, cu, n, scale)
        if (run().float() - ref.float()).abs().max().item() > 2e-2:
            raise ValueError("wrong")
        return run

    def triton_kernel(config: Config | None) -> Callable[[], object]:
        run = lambda: flash_prefill(q, k, v, cu, n, scale, config)  # noqa: E731
        if (run().float() - flash_varlen(q, k, v, cu, n, scale).float()).abs().max().item() > 2e-2:
            raise ValueError("wrong")
        return run

    return {"varlen": lambda: lambda: flash_varlen(q, k, v, cu, n, scale),
            "varlen@T": lambda: lambda: flash_varlen(q, k, v, cu, t, scale),
            "sdpa-flash": lambda: sdpa(SDPBackend.FLASH_ATTENTION),
            "sdpa-cudnn": lambda: sdpa(SDPBackend.CUDNN_ATTENTION),
            "sdpa-eff": lambda: sdpa(SDPBackend.EFFICIENT_ATTENTION),
            "cudnn-varlen": lambda: cudnn(k, v), "fa4-varlen": fa4, "triton": lambda: triton_kernel(None),
            **{"triton " + "/".join(map(str, c)): functools.partial(triton_kernel, c) for c in SWEEP}}


def main() -> None:
    print("torch", torch.__version__, "cudnn", torch.backends.cudnn.version(), torch.cuda.get_device_name())
    names = list(variants(1, 16, 1, 1, 16))
    print("| B x N | Hq/Hkv | " + " | ".join(f"{m} ms (TFLOP/s)" for m in names) + " |")
    for b, n, hq, hkv, d in CASES:
        flops = 4 * hq * d * n * n / 2 * b
        cells = []
        for make in variants(b, n, hq, hkv, d).values():
            try:
                ms = timed(make())
                cells.append(f"{ms:.3f} ({flops / ms / 1e9:.0f})")
            except Exception as e:  # a backend that does not take the case
                cells.append(f"n/a: {type(e).__name__} {str(e)[:40]}")
        print(f"| {b} x {n} | {hq}/{hkv} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
