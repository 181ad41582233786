"""The decode GEMM's argmax launches compiled for an H100/H200 (sm_90a) here, with no GPU: what the
grammar mask (`MASK`) adds to the machine code of kernels/linear.py's `_skinny_kernel`.

For each tile (BM, BN, BK, stages) the launch takes, plain and masked: registers a thread, instructions,
warp shuffles, barriers and shared memory, read from the cubin with the `cuobjdump` that Triton's
package carries, and the layout the tile's argmax reduces in (`mma`: the GEMM's own registers;
else the tile went through shared memory first). bf16, PDL on, pointers and strides aligned as a
real launch specializes them. Compiles with the installed Triton; the GPU machines run another
version, so put that one first on PYTHONPATH to see their code. Usage (from the repository root):
PYTHONPATH=. python bench/cpu/skinny_sass.py
"""

from __future__ import annotations

import os
import re
import subprocess

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.compiler import compile as triton_compile

from kernels.linear import _skinny_kernel

# (BM, BN, BK, stages) of SmolLM2's LM head at batch 32, k = 0 and k = 3 (128 rows), batch 8, and of
# a small vocabulary's and a mid-sized weight's tiles (kernels/linear.py tile_config)
TILES = [(32, 64, 128, 3), (64, 64, 128, 3), (16, 64, 128, 3), (32, 16, 256, 3), (32, 32, 128, 6)]
POINTERS = {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "r_ptr": "*bf16", "y_ptr": "*bf16",
            "ws_ptr": "*bf16", "val_ptr": "*fp32", "idx_ptr": "*i32", "ssi_ptr": "*bf16", "sso_ptr": "*bf16",
            "rows_ptr": "*i64", "bits_ptr": "*i32"}
ALIGNED = ["N", "K", "stride_x", "stride_w", "k_per_split", "stride_bs", "stride_bi"]  # multiples of 16


def compile_argmax(mask: bool, bm: int, bn: int, bk: int, stages: int):
    names = _skinny_kernel.arg_names
    consts = dict(HAS_BIAS=False, HAS_RES=False, ARGMAX=True, MASK=mask, SPLIT=1, PRECISION="tf32", GLU=False,
                  NORM=False, NTP=1, SS_OUT=False, BM=bm, BN=bn, BK=bk, PDL=True, PREFETCH=False, LINES=1,
                  PER_LINE=64, PRELOAD=False)
    sig = {n: POINTERS.get(n, "constexpr" if n in consts else "fp32" if n == "eps" else "i32") for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in [*POINTERS, *ALIGNED]}
    src = ASTSource(fn=_skinny_kernel, signature=sig, constexprs=consts, attrs=attrs)
    return triton_compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": 4, "num_stages": stages, "launch_pdl": True})


def describe(kernel) -> dict:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    path = f"/tmp/skinny_sass_{os.getpid()}.cubin"
    with open(path, "wb") as f:
        f.write(kernel.asm["cubin"])
    try:
        usage = subprocess.run([tool, "--dump-resource-usage", path], capture_output=True, text=True).stdout
        sass = subprocess.run([tool, "-sass", path], capture_output=True, text=True).stdout
    finally:
        os.remove(path)
    ops = re.findall(r"^\s+/\*[0-9a-f]{4,}\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass, flags=re.M)
    reduced = re.search(r'"tt.reduce".*?\}\) : \(tensor<\d+x\d+xf32, #(\w+)>', kernel.asm["ttgir"], flags=re.S)
    regs = re.search(r"REG:(\d+)", usage)
    return {"regs": int(regs.group(1)) if regs else None, "instructions": len(ops),
            "shuffles": sum(op.startswith("SHFL") for _, op in ops), "barriers": sum(op.startswith("BAR") for _, op in ops),
            "shared_kb": kernel.metadata.shared // 1024, "argmax_layout": reduced.group(1) if reduced else None}


def main() -> None:
    print(f"triton {triton.__version__}, sm_90a, 4 warps, bf16")
    print("BM  BN  BK stages mask  regs instructions shuffles barriers shared_kb argmax_layout")
    for bm, bn, bk, stages in TILES:
        for mask in (False, True):
            d = describe(compile_argmax(mask, bm, bn, bk, stages))
            print(f"{bm:>2} {bn:>3} {bk:>3} {stages:>6} {mask!s:>5} {d['regs']:>5} {d['instructions']:>12} "
                  f"{d['shuffles']:>8} {d['barriers']:>8} {d['shared_kb']:>9} {d['argmax_layout']}")


if __name__ == "__main__":
    main()
