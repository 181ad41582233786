"""Priming through real nodes (router/priming.py, kvtransfer/prime.py): once the router serves, the
prefill node has opened the decode node's KV memory (ipc, shared memory on the CPU), and the first
request's transfer opens nothing more; its blocks come back on both nodes."""

from __future__ import annotations

import pytest

from tests.kvtransfer.pool_opens import count_pool_opens
from tests.router.real_service import RealService


def test_the_first_request_finds_the_decode_nodes_memory_open(monkeypatch: pytest.MonkeyPatch) -> None:
    opened = count_pool_opens(monkeypatch)
    service = RealService("pd", k=2, kv_backend="ipc")
    try:
        assert service.router.health().serving
        assert len(opened) == 1  # primed before the router served
        assert service.router.pool.primer.primed == 1
        for _ in range(2):
            got = service.client.completions.create(model="tiny", prompt="the quick brown fox", max_tokens=4, temperature=0)
            assert got.choices[0].text
        assert len(opened) == 1
        assert service.blocks_back()
    finally:
        service.close()
