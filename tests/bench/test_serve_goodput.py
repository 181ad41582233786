"""bench/serve_goodput.py: TPOT, SLO attainment, the goodput pick (interpolated between the last
passing and the first failing rate; none pass, all pass, non-monotone), the layouts' parsing,
comparison, table and plot."""

from __future__ import annotations

import math

import pytest

from bench.serve_goodput import (
    Layout,
    attainment,
    attains,
    comparison,
    goodput,
    goodput_grid,
    parse_layout,
    plot_attainment,
    table,
    tpot,
)
from bench.serve_load import Result


def req(ttft: float, itl: list[float], ok: bool = True) -> Result:
    return Result(ok=ok, ttft=ttft, tokens=1 + len(itl) if ok else 0, itl=itl, e2e=ttft + sum(itl))


def test_tpot_is_the_mean_inter_token_latency():
    assert tpot(req(0.1, [0.01, 0.03, 0.02])) == pytest.approx(0.02)
    assert tpot(req(0.1, [])) is None  # one token: no TPOT


def test_attainment_needs_both_slos_and_counts_failed_requests_as_missed():
    slo_ttft, slo_tpot = 0.2, 0.02
    good = req(0.2, [0.01, 0.03])  # TTFT at the SLO, TPOT 20 ms although one ITL is 30 ms
    slow_first = req(0.21, [0.01])
    slow_tokens = req(0.05, [0.025, 0.02])
    one_token = req(0.1, [])  # judged by its TTFT alone
    failed = req(0.01, [], ok=False)
    assert attains(good, slo_ttft, slo_tpot) and attains(one_token, slo_ttft, slo_tpot)
    assert not any(attains(r, slo_ttft, slo_tpot) for r in (slow_first, slow_tokens, failed))
    assert attainment([good, slow_first, slow_tokens, one_token, failed], slo_ttft, slo_tpot) == pytest.approx(0.4)
    assert math.isnan(attainment([], slo_ttft, slo_tpot))


def test_goodput_interpolates_between_the_last_pass_and_the_first_fail():
    g = goodput([(4.0, 0.95), (1.0, 1.0), (8.0, 0.5), (2.0, 0.99)], target=0.9)  # any order
    assert g.method == "interpolated" and g.measured == 4.0 and not g.non_monotone
    assert g.rate == pytest.approx(4.0 + (0.95 - 0.9) / (0.95 - 0.5) * 4.0)
    exact = goodput([(1.0, 1.0), (2.0, 0.9), (3.0, 0.8)], target=0.9)  # at the target: passes
    assert exact.rate == pytest.approx(2.0) and exact.measured == 2.0


def test_goodput_when_none_or_all_pass():
    none = goodput([(1.0, 0.8), (2.0, 0.5)], target=0.9)
    assert (none.rate, none.method, none.measured) == (0.0, "none_pass", None)
    every = goodput([(1.0, 1.0), (2.0, 0.95), (float("inf"), 0.1)], target=0.9)  # inf: not a rate to pick
    assert (every.rate, every.method, every.measured) == (2.0, "all_pass", 2.0)
    assert goodput([(float("inf"), 1.0)]).method == "no_rates" and goodput([]).rate == 0.0


def test_goodput_of_a_non_monotone_sweep_stops_at_the_first_failure():
    g = goodput([(1.0, 1.0), (2.0, 0.85), (3.0, 0.95), (4.0, 0.2)], target=0.9)
    assert g.non_monotone and g.measured == 1.0 and g.method == "interpolated"
    assert 1.0 < g.rate < 2.0  # the later pass at 3/s does not lift it
    assert goodput([(1.0, 0.5), (2.0, 0.95)], target=0.9).non_monotone


def test_parse_layout():
    pd = parse_layout("prefill=1,decode=3")
    assert pd == Layout("1P3D", {"prefill": 1, "decode": 3}, ()) and pd.disaggregated
    colo = parse_layout("colocated=2, colocated.max_num_batched_tokens=256")
    assert colo.name == "colocated2" and not colo.disaggregated
    assert colo.overrides == ("colocated.max_num_batched_tokens=256",)
    tp = parse_layout("prefill=1,decode=1,tp=2,name=tp2")
    assert tp.name == "tp2" and tp.flags == {"prefill": 1, "decode": 1, "prefill_tp": 2, "decode_tp": 2}
    for bad in ("prefill=1", "prefill=1,decode=1,colocated=2", "colocated=2,tp=2", "gpus=2", "decode",
                "prefill=x,decode=1", ""):
        with pytest.raises(ValueError, match="--layout"):
            parse_layout(bad)


