"""A prefill job whose KV descriptor comes after it (`PrefillNode.attach`, the router's overlapped
placement), with real nodes in one process: the output equals the engine's whether the descriptor
comes before the job, while it computes, or after its first token; a job never attached is dropped
in time with its blocks; an abort or a bad descriptor frees them too."""

from __future__ import annotations

import random

import pytest

from engine.engine import resolve_request
from engine.model.loader import load_model
from engine.sampling.sampling_params import SamplingParams
from prefill_node.node import PrefillJob
from tests.decode_node.test_pd_nodes import Pair, reference, wait_until

PROMPT = [5, 6, 7, 8, 9, 10, 11] * 5
PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny")


def reserve(pair: Pair, rid: str, vocab: int):
    req = resolve_request(rid, PROMPT, PARAMS, pair.eos, pair.max_model_len, random.Random(0), vocab)
    res = pair.decode.reserve(rid, len(PROMPT), PARAMS, req.seed, req.stop_ids, PROMPT).result(timeout=30)
    assert res.admitted, res.reason
    return req, res.descriptor


def job(rid: str, req) -> PrefillJob:
    return PrefillJob(rid, PROMPT, PARAMS, req.seed, req.stop_ids, None, "")


@pytest.mark.parametrize("backend", ["local", "ucx"])
@pytest.mark.parametrize("when", ["after_first_token", "before_the_job"])
def test_a_late_descriptor_gives_the_engines_tokens(tiny, backend, when):
    vocab = tiny.model.config.vocab_size
    pair = Pair(tiny, 2, backend=backend)
    try:
        req, descriptor = reserve(pair, "a", vocab)
        if when == "before_the_job":  # the Attach call overtook the Prefill request
            attached = pair.prefill.attach("a", descriptor, "d0")
            first = pair.prefill.submit(job("a", req)).result(timeout=60)
        else:
            first = pair.prefill.submit(job("a", req)).result(timeout=60)
            assert pair.prefill.detached and not pair.decode.batch.busy  # D waits for its KV
            attached = pair.prefill.attach("a", descriptor, "d0")
        assert attached.result(timeout=30) is None
        pair.wait_terminal(["a"])
        assert pair.tokens("a", first) == reference(tiny, [PROMPT], PARAMS)[0]
        assert not pair.prefill.detached
    finally:
        pair.close()
    assert pair.prefill.blocks.num_free == pair.prefill.blocks.capacity
    assert pair.decode.blocks.num_free == pair.decode.blocks.capacity


def test_unattached_aborted_and_badly_attached_jobs_free_their_blocks(tiny):
    vocab = tiny.model.config.vocab_size
    pair = Pair(tiny, 2)
    pair.prefill.kv_timeout_s = 0.5
    try:
        p = pair.prefill
        for rid in ("never", "aborted", "bad"):
            req = resolve_request(rid, PROMPT, PARAMS, pair.eos, pair.max_model_len, random.Random(0), vocab)
            p.submit(job(rid, req)).result(timeout=60)
        p.abort("aborted")
        with pytest.raises(ValueError, match="bad KV descriptor"):
            p.attach("bad", {"blocks": [1, 2], "layers": "?"}, "d0").result(timeout=30)
        with pytest.raises(KeyError):
            p.attach("aborted", {}, "d0").result(timeout=30)  # gone: the attach waits for it, then expires
        wait_until(lambda: not p.detached and p.blocks.num_free == p.blocks.capacity)
    finally:
        pair.close()
