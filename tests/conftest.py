"""Session-wide test setup. Without a GPU the Triton kernels run under Triton's interpreter on
CPU tensors: triton.jit reads TRITON_INTERPRET when a kernel is defined, so it is set here,
before any test module imports `kernels` (directly or through the engine)."""

from __future__ import annotations

import os

# One intra-op thread per test process (and for the processes it starts, which inherit this): the
# suite runs a Ray cluster, node actors and TP rank processes beside the tests, and on a 2-core
# machine torch's second thread then waits for a core at every small op. A bf16 SmolLM2 test
# took 274 s with two threads while other processes ran, 11 s with one.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Ray reads this once, at import: with it, a driver joining a test cluster at 127.0.0.1 stays on
# loopback instead of swapping in the host's outward address (tests/deploy/test_multinode.py).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
