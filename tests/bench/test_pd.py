"""`pdserve bench pd` on the CPU with `tiny`: both modes serve the same requests with the same
greedy tokens, every figure is there, and the ITL plot is written."""

from __future__ import annotations

import json

from deploy.cli import main


def test_bench_pd_reports_both_modes_with_the_same_tokens(tmp_path, capsys):
    png = tmp_path / "itl.png"
    rc = main(["bench", "pd", "--model", "tiny", "--num-requests", "4", "--rate", "50", "--output-len", "8",
               "--background", "2", "--background-tokens", "64", "--spec-tokens", "2", "--plot", str(png)])
    assert rc == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["same_tokens"] is True
    for mode in ("disaggregated", "colocated"):
        figures = out[mode]
        assert set(figures["ttft_ms"]) == {"p50", "p90", "p99"} and figures["ttft_ms"]["p50"] > 0
        assert figures["itl_ms"]["p50"] > 0 and figures["background_itl_ms_before"] > 0
    stages = out["disaggregated"]["ttft_breakdown_ms_p50"]
    assert set(stages) == {"queue", "prefill_compute", "kv_tail", "handoff", "first_decode_step"}
    assert stages["prefill_compute"] > 0 and stages["first_decode_step"] > 0
    assert png.stat().st_size > 1000
