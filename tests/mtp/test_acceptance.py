"""`pdserve bench acceptance`: greedy output with drafts equals plain output, and the draft
vocabulary's coverage and the decode tokens/s are reported."""

from __future__ import annotations

import argparse

import pytest
import torch

from bench import acceptance as bench_acceptance
from mtp.acceptance import measure
from tests.engine.conftest import DEVICE
from tests.engine.test_draft_vocab import ranked_tiny


def test_bench_acceptance_reports_exactness_and_coverage(tiny, tmp_path):
    vocab = tiny.model.config.vocab_size
    ranked = ranked_tiny(tiny, tmp_path, torch.arange(vocab))  # ids 319, 318, ... first
    parser = argparse.ArgumentParser()
    bench_acceptance.add_arguments(parser)
    args = parser.parse_args(["--num-prompts", "2", "--max-tokens", "8", "--draft-vocab", "300", "--device", DEVICE])
    result = measure(ranked, args)
    assert result["same_tokens_as_plain"] and result["draft_vocab"] == 300
    assert 0.0 <= result["draft_vocab_coverage"] <= 1.0
    assert result["decode_tokens_per_s_plain"] > 0 and result["decode_tokens_per_s_mtp"] > 0
    # the ratio of the unrounded rates, to 3 places: the reported rates are rounded to 2, so their own
    # ratio may land on the other side of a rounding boundary (seen: 0.406 against 0.405)
    ratio = result["decode_tokens_per_s_mtp"] / result["decode_tokens_per_s_plain"]
    assert result["decode_speedup"] == pytest.approx(ratio, abs=1e-3)
