"""Decode attention (kernels/paged_attention.py, rotary and the K/V write inside) at 1 and 4 queries
a row: a batch-1 plain step's launch and a batch-1 verify's (k = 3 drafts), at SmolLM2's shape (9
query heads, 3 kv heads, head_dim 64, 16-token blocks, bf16), at contexts given as the keys before
the step, each with the block-table width and split count a server's graph takes there
(max_model_len 4096: `decode_splits` over the narrowest graph width that holds the context).

Each query i of the 4-query launch is checked bit for bit against the 1-query launch that a plain
step at its position would run (the cache holding the verify's earlier keys, the same splits), as
greedy MTP needs (`=1q`), and the 4-query output against the torch reference (`err`). On a GPU, us
per call (the attention launch and, with splits, the combine launch) from a CUDA graph of 20 calls,
each over its own layer's cache as a step's layers are, timed with events.

    python bench/gpu/gpu_attn_rows.py [--cpu-check] [--contexts 100,200,500,...]

`--cpu-check`: under Triton's interpreter on the CPU, bits and errors only (no times). The kernel's
way of walking its tiles is PDSERVE_ATTN_VARIANT's (TEMPORARY, kernels/paged_attention.py).
"""

from __future__ import annotations

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
if "--cpu-check" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

import kernels.paged_attention as pa  # noqa: E402
from engine.runner.model_runner import decode_splits, kv_room_needed  # noqa: E402
from kernels._dispatch import triton_on_cpu  # noqa: E402
from kernels.rotary import rope_and_cache  # noqa: E402

HQ, HKV, D, BLOCK, K = 9, 3, 64, 16, 3
WIDTHS = (16, 32, 64, 128, 192, 257)  # a batch-1 server's graph widths at max_model_len 4096
LAYERS = 20  # launches a timed graph holds, each over its own cache


class Case:
    """ctx keys in the cache before the step; the step's 4 queries at positions ctx .. ctx + 3."""

    def __init__(self, ctx: int, device: str, layers: int):
        need = -(-kv_room_needed(ctx, K) // BLOCK)
        self.ctx, self.width = ctx, next((w for w in WIDTHS if w >= need), WIDTHS[-1])
        self.splits = decode_splits(1, HKV, self.width)
        g = torch.Generator().manual_seed(ctx)
        self.cache = torch.randn(2, 1 + layers * self.width, BLOCK, HKV, D, generator=g).to(device, torch.bfloat16)
        self.tables = [(1 + layer * self.width + torch.arange(self.width)).view(1, -1).to(device) for layer in range(layers)]
        self.qkv = torch.randn(K + 1, (HQ + 2 * HKV) * D, generator=g).to(device, torch.bfloat16)
        ang = torch.arange(4200).float()[:, None] * torch.rand(D // 2, generator=g)[None, :] * 0.01
        self.cos, self.sin = torch.cat([ang.cos()] * 2, -1).to(device), torch.cat([ang.sin()] * 2, -1).to(device)
        self.device = device

    def args(self, first: int, q_len: int, layer: int, cache: torch.Tensor) -> tuple:
        """paged_attention_rope's arguments for queries first .. first + q_len - 1 of the step."""
        rows = slice(first, first + q_len)
        q = self.qkv[rows, : HQ * D].view(q_len, HQ, D)
        k = self.qkv[rows, HQ * D : (HQ + HKV) * D].view(q_len, HKV, D)
        v = self.qkv[rows, (HQ + HKV) * D :].view(q_len, HKV, D)
        pos = torch.arange(self.ctx + first, self.ctx + first + q_len, device=self.device)
        table = self.tables[layer]
        slots = table[0, pos // BLOCK] * BLOCK + pos % BLOCK
        seq_lens = torch.tensor([self.ctx + first + q_len], device=self.device)
        starts = torch.tensor([0, q_len], device=self.device)
        new = pa.NewKV(k, v, pos, self.cos, self.sin, slots)
        return q, new, cache, table, seq_lens, starts, q_len, D**-0.5, self.splits

    def reference(self) -> torch.Tensor:
        """The 4 queries through the two-launch path's torch references (fp32 attention)."""
        cache = self.cache.clone()
        q, new, _, table, seq_lens, starts, q_len, scale, _ = self.args(0, K + 1, 0, cache)
        q_rot = rope_and_cache(q, new.k, new.v, new.positions, new.cos, new.sin, cache, new.slot_mapping)
        return pa.paged_attention_ref(q_rot, cache, table, seq_lens, starts, q_len, scale)


def check(case: Case) -> dict:
    """The verify's 4 outputs against the reference, and query i against its plain step's launch."""
    cache = case.cache.clone()
    four = pa.paged_attention_rope(*case.args(0, K + 1, 0, cache))
    err = (four.float() - case.reference().float()).abs().max().item()
    same = [torch.equal(four[i : i + 1], pa.paged_attention_rope(*case.args(i, 1, 0, cache.clone())))
            for i in range(K + 1)]
    return {"err": err, "=1q": "".join("y" if s else "N" for s in same)}


def graph_us(case: Case, q_len: int) -> float:
    """us per call: a CUDA graph of LAYERS calls (each layer's cache), timed as bench/gpu/gpu_gemv.py
    times its launches."""
    from bench.gpu.gpu_gemv import graph_us as per_copy_us

    caches = case.cache.clone()
    calls = [case.args(0, q_len, layer, caches) for layer in range(LAYERS)]

    def run() -> None:
        for a in calls:
            pa.paged_attention_rope(*a)

    return per_copy_us(run, LAYERS)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu-check", action="store_true")
    p.add_argument("--contexts", default=None, help="keys before the step (default: CPU 100,126,200,300,383,700; "
                   "GPU 100,200,500,1000,2000,4000)")
    args = p.parse_args()
    cpu = args.cpu_check
    default = "100,126,200,300,383,700" if cpu else "100,200,500,1000,2000,4000"
    contexts = [int(c) for c in (args.contexts or default).split(",")]
    print("variant", pa.ATTN_VARIANT, "device", "cpu (interpreter)" if cpu else torch.cuda.get_device_name())
    rows = []
    with torch.no_grad(), triton_on_cpu():
        for ctx in contexts:
            case = Case(ctx, "cpu" if cpu else "cuda", 1 if cpu else LAYERS)
            row = {"ctx": ctx, "width": case.width, "splits": case.splits, **check(case)}
            row["us1"] = math.nan if cpu else graph_us(case, 1)
            row["us4"] = math.nan if cpu else graph_us(case, K + 1)
            print(row, flush=True)
            rows.append(row)
    print(f"\n{'ctx':>5} | width | splits | us 1q | us 4q | 4q/1q | max abs err | =1q (query 0..3)")
    for r in rows:
        us1, us4 = ("-", "-") if cpu else (f"{r['us1']:.2f}", f"{r['us4']:.2f}")
        ratio = "-" if cpu else f"{r['us4'] / r['us1']:.2f}"
        print(f"{r['ctx']:>5} | {r['width']:>5} | {r['splits']:>6} | {us1:>5} | {us4:>5} | {ratio:>5} | "
              f"{r['err']:11.2e} | {r['=1q']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
