"""A decode step's packed outputs (engine/runner/step_output.py): every segment is a view of the one
buffer, logprobs go in and come out exactly (fp32 as raw bits), and off CUDA the host reads the
step's own buffer without a copy."""

from __future__ import annotations

import torch

from engine.runner.step_output import HostOutputs, StepLayout, astuple_lp
from engine.sampling.sampler import LogprobsTensors


def test_segments_are_views_of_one_buffer_and_logprobs_round_trip():
    layout = StepLayout(rows=3, k1=4, lp_rows=2, num_top=5)
    buf = layout.empty("cpu")
    tokens, emitted, finished, lp = layout.views(buf)
    assert lp is not None and tokens.shape == (3, 4) and emitted.shape == finished.shape == (3,)
    for t in (tokens, emitted, finished, *astuple_lp(lp)):
        assert t.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
    g = torch.Generator().manual_seed(0)
    n = 2 * 4
    want = LogprobsTensors(-torch.rand(n, generator=g), torch.randint(1, 99, (n,), generator=g),
                           torch.randint(0, 50_000, (n, 5), generator=g), -torch.rand(n, 5, generator=g))
    tokens.copy_(torch.arange(12).view(3, 4))
    layout.write_logprobs(buf, want)
    got = layout.views(buf)
    assert torch.equal(got[0], torch.arange(12).view(3, 4))
    for a, b in zip(astuple_lp(got[3]), astuple_lp(want), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_a_layout_without_logprobs_holds_tokens_counts_and_flags_only():
    layout = StepLayout(rows=5, k1=1)
    assert layout.words == 5 * 3 and layout.views(layout.empty("cpu"))[3] is None


def test_a_constrained_layout_carries_the_new_drafts_after_everything_else():
    plain = StepLayout(rows=3, k1=4, lp_rows=3, num_top=2)
    layout = StepLayout(rows=3, k1=4, lp_rows=3, num_top=2, drafts=True)
    assert layout.words == plain.words + 3 * 3 and plain.drafts_view(plain.empty("cpu")) is None
    buf = layout.empty("cpu")
    drafts = layout.drafts_view(buf)
    assert drafts is not None and drafts.shape == (3, 3)
    drafts.copy_(torch.arange(9).view(3, 3))
    assert torch.equal(buf[plain.words :], torch.arange(9))  # the other segments lie where they did
    assert StepLayout(rows=3, k1=1, drafts=True).words == 3 * 3  # k = 0: no drafts


def test_off_cuda_the_host_reads_the_steps_buffer():
    outputs = HostOutputs(torch.device("cpu"))
    packed = torch.arange(6)
    copy = outputs.copy_no_sync(packed)
    copy.wait()
    assert copy.host is packed and outputs.num_buffers == 0
    outputs.release(copy)
