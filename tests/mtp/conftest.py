"""The engine tests' models: `tiny` and, where installed, `smollm2` (fp32, on DEVICE)."""

from tests.engine.conftest import smollm2, tiny  # noqa: F401
