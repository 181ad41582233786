"""The settings module: docs/settings.md is its table, every setting parses and rejects what it
should, and product code reads no PDSERVE_ variable the module does not define."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import settings

ROOT = Path(__file__).resolve().parent.parent.parent


def test_docs_page_is_the_modules_table():
    page = (ROOT / "docs" / "settings.md").read_text(encoding="utf-8")
    assert page == settings.table(), "docs/settings.md is stale: run `python -m settings > docs/settings.md`"


def test_defaults_parse_and_bad_values_are_errors():
    for s in settings.REGISTRY.values():
        assert s.doc and "\n" not in s.doc
        s.read({})  # every default parses
    read = {name: s.read for name, s in settings.REGISTRY.items()}
    assert read["PDSERVE_SHORT_KV_BLOCKS"]({"PDSERVE_SHORT_KV_BLOCKS": "16,0,48"}) == (16, 48)
    assert read["PDSERVE_SHORT_KV_BLOCKS"]({"PDSERVE_SHORT_KV_BLOCKS": "0"}) == ()
    assert read["PDSERVE_UCX_SPIN"]({"PDSERVE_UCX_SPIN": "0"}) is False
    assert read["PDSERVE_API_KEY"]({}) is None
    with pytest.raises(ValueError, match="at least 1"):
        read["PDSERVE_UCX_LANES"]({"PDSERVE_UCX_LANES": "0"})
    with pytest.raises(ValueError, match="0 or 1"):
        read["PDSERVE_STEP_STAMPS"]({"PDSERVE_STEP_STAMPS": "yes"})



def test_product_code_reads_only_defined_settings():
    """Outside tests/, every PDSERVE_ name in Python source is a setting of the module."""
    found: set[str] = set()
    tops = [p for p in ROOT.iterdir() if p.name not in ("tests", "build") and not p.name.startswith(".")]
    for path in [p for p in tops if p.suffix == ".py"] + [f for p in tops if p.is_dir() for f in p.rglob("*.py")]:
        found |= set(re.findall(r"PDSERVE_[A-Z0-9_]+", path.read_text(encoding="utf-8")))
    assert found <= set(settings.REGISTRY), sorted(found - set(settings.REGISTRY))
    assert len(settings.REGISTRY) <= 12
