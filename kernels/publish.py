"""A decode step's packed outputs written into pinned host memory by a kernel.

The step's one output copy (engine/runner/step_output.py) is a device-to-host memcpy queued after the
step's graph: the GPU goes from its compute engine to a copy engine and back at every step
boundary. `publish` does the same copy with the SMs instead: a kernel that stores the packed
words straight into the pinned (host-mapped) buffer, so the boundary is kernel to kernel. The
step's event, recorded after it, still marks when the host may read the buffer.

A small batch's step is short enough that the engine switch at its boundary shows (BENCHMARKS.md,
the step-output copy). CUDA only (off CUDA the host reads the step's buffer itself and there is
no copy).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import pdl_args, wait_for_previous

BLOCK = 1024  # words a program copies


@triton.jit(do_not_specialize=["n"])  # one compile for every step size: none inside the decode loop
def _publish_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)


def publish(src: torch.Tensor, dst: torch.Tensor) -> None:
    """dst[:] = src, by a kernel on src's device; dst may be pinned host memory (mapped into the
    device's address space). Both contiguous, of one dtype and size. Never syncs."""
    assert src.is_contiguous() and dst.is_contiguous() and src.dtype == dst.dtype and src.numel() == dst.numel()
    n = src.numel()
    if n:
        _publish_kernel[(triton.cdiv(n, BLOCK),)](src, dst, n, BLOCK=BLOCK, **pdl_args(src))
