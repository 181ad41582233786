"""Programmatic dependent launch (PDL): the next kernel of a decode step starts before this one ends.

A decode step is one CUDA graph of a few hundred short, dependent kernels; between two of
them the GPU idles for the launch latency (~0.5 us on an H100, 288 kernels a SmolLM2 step).
With PDL (Hopper and later) a kernel launched with `launch_pdl=True` may start as soon as
every program of the kernel before it has called `gdc_launch_dependents`, and waits in
`gdc_wait` until that kernel has finished and its writes are visible.

Every kernel in kernels/ therefore opens with `wait_for_previous(PDL)`, before any load or
store: with it, a kernel never reads or writes anything before the previous one is done, so
the results are the same with PDL on or off. Careful: a kernel launched with `launch_pdl`
that reads memory before `wait_for_previous` races the kernel before it.

Off on the CPU (the interpreter), before Hopper, or when this Triton has no `launch_pdl`.

Memory no kernel of the step writes (the weights) may be read before the wait. One more case:
decode attention with rotary inside (kernels/paged_attention.py, `PRELOAD_KV_MAX_ROWS`) reads its row's
metadata (with the positions' rotary rows and the step's cache slots) and the keys older than the
step, of its first and last key tiles, before its wait. Those were written before the kernel
ahead of it started, and that kernel has itself waited for the one before it, so nothing still
running writes them. The masked argmax of the LM head (kernels/linear.py, `MASK`) reads its rows'
state rows before its wait on the same ground (the step's rows, copied in before its first kernel),
but the grammar bitmask only after it: an eager constrained step may scatter its masks into the
bitmask with a torch kernel right before the head, and a kernel that never signals its dependents
gives them no view of its writes before their wait (the graphed step's head opens its graph, after
the masks' copy: there nothing runs before it to overlap with). `prefetch_l2`
asks for such lines in L2 while the kernel before still runs: a decode GEMM launched early under
PDL starts its weight reads there instead of after the previous kernel ends (kernels/linear.py).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a Triton without grid dependency control: PDL stays off
    gdc_wait = gdc_launch_dependents = None


@triton.jit
def wait_for_previous(PDL: tl.constexpr):
    """Wait for the previous kernel (PDL on), then let the next one be scheduled."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@functools.cache
def _supported(device_index: int) -> bool:
    if gdc_wait is None or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    has_option = "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})
    return has_option and torch.cuda.get_device_capability(device_index) >= (9, 0)


@triton.jit
def prefetch_l2(ptrs):
    """Ask for the cache lines holding `ptrs` (a tensor of pointers, one per line wanted) in L2;
    no value comes back. Only for memory nothing in flight writes (see the module's text)."""
    addr = ptrs.to(tl.int64, bitcast=True)
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];", "=r,l", [addr], dtype=tl.int32, is_pure=False, pack=1)


def pdl_args(t: torch.Tensor) -> dict[str, bool]:
    """The launch arguments for a kernel working on t: `PDL` (its constexpr) and `launch_pdl`."""
    if not t.is_cuda:
        return {"PDL": False, "launch_pdl": False}
    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    on = _supported(index)
    return {"PDL": on, "launch_pdl": on}

