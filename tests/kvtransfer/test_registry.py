"""kvtransfer/registry.py: a UCX backend without its wheel (built per CUDA major version, so the
runtime install names none) is one clear error naming the extras to install."""

from __future__ import annotations

import importlib

import pytest

from kvtransfer import registry


def test_ucx_without_ucxx_names_the_extras(monkeypatch):
    real = importlib.import_module

    def without_ucxx(name: str, *args, **kwargs):
        if name == "kvtransfer.ucx":
            raise ModuleNotFoundError("No module named 'ucxx'", name="ucxx")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(registry.importlib, "import_module", without_ucxx)
    with pytest.raises(ModuleNotFoundError, match=r"pdserve\[ucx-cu12\]' or 'pdserve\[ucx-cu13\]'"):
        registry.create_sender("ucx")
    assert registry.create_receiver("local") is not None  # other backends are untouched
