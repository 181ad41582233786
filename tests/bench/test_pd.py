"""`pdserve bench pd` on the CPU with `tiny`: disaggregated and colocated serve the same requests
with the same greedy tokens, every figure is there, and the ITL plot is written; by default with
each node in its own process behind the router, and in the older in-process mode."""

from __future__ import annotations

import json

from deploy.cli import main


def test_bench_pd_in_process_reports_both_modes_with_the_same_tokens(tmp_path, capsys):
    png = tmp_path / "itl.png"
    rc = main(["bench", "pd", "--in-process", "--model", "tiny", "--num-requests", "4", "--rate", "50", "--output-len", "8",
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


def test_bench_pd_one_process_per_node_reports_both_modes_with_the_same_tokens(capsys):
    rc = main(["bench", "pd", "--model", "tiny", "--num-requests", "4", "--rate", "50", "--output-len", "8",
               "--background", "2", "--background-tokens", "48", "--spec-tokens", "2", "--prompt-len", "40",
               "--max-num-batched-tokens", "16"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["mode"] == "processes" and out["kv_backend"] == "tcp" and out["max_num_batched_tokens"] == 16
    assert out["same_tokens"] is True
    for mode in ("disaggregated", "colocated"):
        figures = out[mode]
        assert set(figures["ttft_ms"]) == {"p50", "p90", "p99"} and figures["ttft_ms"]["p50"] > 0
        assert set(figures["itl_ms"]) == {"p50", "p90", "p99"} and figures["itl_ms"]["p50"] > 0
        assert figures["background_itl_ms_before"] > 0 and figures["background_itl_ms_during"] > 0
        assert "insert_slowdown" in figures
    stages = out["disaggregated"]["ttft_breakdown_ms_p50"]
    assert set(stages) == {"queue", "prefill_compute", "kv_tail", "handoff", "first_decode_step"}
    assert stages["prefill_compute"] > 0 and stages["first_decode_step"] > 0


def test_bench_pd_local_kv_needs_in_process():
    import pytest

    with pytest.raises(SystemExit, match="--in-process"):
        main(["bench", "pd", "--model", "tiny", "--kv-backend", "local"])
