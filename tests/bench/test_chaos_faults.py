"""`bench chaos`'s fault plan: kills and CUDA step errors each reach every node."""

from __future__ import annotations

from collections import Counter

import pytest

from bench.chaos import fault_for

VICTIMS = [("decode", 0), ("prefill", 0), ("decode", 1), ("prefill", 1)]


@pytest.mark.parametrize("every", [2, 3, 4, 8])
def test_step_errors_and_kills_each_reach_every_node(every: int) -> None:
    plan = [fault_for(turn, VICTIMS, every) for turn in range(8 * every * len(VICTIMS))]
    errors = Counter(v for kind, v in plan if kind == "error")
    kills = Counter(v for kind, v in plan if kind == "kill")
    assert set(errors) == set(VICTIMS) and len(set(errors.values())) == 1
    assert set(kills) == set(VICTIMS) and max(kills.values()) - min(kills.values()) <= 1
    assert [kind for kind, _ in plan].count("error") == len(plan) // every


def test_without_step_errors_every_fault_is_a_kill_in_turn() -> None:
    assert [fault_for(turn, VICTIMS, 0) for turn in range(5)] == [("kill", VICTIMS[t % 4]) for t in range(5)]
