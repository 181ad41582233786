"""bench/extras.py: a benchmark dependency that is missing is one clear error naming the extra."""

from __future__ import annotations

import pytest

from bench.extras import require


def test_a_missing_dependency_names_the_extra():
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'pdserve\[bench\]'"):
        require("no_such_module_for_pdserve")
    assert require("json").dumps([1]) == "[1]"
