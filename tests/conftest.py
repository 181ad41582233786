"""Session-wide test setup. Without a GPU the Triton kernels run under Triton's interpreter on
CPU tensors: triton.jit reads TRITON_INTERPRET when a kernel is defined, so it is set here,
before any test module imports `kernels` (directly or through the engine)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Ray reads this once, at import: with it, a driver joining a test cluster at 127.0.0.1 stays on
# loopback instead of swapping in the host's outward address (tests/deploy/test_multinode.py).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
