"""TTFT by its parts (router/ttft.py): a prefill call's window split around what the node reported,
and, through the whole service (real HTTP and gRPC on 127.0.0.1, real tiny-model nodes in this
process, PD (the reservation alongside the prefill, or before it) and colocated), each request's parts in /metrics adding up to its TTFT."""

from __future__ import annotations

import time

import httpx2
import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from router.client import RouterClient, build_request
from router.metrics import TTFT_PART_METRICS
from router.ttft import PARTS, Timeline, split_window
from tests.fuzz import fuzz_settings
from tests.router.real_service import RealService

SECONDS = st.floats(0.0, 10.0) | st.sampled_from([0.0, 1e-9, 86400.0])


@fuzz_settings(300)
@given(SECONDS, SECONDS, SECONDS)
def test_a_window_splits_into_parts_that_add_up(window, queue_s, compute_s):
    queue, compute, back = split_window(window, queue_s, compute_s)
    assert min(queue, compute, back) >= 0
    assert queue + compute + back == pytest.approx(window, rel=1e-12, abs=1e-12)


def test_the_nodes_figures_are_cut_to_the_window():
    assert split_window(10.0, 2.0, 5.0) == (2.0, 5.0, 3.0)
    assert split_window(4.0, 3.0, 2.0) == (2.0, 2.0, 0.0)  # past the router's own measure: the queue is cut
    assert split_window(4.0, 9.0, 5.0) == (0.0, 4.0, 0.0)


def test_laps_charge_everything_since_the_previous_one():
    t = Timeline(start=100.0)
    t.lap("parse", 100.5)
    t.lap("tokenize", 101.0)
    t.lap("queue", 103.0)
    t.lap("queue", 104.0)
    assert t.parts["queue"] == 3.0 and t.total == 4.0
    t.prefill_window(0.5, 2.0, end=107.0)  # a call opened at the last lap, its first token 3 s later
    t.prefill_window(None, None, end=106.0)  # (an end before the last lap changes nothing)
    assert (t.parts["prefill_queue"], t.parts["prefill"], t.parts["return"]) == (0.5, 2.0, 0.5)
    t.lap("write", 108.0)
    assert t.total == 8.0 and sum(t.parts.values()) == t.total
    t.written = True
    t.lap("write", 200.0)
    assert t.total == 8.0  # nothing after the first token's write


# ---- the whole service ----------------------------------------------------------------------
NAMES = {part: f"pdserve:{name}" for part, (name, _) in TTFT_PART_METRICS.items()}
TTFT = "pdserve:time_to_first_token_seconds"


@pytest.fixture(scope="module", params=["pd", "pd-reserve-first", "colocated"])
def service(request):
    mode, _, order = request.param.partition("-")
    s = RealService(mode, max_model_len=256, overlap_reserve=not order)  # reserve first: no overlap
    yield s
    s.close()


def histograms(service) -> dict[str, tuple[float, float]]:
    """Every router histogram's (sum, count)."""
    text = httpx2.get(f"{service.base}/metrics", timeout=10).text
    out = {}
    for fam in text_string_to_metric_families(text):
        if fam.type == "histogram":
            got = {s.name: s.value for s in fam.samples}
            out[fam.name] = (got.get(f"{fam.name}_sum", 0.0), got.get(f"{fam.name}_count", 0.0))
    return out


def one_request_parts(service, send) -> tuple[dict[str, float], float, float]:
    """Run one request through `send`; its parts and its TTFT from /metrics, and the client's wait."""
    before = histograms(service)
    start = time.monotonic()
    send()
    waited = time.monotonic() - start
    for _ in range(100):  # the router observes once the client's stream took the first token
        after = histograms(service)
        if after[TTFT][1] - before[TTFT][1] >= 1:
            break
        time.sleep(0.01)
    assert after[TTFT][1] - before[TTFT][1] == 1
    parts = {}
    for part, name in NAMES.items():
        assert after[name][1] - before[name][1] == 1, part  # each part observed once with the TTFT
        parts[part] = after[name][0] - before[name][0]
    return parts, after[TTFT][0] - before[TTFT][0], waited


def grpc_generate(service) -> None:
    async def run():  # on the router's loop: gRPC's asyncio wants one loop per process
        async with RouterClient(f"127.0.0.1:{service.router.grpc_port}") as client:
            await client.generate(build_request([256, 5, 17, 5], max_tokens=4, temperature=0.0))
    service.call(run())


SENDS = {
    "http-stream": lambda s: list(s.client.completions.create(model="tiny", prompt=[256, 7, 8, 9] * 8, max_tokens=5,
                                                              stream=True, temperature=0)),
    "http-chat": lambda s: s.client.chat.completions.create(model="tiny", max_tokens=3, temperature=0,
                                                            messages=[{"role": "user", "content": "hello there"}]),
    "http-one-token": lambda s: list(s.client.completions.create(model="tiny", prompt="a b c", max_tokens=1,
                                                                 stream=True)),
    "grpc": grpc_generate,
}


@pytest.mark.parametrize("door", SENDS)
def test_each_requests_parts_add_up_to_its_ttft(service, door):
    parts, ttft, waited = one_request_parts(service, lambda: SENDS[door](service))
    assert set(parts) == set(PARTS)
    assert all(v >= 0 for v in parts.values()), parts
    # one clock, every stretch charged once: exact but for float rounding (the issue allows 1 ms)
    assert sum(parts.values()) == pytest.approx(ttft, abs=1e-6)
    assert 0 < ttft < waited  # inside the client's own wait for the whole answer
    assert parts["prefill"] > 0, parts  # the node's compute came back with the first token
    assert parts["write"] > 0, parts
    if not (service.mode == "pd" and service.router.config.overlap_reserve):
        # reserved alongside the prefill call, the reservation shows only where it outlasted the
        # call: the first token does not wait for P to take the descriptor (`Prefilled.confirm`)
        assert parts["reserve"] > 0, parts
    assert service.blocks_back()


def test_a_router_logs_its_first_requests_parts_and_then_stops(caplog):
    """The first requests after a start are the ones the histograms blur (a p99 of 32 requests is one
    of them): a router process logs the parts of its first LOGGED_FIRST, each once, and no more."""
    from types import SimpleNamespace

    from router.metrics import LOGGED_FIRST, RouterMetrics

    metrics = RouterMetrics("tiny", lambda: 0, lambda: 0, list)
    caplog.set_level("INFO", logger="router.metrics")
    for _ in range(LOGGED_FIRST + 3):
        st = SimpleNamespace(timeline=Timeline())
        st.timeline.lap("parse")
        metrics.first_token_written(st)  # type: ignore[arg-type]
        metrics.first_token_written(st)  # type: ignore[arg-type]  # a second call observes nothing
    lines = [r.getMessage() for r in caplog.records if r.name == "router.metrics"]
    assert len(lines) == LOGGED_FIRST
    assert lines[0].startswith("request 1's TTFT") and all(f"{part} " in lines[0] for part in PARTS)
