"""`pdserve bench prefill` on the CPU: one JSON row per case and k (first tokens really come
back from one step), the table, and clear errors for bad cases."""

from __future__ import annotations

import json

import pytest

from deploy.cli import main


def test_prints_a_row_per_case_and_k_and_a_table(capsys):
    assert main(["bench", "prefill", "--model", "tiny", "--cases", "1x9,2x5", "--spec-tokens", "2",
                 "--iters", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = [json.loads(line) for line in out if line.startswith("{")]
    assert [(r["batch"], r["prompt"], r["spec_tokens"]) for r in rows] == [(1, 9, 0), (1, 9, 2), (2, 5, 0), (2, 5, 2)]
    assert all(r["ttft_ms"] > 0 and not r["graphs"] for r in rows)
    assert any(line.startswith("| tiny | 2 x 5 | 2 |") for line in out)


@pytest.mark.parametrize("cases", ["", "1x", "0x128", "2x3x4", "ax8"])
def test_bad_cases_are_a_clear_error(cases):
    from bench.prefill import parse_cases

    with pytest.raises(ValueError, match="BxN pairs"):
        parse_cases(cases)


def test_cases_past_the_models_positions_are_skipped_with_a_note(capsys):
    # tiny has 1024 positions: the default cases' 2048- and 4096-token prompts do not fit
    assert main(["bench", "prefill", "--model", "tiny", "--cases", "1x9,1x2048,4x4096", "--spec-tokens", "0",
                 "--iters", "1"]) == 0
    captured = capsys.readouterr()
    rows = [json.loads(line) for line in captured.out.splitlines() if line.startswith("{")]
    assert [(r["batch"], r["prompt"]) for r in rows] == [(1, 9)]
    assert "case 1x2048 skipped" in captured.err and "case 4x4096 skipped" in captured.err


def test_no_case_fitting_the_model_is_a_clear_error(capsys):
    assert main(["bench", "prefill", "--model", "tiny", "--cases", "1x2048", "--iters", "1"]) == 2
    assert "no case of --cases 1x2048 fits tiny's 1024 positions" in capsys.readouterr().err
