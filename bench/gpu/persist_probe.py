"""Is a persistent decode kernel worth building? (issue 30) A chain of SmolLM2-shaped batch-1
GEMVs (per layer: q/k/v [960 x 576], o [576 x 576] + residual, gate/up [3072 x 576] with
silu * up, down [576 x 1536] + residual; 30 layers, 120 stages, 211 MB of weights: no attention
and no norms) run three ways, each captured in a CUDA graph and timed with events:

  launches   one launch a stage, under programmatic dependent launch (PDL) where it is on: today's
             structure, with the weight tile loaded into registers before the PDL wait;
  persistent one launch of one program per SM for all stages, a grid barrier (an atomic counter
             in global memory) between stages, the next stage's weight tile loaded before it;
  engine     the same chain through kernels/linear.py (`linear`, `linear_glu`), as a step runs it.

Also the barrier alone (stages with no work) and `persistent` with its weights loaded after the
barrier. Prints us per stage; results are checked against each other and a torch reference.
Usage: python bench/gpu/persist_probe.py [--layers 30] [--warps 4]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from kernels.pdl import pdl_args, wait_for_previous  # noqa: E402

H, QKV, INTER = 576, 960, 1536
BN = 8  # rows of a weight tile: 120 / 72 / 96 / 72 tiles for the four stages (at most one per program)


@triton.jit
def _grid_sync(bar_ptr, target, first, PDL: tl.constexpr):
    """The first stage of a launch waits for the kernel before it (PDL); later ones wait until
    every program has arrived `target` times in all (each program arrives once a stage)."""
    if first:
        wait_for_previous(PDL)
    else:
        tl.debug_barrier()  # this program's stores are issued before it arrives
        tl.atomic_add(bar_ptr, 1, sem="release", scope="gpu")
        seen = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
        while seen < target:
            seen = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")


@triton.jit
def _gemv(w_ptr, x_ptr, y_ptr, r_ptr, N, K, bar_ptr, target, first, PDL: tl.constexpr,
          HAS_RES: tl.constexpr, GLU: tl.constexpr, ROWS: tl.constexpr, KP: tl.constexpr, PRELOAD: tl.constexpr):
    rn = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rk = tl.arange(0, KP)
    wm = (rn[:, None] < N) & (rk[None, :] < K)
    wp = w_ptr + rn[:, None] * K + rk[None, :]
    if PRELOAD:
        w = tl.load(wp, mask=wm, other=0.0)
        u = tl.load(wp + N * K, mask=wm & GLU, other=0.0)
        _grid_sync(bar_ptr, target, first, PDL)
    else:
        _grid_sync(bar_ptr, target, first, PDL)
        w = tl.load(wp, mask=wm, other=0.0)
        u = tl.load(wp + N * K, mask=wm & GLU, other=0.0)
    x = tl.load(x_ptr + rk, mask=rk < K, other=0.0, cache_modifier=".cg").to(tl.float32)
    acc = tl.sum(w.to(tl.float32) * x[None, :], axis=1)
    out = acc.to(tl.bfloat16)
    if GLU:
        g = out.to(tl.float32)
        up = tl.sum(u.to(tl.float32) * x[None, :], axis=1).to(tl.bfloat16).to(tl.float32)
        out = ((g / (1.0 + tl.exp(-g))).to(tl.bfloat16).to(tl.float32) * up).to(tl.bfloat16)
    if HAS_RES:
        r = tl.load(r_ptr + rn, mask=rn < N, other=0.0, cache_modifier=".cg")
        out = (out.to(tl.float32) + r.to(tl.float32)).to(tl.bfloat16)
    tl.store(y_ptr + rn, out, mask=rn < N)


@triton.jit
def _chain_kernel(x_ptr, qkv_ptr, h_ptr, wqkv_ptr, wo_ptr, wgu_ptr, wd_ptr, bar_ptr, s_lo, s_hi,
                  PDL: tl.constexpr, PRELOAD: tl.constexpr, EMPTY: tl.constexpr, ROWS: tl.constexpr):
    n_prog = tl.num_programs(0)
    for s in range(s_lo, s_hi):
        first = s == s_lo
        target = (s - s_lo) * n_prog
        layer = s // 4  # offsets stay below 2**31 for 30 layers
        kind = s % 4
        if EMPTY:
            _grid_sync(bar_ptr, target, first, PDL)
        elif kind == 0:
            _gemv(wqkv_ptr + layer * 960 * 576, x_ptr, qkv_ptr, x_ptr, 960, 576, bar_ptr, target, first, PDL,
                  False, False, ROWS, 1024, PRELOAD)
        elif kind == 1:
            _gemv(wo_ptr + layer * 576 * 576, qkv_ptr, x_ptr, x_ptr, 576, 576, bar_ptr, target, first, PDL,
                  True, False, ROWS, 1024, PRELOAD)
        elif kind == 2:
            _gemv(wgu_ptr + layer * 3072 * 576, x_ptr, h_ptr, x_ptr, 1536, 576, bar_ptr, target, first, PDL,
                  False, True, 2 * ROWS, 1024, PRELOAD)
        else:
            _gemv(wd_ptr + layer * 576 * 1536, h_ptr, x_ptr, x_ptr, 576, 1536, bar_ptr, target, first, PDL,
                  True, False, ROWS, 2048, PRELOAD)


def weights(layers: int) -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(0)

    def rnd(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, device="cuda", generator=g) * 0.3 * shape[-1] ** -0.5).to(torch.bfloat16)  # finite over 30 layers

    return {"qkv": rnd(layers, QKV, H), "o": rnd(layers, H, H), "gu": rnd(layers, 2 * INTER, H),
            "d": rnd(layers, H, INTER)}


def reference(x: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
    x = x.float()
    bf = torch.bfloat16
    for i in range(w["qkv"].shape[0]):
        qkv = (w["qkv"][i].float() @ x).to(bf).float()
        x = ((w["o"][i].float() @ qkv[:H]).to(bf).float() + x).to(bf).float()
        gu = (w["gu"][i].float() @ x).to(bf).float()
        act = (torch.nn.functional.silu(gu[:INTER]).to(bf).float() * gu[INTER:]).to(bf).float()
        x = ((w["d"][i].float() @ act).to(bf).float() + x).to(bf).float()
    return x.to(bf)


class Chain:
    def __init__(self, w: dict[str, torch.Tensor], warps: int) -> None:
        self.w, self.warps = w, warps
        self.layers = w["qkv"].shape[0]
        self.x = torch.empty(H, dtype=torch.bfloat16, device="cuda")
        self.qkv = torch.empty(QKV, dtype=torch.bfloat16, device="cuda")
        self.h = torch.empty(INTER, dtype=torch.bfloat16, device="cuda")
        self.bar = torch.zeros(1, dtype=torch.int32, device="cuda")
        self.sms = torch.cuda.get_device_properties(0).multi_processor_count

    def _launch(self, s_lo: int, s_hi: int, preload: bool = True, empty: bool = False) -> None:
        pdl = pdl_args(self.x)
        _chain_kernel[(self.sms,)](self.x, self.qkv, self.h, self.w["qkv"], self.w["o"], self.w["gu"], self.w["d"],
                                   self.bar, s_lo, s_hi, PRELOAD=preload, EMPTY=empty, ROWS=BN,
                                   num_warps=self.warps, **pdl)

    def launches(self) -> None:
        for s in range(4 * self.layers):
            self._launch(s, s + 1)

    def persistent(self, preload: bool = True, empty: bool = False) -> None:
        self.bar.zero_()
        self._launch(0, 4 * self.layers, preload, empty)

    def engine(self) -> None:
        from kernels.linear import linear, linear_glu

        x = self.x.view(1, H)
        for i in range(self.layers):
            qkv = linear(x, self.w["qkv"][i])
            x = linear(qkv[:, :H], self.w["o"][i], residual=x)
            x = linear(linear_glu(x, self.w["gu"][i]), self.w["d"][i], residual=x)
        self.x.view(1, H).copy_(x)


def timed(fn, reps: int = 50) -> float:
    """us per call of fn, replayed as a CUDA graph."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(5):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / reps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--warps", type=int, default=4)
    args = ap.parse_args()
    w = weights(args.layers)
    chain = Chain(w, args.warps)
    x0 = (torch.randn(H, device="cuda")).to(torch.bfloat16)
    outs = {}
    for name, fn in (("launches", chain.launches), ("persistent", chain.persistent),
                     ("persistent, weights after the barrier", lambda: chain.persistent(preload=False)),
                     ("engine", chain.engine)):
        chain.x.copy_(x0)
        fn()
        torch.cuda.synchronize()
        outs[name] = chain.x.clone()
    ref = reference(x0, w)
    for name, out in outs.items():
        err = (out.float() - ref.float()).abs().max().item()
        same = torch.equal(out, outs["launches"])
        print(f"check {name}: max |x - torch| {err:.3g}, equal to launches: {same}")
    stages = 4 * args.layers
    rows = [("launches (PDL)" if pdl_args(chain.x)["PDL"] else "launches", timed(chain.launches)),
            ("persistent", timed(chain.persistent)),
            ("persistent, weights after the barrier", timed(lambda: chain.persistent(preload=False))),
            ("barrier alone", timed(lambda: chain.persistent(empty=True))),
            ("engine (kernels/linear.py)", timed(chain.engine))]
    print(f"{stages} stages, {chain.sms} programs, {args.warps} warps")
    for name, us in rows:
        print(f"{name:40s} {us:9.1f} us  {us / stages:6.2f} us/stage")


if __name__ == "__main__":
    main()