def _run(rate: float, share: float) -> dict:
    lat = {"p50_ms": 1.0, "p90_ms": 2.0, "p99_ms": 3.0, "mean_ms": 1.5}
    return {"request_rate": rate, "slo_attainment": share, "ttft": lat, "tpot": lat, "itl": lat,
            "output_throughput": 100.0, "server": {"kv_transfer_p50_ms": 0.25, "kv_transfer_p99_ms": 0.75}}


def test_comparison_table_and_plot(tmp_path):
    layouts = []
    for name, pd, shares in (("1P1D", True, (1.0, 0.95, 0.3)), ("colocated2", False, (1.0, 0.8, 0.2))):
        g = goodput([(r, a) for r, a in zip((1.0, 2.0, 4.0), shares, strict=True)])
        layouts.append({"name": name, "disaggregated": pd, "gpus": 2.0, **g.as_dict(),
                        "runs": [_run(r, a) for r, a in zip((1.0, 2.0, 4.0), shares, strict=True)]})
    report = {"slo_ttft_ms": 50.0, "slo_tpot_ms": 20.0, "goodput_attainment": 0.9, "layouts": layouts,
              **comparison(layouts)}
    pd_rate, colo_rate = layouts[0]["goodput_rate"], layouts[1]["goodput_rate"]
    assert 2.0 < pd_rate < 4.0 and 1.0 < colo_rate < 2.0
    assert report["goodput_ratio_pd_over_colocated"] == pytest.approx(pd_rate / colo_rate, abs=1e-3)
    assert comparison(layouts[:1]) == {"goodput_ratio_pd_over_colocated": None}
    layouts[1]["runs"] = [{**r, "server": {}} for r in layouts[1]["runs"]]  # colocated: no KV transfers
    text = table(report)
    assert text.count("0.75") == 3 and text.count(" - ") == 6  # p50 and p99 of 3 colocated rows
    assert text.count("1P1D") == 4 and "PD / colocated goodput" in text and "TPOT <= 20 ms" in text
    plot_attainment(report, tmp_path / "attainment.png")
    assert (tmp_path / "attainment.png").stat().st_size > 0


def test_one_sweep_gives_the_goodput_at_each_tpot_slo_of_a_grid():
    """Per run, attainment at each grid SLO; per layout, the goodput there; per SLO, PD over colocated
    (here PD holds a tight TPOT that colocated misses, and both hold the loose one)."""
    def runs(tight: tuple[float, ...], loose: tuple[float, ...]) -> list[dict]:
        return [{"request_rate": r, "attainment_by_tpot_ms": {"8": a, "20": b}}
                for r, a, b in zip((1.0, 2.0, 4.0), tight, loose, strict=True)]

    pd, colo = runs((1.0, 0.95, 0.5), (1.0, 1.0, 0.95)), runs((0.5, 0.2, 0.0), (1.0, 1.0, 0.92))
    grid_pd, grid_colo = goodput_grid(pd), goodput_grid(colo)
    assert list(grid_pd) == ["8", "20"] and grid_pd["20"]["goodput_method"] == "all_pass"
    assert 2.0 < grid_pd["8"]["goodput_rate"] < 4.0 and grid_colo["8"]["goodput_method"] == "none_pass"
    layouts = [{"name": "1P1D", "disaggregated": True, "goodput_rate": 1.0, "goodput_by_tpot_ms": grid_pd},
               {"name": "colocated2", "disaggregated": False, "goodput_rate": 1.0, "goodput_by_tpot_ms": grid_colo}]
    ratios = comparison(layouts)["goodput_ratio_by_tpot_ms"]
    assert ratios == {"8": None, "20": 1.0}  # colocated's 0 at 8 ms: no ratio; both 4 req/s at 20 ms
    assert goodput_grid([{"request_rate": 1.0}]) == {}  # no grid asked: nothing added
