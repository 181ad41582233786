"""Shared pieces of the fuzz tests (hypothesis): bounded settings and msgpack-shaped values.

Each fuzz test runs a few hundred cases in `make test`; `PDSERVE_FUZZ_EXAMPLES=N` runs N per
test instead (the long run: 10,000+). No example database is written (`database=None`), and
the generation is seeded per test (`derandomize`) unless PDSERVE_FUZZ_RANDOM=1, so a failure
in CI reproduces on a developer's machine.
"""

from __future__ import annotations

import os

import msgpack
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st


def long_run() -> bool:
    """True under `make fuzz` (PDSERVE_FUZZ_EXAMPLES set): tests that sample a large space of
    inputs by hand run all of it, not the representative part `make test` runs."""
    return "PDSERVE_FUZZ_EXAMPLES" in os.environ


def fuzz_settings(examples: int) -> settings:
    """`examples` cases (or $PDSERVE_FUZZ_EXAMPLES), no deadline, no database."""
    n = int(os.environ.get("PDSERVE_FUZZ_EXAMPLES", examples))
    return settings(max_examples=n, deadline=None, database=None,
                    derandomize=os.environ.get("PDSERVE_FUZZ_RANDOM") != "1",
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.function_scoped_fixture])


SCALARS = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats()
           | st.text(max_size=24) | st.binary(max_size=64))
# Anything msgpack can carry: maps, lists, and every scalar kind, nested.
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=6)
                      | st.dictionaries(st.text(max_size=8), inner, max_size=6), max_leaves=24)


def packb(obj: object) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


@st.composite
def mutated(draw: st.DrawFn, valid: dict, values: st.SearchStrategy = VALUES) -> dict:
    """`valid` with some fields dropped, some replaced by one of `values`, maybe an extra one
    added: inputs that get past the first checks and reach the field validators."""
    out = dict(valid)
    for key in draw(st.lists(st.sampled_from(sorted(valid)), max_size=3, unique=True)):
        if draw(st.booleans()):
            del out[key]
        else:
            out[key] = draw(values)
    if draw(st.integers(0, 4)) == 0:
        out[draw(st.text(max_size=6))] = draw(values)
    return out
