"""The overlapped decode loop sizes the step it launches before it reads the step in flight:
from host integers only (`plan_launch`), next_real_bsz rows of k + 1 tokens each, where a row
the step in flight surely finishes does not run (FastDeploy's next-launch prediction)."""

from __future__ import annotations

import pytest

from engine.engine import EngineConfig, LLMEngine
from engine.sampling.sampling_params import SamplingParams
from engine.sched.decode_batch import plan_launch
from tests.engine.conftest import DEVICE


@pytest.mark.parametrize("k", range(5))
def test_next_launch_is_real_rows_times_k_plus_one(k):
    known = {
        0: (3, 10),  # in flight, far from its end: runs
        1: (9, 10),  # in flight with one token left: the step in flight ends it
        2: (1, 2),  # inserted for this launch (not in flight): runs though one token is left
        5: (8, 10),  # in flight, two left: ends there only if it accepts a draft (unknown): runs
        6: (4, 5),  # in flight, one left: ends there
    }
    plan = plan_launch(known, in_flight={0, 1, 5, 6}, k=k)
    assert plan.slots == [0, 2, 5]
    assert plan.num_tokens == 3 * (k + 1)


def test_a_batch_whose_rows_all_finish_in_flight_launches_nothing():
    plan = plan_launch({3: (6, 7), 4: (1, 2)}, in_flight={3, 4}, k=2)
    assert plan.slots == [] and plan.num_tokens == 0
    assert plan_launch({}, in_flight=set(), k=4).num_tokens == 0
    assert plan_launch({3: (6, 7)}, in_flight=set(), k=0).slots == [3]  # nothing in flight: every row runs


def _record_launches(engine: LLMEngine) -> list[tuple[list[int], dict[int, tuple[int, int]], list[bool], set[int]]]:
    """Every decode launch: (its slots, slot -> (generated, max_tokens) as the host knew them,
    each launched row's done flag on the device, the running slots it left out). The flags are
    read after the step in flight wrote them (a test-only read: on a GPU it waits for that step)."""
    launches: list = []
    real, batch = engine.runner.launch_decode, engine.batch

    def launch(slots, flags, logprobs, width, k=None):
        known = {s: (len(r.output_ids), r.max_tokens) for s, r in batch.running.items()}
        done = engine.runner.state.done[slots].tolist()
        launches.append((list(slots), known, done, set(known) - set(slots)))
        return real(slots, flags, logprobs, width, k)

    engine.runner.launch_decode = launch  # type: ignore[method-assign]
    return launches


@pytest.mark.parametrize("k", range(5))
def test_rows_that_finish_in_flight_are_not_launched_again(tiny, k):
    prompts = [list(range(5, 5 + n)) for n in (4, 9, 6, 12)]
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (3, 7, 2, 11)]
    engine = LLMEngine(tiny, EngineConfig(num_speculative_tokens=k, max_num_seqs=4, device=DEVICE))
    launches = _record_launches(engine)
    got = engine.generate(prompts, params)
    plain = LLMEngine(tiny, EngineConfig(device=DEVICE)).generate(prompts, params)
    assert [r.output_ids for r in got] == [r.output_ids for r in plain]
    held = 0
    for i, (slots, known, done, left_out) in enumerate(launches):
        previous = launches[i - 1][0] if i else []
        for s in left_out:  # left out only when the step in flight surely ends it
            assert s in previous and known[s][0] + 1 >= known[s][1]
        for s, is_done in zip(slots, done, strict=True):  # a launched row masked on the device had
            assert not is_done or (k > 0 and known[s][0] + 1 < known[s][1])  # accepted drafts to end
        held += len(left_out)
    assert held > 0  # the batch had rows to leave out (each of them emitted its last token in flight)
    assert engine.num_free_blocks == engine.blocks.capacity


def test_a_slot_reused_while_its_old_request_is_in_flight_runs_the_new_one(tiny):
    engine = LLMEngine(tiny, EngineConfig(max_num_seqs=1, device=DEVICE))
    launches = _record_launches(engine)
    a = engine.add_request([5, 6, 7], SamplingParams(max_tokens=20, ignore_eos=True))
    engine.step()
    engine.step()  # a's second step is in flight
    engine.abort(a)
    b = engine.add_request([8, 9], SamplingParams(max_tokens=2, ignore_eos=True))
    n = len(launches)
    engine.step()  # b: prefilled into a's slot, launched though that slot is in flight (for a)
    assert len(launches) == n + 1 and launches[-1][0] == [0]
    while engine.has_unfinished():
        engine.step()
    assert len(engine.requests[b].output_ids) == 2
    assert engine.num_free_blocks == engine.blocks.capacity
