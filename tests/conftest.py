"""Session-wide test setup. Without a GPU the Triton kernels run under Triton's interpreter on
CPU tensors: triton.jit reads TRITON_INTERPRET when a kernel is defined, so it is set here,
before any test module imports `kernels` (directly or through the engine)."""

from __future__ import annotations

import os
from typing import Any

import pytest

# One intra-op thread per test process (and for the processes it starts, which inherit this): the
# suite runs a Ray cluster, node actors and TP rank processes beside the tests, and on a 2-core
# machine torch's second thread then waits for a core at every small op. A bf16 SmolLM2 test
# took 274 s with two threads while other processes ran, 11 s with one.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    from tests.interpreter import install as install_faster_interpreter

    install_faster_interpreter()

# Ray reads this once, at import: with it, a driver joining a test cluster at 127.0.0.1 stays on
# loopback instead of swapping in the host's outward address (tests/deploy/test_multinode.py).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

# The tests that run a Ray driver in the test process: the e2e session cluster (tests/e2e) and
# the multi-raylet cluster (tests/deploy/test_multinode.py) take turns in one process (beside each
# other, two clusters' actors would share the two cores).
RAY_DRIVER_TESTS = ("tests/e2e/", "tests/deploy/test_multinode.py")
# Work units that take minutes on 2 cores whatever their test count (xdist orders by count).
LONG_UNITS = ("ray", "tests/kernels/test_engine_path.py", "tests/engine/test_tensor_parallel.py",
              "tests/bench/test_host.py", "tests/decode_node/test_pd_nodes.py", "tests/decode_node/test_tp_nodes.py")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under pytest-xdist (`make test` runs `-n 2`): every Ray driver test in one work unit, kept
    in order and scheduled first (the largest unit; it mostly waits on actors), and one unit
    per test module otherwise (module fixtures load once), handed out as workers free up, the
    `LONG_UNITS` first."""
    if config.getvalue("dist") not in ("load", "loadscope"):
        return None
    from xdist.scheduler import LoadScopeScheduling

    class RayTestsTogether(LoadScopeScheduling):
        ordered = False

        def _split_scope(self, nodeid: str) -> str:
            return "ray" if nodeid.startswith(RAY_DRIVER_TESTS) else super()._split_scope(nodeid)

        def _assign_work_unit(self, node: Any) -> None:
            if not self.ordered:  # the long units first, so none starts last and runs alone
                for scope in reversed([s for s in LONG_UNITS if s in self.workqueue]):
                    self.workqueue.move_to_end(scope, last=False)
                self.ordered = True
            super()._assign_work_unit(node)

    return RayTestsTogether(config, log)
