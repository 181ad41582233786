"""The register-tile GEMV (kernels/gemv.py) against the split-K kernel (kernels/linear.py) at
M = 1 and 4 rows: a batch-1 step's decode GEMMs and a batch-1 verify's (k = 3 drafts). Today the
GEMV takes M = 1 over small weights and the split-K kernel the rest (kernels.gemv.GEMV_MAX_M).

SmolLM2's and Llama-3.2-1B's decode GEMMs as a step runs them: q/k/v with the folded input norm,
o and down with the residual add (and the sums of squares for the next norm), gate/up with
silu * up and the folded norm. Each case is a chain of launches over enough weight copies to miss
L2, captured in a CUDA graph, with programmatic dependent launch as the step has it (on Hopper),
timed with events: us per launch. The GEMV runs only where its tile fits (GEMV_MAX_TILE; the
weight-size limit is lifted, so Llama-1B's o takes it): "-" elsewhere; "*" marks what a step
runs today.

Each output is checked against the fp32 torch composition (max abs error), and row 0 of each
kernel's M = 4 launch against its own M = 1 launch (`row 0 =M1`): bit for bit, as an exact verify
needs.

    python bench/gpu/gpu_gemv_rows.py [--cpu-check | --sm90] [--shapes smol|llama]

`--cpu-check`: tiny shapes under Triton's interpreter on the CPU, in fp32 (the interpreter's
`tl.dot` over bf16, the split-K kernel's, gives wrong sums), errors and bits only (no times).
`--sm90`: no GPU needed: the GEMV at SmolLM2's shapes compiled here for sm_90a (this Triton's
ptxas and nvdisasm), with its static counts: registers, spilled bytes, shared memory, and a warp's
SASS instructions (all, shuffles, barriers, fp32 adds and multiplies), with an SM's share of them.

The engine with a batch-1 verify through the GEMV, for a `bench engine` comparison:

    python3 -c "import sys, kernels.gemv as g; g.GEMV_MAX_M = 4; \
      from deploy.cli import main; sys.exit(main(sys.argv[1:]))" bench engine --device cuda \
      --arch smollm2 --batch 1 --max-model-len 4096 --spec-tokens 3 --max-tokens 96
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

import kernels.gemv as G  # noqa: E402
from kernels import linear as L  # noqa: E402
from kernels._dispatch import triton_on_cpu  # noqa: E402
from kernels.norm import attach_row_sumsq  # noqa: E402

EPS = 1e-5
SHAPES = {  # name: (K, N, op); gate_up's N is the gate's (the weight has 2N rows)
    "smol qkv": (576, 960, "norm"), "smol o": (576, 576, "res"), "smol gate_up": (576, 1536, "glu"),
    "smol down": (1536, 576, "res"),
    "llama qkv": (2048, 3072, "norm"), "llama o": (2048, 2048, "res"), "llama gate_up": (2048, 8192, "glu"),
    "llama down": (8192, 2048, "res"),
}
TINY = {"tiny qkv": (64, 96, "norm"), "tiny o": (64, 64, "res"), "tiny gate_up": (64, 80, "glu"),
        "tiny down": (80, 64, "res")}
DEFAULTS = {name: getattr(G, name) for name in ("GEMV_MAX_M", "GEMV_MAX_BYTES")}
KERNELS = {"today": None, "GEMV": (4, 2**40), "split-K": (0, 0)}  # (GEMV_MAX_M, GEMV_MAX_BYTES)


def settings(kernel: str) -> None:
    """kernels.gemv as today, or the GEMV taking every launch of up to 4 rows whose tile fits, or none."""
    for name, value in DEFAULTS.items():
        setattr(G, name, value)
    if KERNELS[kernel] is not None:
        G.GEMV_MAX_M, G.GEMV_MAX_BYTES = KERNELS[kernel]


class Case:
    """One GEMM of a step: its weight copies, its 4-row inputs and the launch at M rows."""

    def __init__(self, k: int, n: int, op: str, device: str, dtype: torch.dtype, copies: int):
        self.op, rows = op, 2 * n if op == "glu" else n
        g = torch.Generator().manual_seed(0)
        self.ws = [(torch.randn(rows, k, generator=g) * k**-0.5).to(device, dtype) for _ in range(copies)]
        self.x = torch.randn(4, k, generator=g).to(device, dtype)
        self.partials = self.x.float().pow(2).sum(dim=1, keepdim=True)
        self.r = torch.randn(4, n, generator=g).to(device, dtype)

    def inputs(self, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        """x's first m rows, carrying their sums of squares (row 0's the same at every m), and r's."""
        x = self.x[:m].clone()
        attach_row_sumsq(x, self.partials[:m].clone())
        return x, self.r[:m].clone()

    def run(self, w: torch.Tensor, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        if self.op == "glu":
            return L.linear_glu_triton(x, w, (None, EPS))
        if self.op == "norm":
            return L.linear_triton(x, w, norm=(None, EPS))
        return L.linear_triton(x, w, residual=r)

    def reference(self, m: int) -> torch.Tensor:
        x, r, w = self.x[:m].float(), self.r[:m].float(), self.ws[0].float()
        if self.op == "glu":
            return L.linear_glu_ref(x, w, (None, EPS))
        if self.op == "norm":
            return L.linear_ref(x, w, norm=(None, EPS))
        return L.linear_ref(x, w, residual=r)

    def takes_gemv(self, m: int) -> bool:
        return G.gemv_config(m, self.ws[0], self.op == "glu") is not None


def measure(case: Case, m: int, timer) -> dict:
    """One launch's output, its error against the reference, and us per launch (timer given)."""
    x, r = case.inputs(m)
    y = case.run(case.ws[0], x, r)
    err = (y.float() - case.reference(m)).abs().max().item()
    us = timer(lambda: [case.run(w, x, r) for w in case.ws], len(case.ws)) if timer else math.nan
    return {"y": y, "err": err, "us": us}


def shape_rows(name: str, spec: tuple[int, int, str], device: str, timer) -> list[dict]:
    k, n, op = spec
    size = (2 if op == "glu" else 1) * n * k * 2
    copies = max(2, -(-(160 << 20) // size)) if timer else 1
    case = Case(k, n, op, device, torch.bfloat16 if device == "cuda" else torch.float32, copies)
    settings("today")
    today = {1: case.takes_gemv(1), 4: case.takes_gemv(4)}
    rows = []
    for kernel in ("GEMV", "split-K"):
        settings(kernel)
        if kernel == "GEMV" and not case.takes_gemv(4):
            rows.append({"shape": name, "kernel": kernel, "M": 4, "us": math.nan, "err": math.nan})
            continue
        one, four = measure(case, 1, timer), measure(case, 4, timer)
        is_gemv = kernel == "GEMV"
        rows += [{"shape": name, "kernel": kernel, "M": 1, "today": today[1] == is_gemv, **one},
                 {"shape": name, "kernel": kernel, "M": 4, "today": today[4] == is_gemv, **four,
                  "=M1": torch.equal(four["y"][:1], one["y"])}]
    settings("today")
    for row in rows:
        print({key: val for key, val in row.items() if key != "y"}, flush=True)
    return rows


def print_table(rows: list[dict]) -> None:
    def bits(v) -> str:
        return "-" if v is None else "yes" if v else "NO"

    print(f"\n{'shape':14} | {'kernel':9} | M | us/launch | max abs err | row 0 =M1")
    for r in rows:
        us = "-" if math.isnan(r["us"]) else f"{r['us']:.2f}"
        err = "-" if math.isnan(r["err"]) else f"{r['err']:.2e}"
        kernel = r["kernel"] + ("*" if r.get("today") else "")
        print(f"{r['shape']:14} | {kernel:9} | {r['M']} | {us:>9} | {err:>11} | {bits(r.get('=M1')):>9}")


def sm90_counts(name: str, spec: tuple[int, int, str], m: int) -> dict:
    """The GEMV at m rows over the shape, compiled for sm_90a as launch_gemv would launch it
    (16-byte aligned pointers, strides and sizes divisible by 16 as the JIT sees them); static counts
    from ptxas and the SASS (nvdisasm) a warp runs."""
    import collections
    import re
    import subprocess
    import tempfile

    import triton
    import triton.backends.nvidia as nv
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    k, n, op = spec
    settings("GEMV")
    w = torch.empty((2 if op == "glu" else 1) * n, k, dtype=torch.bfloat16, device="meta")
    bn, kp, warps = G.gemv_config(m, w, op == "glu", 132) or (0, 0, 0)
    settings("today")
    s1, s2, c = G.slots(k, 2)
    names = G._gemv_kernel.arg_names[:16]
    sig = dict(zip(names, ["*bf16"] * 5 + ["*fp32"] * 2 + ["i32"] * 7 + ["fp32", "i32"], strict=True))
    consts = dict(HAS_BIAS=False, HAS_RES=op == "res", GLU=op == "glu", NORM=op != "res", NTP=1, SS_OUT=op == "res",
                  MP=triton.next_power_of_2(m), BN=bn, S1=s1, S2=s2, C=c, PDL=True)
    sig.update(dict.fromkeys(consts, "constexpr"))
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(names) if a.endswith("_ptr") or a[0] in "sNK"}
    kern = triton.compile(ASTSource(G._gemv_kernel, sig, constexprs=consts, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=1, launch_pdl=True))
    bin_dir = os.path.join(os.path.dirname(nv.__file__), "bin")
    with tempfile.TemporaryDirectory() as tmp:
        ptx, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        with open(ptx, "w") as f:
            f.write(kern.asm["ptx"])
        with open(cubin, "wb") as f:
            f.write(kern.asm["cubin"])
        info = subprocess.run([os.path.join(bin_dir, "ptxas-blackwell"), "-arch=sm_90a", "-v", ptx, "-o", os.devnull],
                              capture_output=True, text=True).stderr
        sass = subprocess.run([os.path.join(bin_dir, "nvdisasm"), "-c", cubin], capture_output=True, text=True).stdout
    ops = collections.Counter(found.group(1) for found in re.finditer(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", sass))

    def num(pattern: str) -> int:
        found = re.search(pattern, info)
        return int(found.group(1)) if found else -1
    programs = -(-n // bn)
    return {"shape": name, "M": m, "BN": bn, "warps": warps, "programs": programs, "regs": num(r"Used (\d+) registers"),
            "spill": num(r"(\d+) bytes spill stores"), "smem": kern.metadata.shared, "sass": sum(ops.values()),
            "SHFL": ops["SHFL"], "BAR": ops["BAR"], "fp32": ops["FFMA"] + ops["FMUL"] + ops["FADD"],
            "SM_instr": round(sum(ops.values()) * warps * programs / 132)}


def print_sm90(rows: list[dict]) -> None:
    """SM_instr: warp instructions an SM issues, at the shape's programs spread over 132 SMs."""
    keys = ["BN", "warps", "programs", "regs", "spill", "smem", "sass", "SHFL", "BAR", "fp32", "SM_instr"]
    print(f"\n{'shape':14} | M | " + " | ".join(f"{k:>5}" for k in keys))
    for r in rows:
        print(f"{r['shape']:14} | {r['M']} | " + " | ".join(f"{r[k]:>5}" for k in keys))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu-check", action="store_true")
    p.add_argument("--sm90", action="store_true")
    p.add_argument("--shapes", default="", help="only the shapes whose names start so (smol, llama)")
    args = p.parse_args()
    rows = []
    if args.sm90:
        print_sm90([sm90_counts(name, SHAPES[name], m) for name in SHAPES if name.startswith("smol") for m in (1, 4)])
        return 0
    if args.cpu_check:
        with triton_on_cpu():
            for name, spec in TINY.items():
                rows += shape_rows(name, spec, "cpu", None)
    else:
        from bench.gpu.gpu_gemv import graph_us

        print(torch.cuda.get_device_name(), "PDL:", L.pdl_args(torch.empty(1, device="cuda"))["PDL"])
        for name, spec in SHAPES.items():
            if name.startswith(args.shapes):
                rows += shape_rows(name, spec, "cuda", graph_us)
    print_table(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
