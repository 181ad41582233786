"""Step stamps (kernels/stamps.py): the busy arithmetic and the ring's order on the CPU; the clock
kernel itself, eager and replayed in a CUDA graph, on a GPU only (inline PTX: no interpreter)."""

from __future__ import annotations

import pytest
import torch

import settings
from kernels.stamps import StepStamps, stamped_busy, stamps_on

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="reads the GPU's clock: needs CUDA")


def test_busy_is_the_steps_spans_over_the_whole_loop_and_gaps_are_idle():
    # three steps of 3 us, idle 2 us then 0.5 us between them (ns)
    spans = [(1_000, 4_000), (6_000, 9_000), (9_500, 12_500)]
    out = stamped_busy(spans)
    assert out["gpu_busy_stamped"] == round(9_000 / 11_500, 4) == 0.7826
    assert out["stamped_step_us"] == 3.0
    assert out["stamped_gap_us"] == 1.25


def test_busy_of_too_few_steps():
    assert stamped_busy([]) == {"gpu_busy_stamped": None, "stamped_step_us": None, "stamped_gap_us": None}
    assert stamped_busy([(10, 2_010)]) == {"gpu_busy_stamped": 1.0, "stamped_step_us": 2.0, "stamped_gap_us": None}


def test_read_returns_the_last_steps_oldest_first_once_the_ring_wraps():
    stamps = StepStamps(torch.device("cpu"), steps=4)
    for i in range(6):  # what six steps' stamps leave: step i in slot i % 4
        stamps.buf[2 * (i % 4)], stamps.buf[2 * (i % 4) + 1] = 100 * i, 100 * i + 50
    stamps.count.fill_(6)
    assert stamps.read() == [(200, 250), (300, 350), (400, 450), (500, 550)]
    stamps.reset()
    assert stamps.read() == []


def test_stamps_are_off_by_default_and_on_the_cpu(monkeypatch):
    monkeypatch.setattr(settings, "STEP_STAMPS", settings.REGISTRY["PDSERVE_STEP_STAMPS"].read({}))
    assert not stamps_on(torch.device("cuda"))
    monkeypatch.setattr(settings, "STEP_STAMPS", True)
    assert not stamps_on(torch.device("cpu"))


@needs_cuda
def test_stamps_increase_eagerly():
    stamps = StepStamps(torch.device("cuda"), steps=4)
    for _ in range(2):
        stamps.stamp_start()
        torch.cuda._sleep(100_000)
        stamps.stamp_end()
    (s0, e0), (s1, e1) = stamps.read()
    assert 0 < s0 < e0 <= s1 < e1


@needs_cuda
def test_a_replayed_graph_writes_successive_slots():
    stamps = StepStamps(torch.device("cuda"), steps=4)
    stamps.stamp_start()  # compiles both kernels before the capture
    stamps.stamp_end()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        stamps.stamp_start()
        torch.cuda._sleep(100_000)
        stamps.stamp_end()
    stamps.reset()
    for _ in range(6):
        graph.replay()
    spans = stamps.read()
    assert int(stamps.count.item()) == 6 and len(spans) == 4  # the ring keeps the last four
    flat = [t for span in spans for t in span]
    assert flat == sorted(flat), spans  # replays in order, each in its own slot
    assert all(end - start > 1_000 for start, end in spans)  # the sleep lies between each pair
