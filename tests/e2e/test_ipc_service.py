"""KV over the ipc backend (the decode node's cache mapped into the prefill node's process) in
the whole service: two Ray actor processes on one host, greedy tokens equal the engine's alone,
with MTP drafts, and every block returns."""

from __future__ import annotations

import random

import pytest

from engine.sampling.sampling_params import SamplingParams
from tests.e2e.conftest import run_async, start_service, wait_blocks_returned
from tests.e2e.test_service import generate_all

pytestmark = pytest.mark.usefixtures("ray_cluster")


def test_greedy_through_ipc_kv_equals_single_process(tiny_reference):
    svc, address = start_service(1, 2, 3, **{"kv_transfer.backend": "ipc"})
    try:
        rng = random.Random(5)
        prompts = [[rng.randrange(256) for _ in range(rng.choice([3, 17, 70, 150]))] for _ in range(16)]
        results = run_async(generate_all(address, prompts, max_tokens=12, ignore_eos=True))
        ref = tiny_reference(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
        assert [r["token_ids"] for r in results] == [r.output_ids for r in ref]
        wait_blocks_returned(svc)
        kv = svc.node_info()
        assert sum(i.get("kv_bytes", 0) for i in kv.values()) > 0, kv  # the KV did travel
    finally:
        svc.stop()
