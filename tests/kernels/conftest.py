"""The kernel tests' device: CUDA when there is one, else the CPU under Triton's interpreter
(TRITON_INTERPRET=1 is set for the whole session in tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(params=["cuda" if torch.cuda.is_available() else "cpu"])
def device(request) -> str:
    return request.param


@pytest.fixture(autouse=True)
def _addresses_checked():
    """Under the interpreter, every kernel's loads and stores stay inside its arguments (bounds.py)."""
    if torch.cuda.is_available():
        yield
        return
    from tests.kernels.bounds import checked_addresses

    with checked_addresses():
        yield
