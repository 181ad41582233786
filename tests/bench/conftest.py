"""`async def` tests run as tests/router's do (test_serve.py loads a router with fake nodes)."""

from tests.router.conftest import pytest_pyfunc_call  # noqa: F401
