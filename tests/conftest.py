"""Session-wide test setup. Without a GPU the Triton kernels run under Triton's interpreter on
CPU tensors: triton.jit reads TRITON_INTERPRET when a kernel is defined, so it is set here,
before any test module imports `kernels` (directly or through the engine)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
