"""bench/serve_metrics.py: the server's counters read from Prometheus text, summed over labels, and
the KV transfer histogram's quantiles."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from bench.serve_metrics import breakdown, histogram_quantile, parse
from protos import node_pb2
from protos.messages import KV_TRANSFER_BUCKETS
from router.metrics import NodeCollector

TEXT = """# HELP pdserve:time_to_first_token_seconds Time to first token
pdserve:time_to_first_token_seconds_bucket{le="0.01",model_name="m"} 3.0
pdserve:time_to_first_token_seconds_sum{model_name="m"} 0.05
pdserve:time_to_first_token_seconds_count{model_name="m"} 4.0
pdserve:prefill_seconds{node="p0",role="prefill"} 0.02
pdserve:prefill_seconds_total{node="p1",role="prefill"} 0.01
pdserve:prefill_tokens{node="p0",role="prefill"} 512.0
"""


def test_parse_sums_label_sets_and_skips_the_rest():
    got = parse(TEXT)
    assert got["pdserve:prefill_seconds"] == 0.03 and got["pdserve:time_to_first_token_seconds_count"] == 4.0
    assert "pdserve:time_to_first_token_seconds_bucket" not in got


def test_breakdown_is_per_request_over_the_run():
    before = parse(TEXT)
    after = dict(before)
    after["pdserve:time_to_first_token_seconds_sum"] += 0.08
    after["pdserve:time_to_first_token_seconds_count"] += 4
    after["pdserve:prefill_seconds"] += 0.008
    got = breakdown(before, after, completed=4)
    assert got == {"router_ttft_mean_ms": 20.0, "prefill_ms_per_request": 2.0, "kv_transfer_ms_per_request": 0.0}
    after["pdserve:request_reserve_time_seconds_sum"] = 0.006  # the TTFT's parts: a mean per first token
    after["pdserve:request_prefill_time_seconds_sum"] = 0.05
    got = breakdown(before, after, completed=4)
    assert got["ttft_reserve_mean_ms"] == 1.5 and got["ttft_prefill_mean_ms"] == 12.5 and got["ttft_write_mean_ms"] == 0
    assert list(got).index("ttft_parse_mean_ms") < list(got).index("ttft_write_mean_ms")  # request order
    assert "ttft_prefill_p99_ms" not in got and "cold_shape_steps" not in got  # not exposed: not made up
    for le, n in (("0.005", 3.0), ("0.2", 4.0), ("+Inf", 4.0)):  # one of four prefills waited 5-200 ms
        after[f"pdserve:request_prefill_time_seconds_bucket|{le}"] = n
    before["pdserve:cold_shape_steps"], after["pdserve:cold_shape_steps"] = 2.0, 3.0
    got = breakdown(before, after, completed=4)
    assert got["ttft_prefill_p99_ms"] == pytest.approx(5 + 195 * (3.96 - 3) / 1) and got["cold_shape_steps"] == 1
    assert breakdown({}, after, 4) == {} and breakdown(before, after, 0) == {}


def test_histogram_quantile_is_linear_within_a_bucket():
    buckets = {0.001: 2.0, 0.01: 6.0, 0.1: 10.0, math.inf: 10.0}
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.001 + 0.009 * (5 - 2) / 4)
    assert histogram_quantile(0.1, buckets) == pytest.approx(0.0005)  # the first bucket starts at 0
    assert histogram_quantile(1.0, {0.5: 3.0, math.inf: 4.0}) == 0.5  # in +Inf: the highest finite bound
    assert math.isnan(histogram_quantile(0.5, {math.inf: 0.0})) and math.isnan(histogram_quantile(0.5, {}))


def test_kv_transfer_histogram_from_the_routers_exposition_to_the_report():
    """A prefill node's per-bucket transfer counts (NodeStatus) exposed by the router's collector as
    `pdserve:kv_transfer_seconds` and read back by `bench serve`: count, mean and quantiles."""
    registry = CollectorRegistry()

    def prefill(name: str, buckets: list[int], seconds: float) -> SimpleNamespace:
        status = node_pb2.NodeStatus(kind="prefill", kv_seconds=seconds, kv_seconds_buckets=buckets)
        return SimpleNamespace(address=name, kind="prefill", healthy=True, status=status, status_failures={})

    def counts(**at: int) -> list[int]:  # transfers per bucket, by the bucket's bound
        return [at.get(f"b{i}", 0) for i in range(len(KV_TRANSFER_BUCKETS) + 1)]

    ms = KV_TRANSFER_BUCKETS.index(0.001)
    nodes = [prefill("p0", counts(), 0.0), prefill("p1", counts(), 0.0),
             SimpleNamespace(address="d0", kind="decode", healthy=True, status=node_pb2.NodeStatus(kind="decode"),
                             status_failures={}),
             prefill("bad", [1, 2], 9.0)]  # a malformed list: left out
    registry.register(NodeCollector(lambda: nodes))
    before = parse(generate_latest(registry).decode())
    nodes[0] = prefill("p0", counts(**{f"b{ms}": 6, f"b{ms + 1}": 2}), 0.0062)  # 6 within 1 ms, 2 within 2.5 ms
    nodes[1] = prefill("p1", counts(**{f"b{len(KV_TRANSFER_BUCKETS)}": 2}), 30.0)  # 2 past the last bound
    text = generate_latest(registry).decode()
    assert 'pdserve:kv_transfer_seconds_bucket{kind="prefill",le="+Inf",node="p1"} 2.0' in text
    family = next(f for f in text_string_to_metric_families(text) if f.name == "pdserve:kv_transfer_seconds")
    assert family.type == "histogram" and {s.labels["node"] for s in family.samples} == {"p0", "p1"}
    got = breakdown(before, parse(text), completed=10)
    assert got["kv_transfers"] == 10 and got["kv_transfer_mean_ms"] == pytest.approx(1000 * 30.0062 / 10)
    assert got["kv_transfer_ms_per_request"] == pytest.approx(3000.62)
    assert KV_TRANSFER_BUCKETS[ms - 1] * 1000 < got["kv_transfer_p50_ms"] <= 1.0  # the 5th of 10: within 1 ms
    assert got["kv_transfer_p99_ms"] == 1000 * KV_TRANSFER_BUCKETS[-1]  # in +Inf: the highest finite bound
