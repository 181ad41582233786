"""bench/serve_metrics.py: the server's counters read from Prometheus text, summed over labels."""

from __future__ import annotations

from bench.serve_metrics import breakdown, parse

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
    after["pdserve:request_reserve_time_seconds_sum"] = 0.006  # 5 reservations (one request moved once)
    after["pdserve:request_reserve_time_seconds_count"] = 5
    assert breakdown(before, after, completed=4)["router_reserve_call_mean_ms"] == 1.2
    assert breakdown({}, after, 4) == {} and breakdown(before, after, 0) == {}
