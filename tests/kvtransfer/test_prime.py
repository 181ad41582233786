"""Priming transfers (kvtransfer/prime.py): no blocks, every layer; with ipc the receiver's pool is
opened by the prime, so the first request's transfer opens none."""

from __future__ import annotations

import pytest

from kvtransfer import KVLayout, TransferError, TransferState, create_sender
from kvtransfer.prime import prime
from tests.kvtransfer.peer import Peer, block_bytes, make_cache
from tests.kvtransfer.pool_opens import count_pool_opens

NUM_BLOCKS = 16
LAYERS = [0, 1, 2, 3]


def _pair(backend: str) -> tuple[Peer, object, list, list[int]]:
    if backend == "ucx":
        pytest.importorskip("ucxx")
    receiver = Peer("receiver", backend, NUM_BLOCKS, timeout_s=30, seed=None)
    src, dims = make_cache(NUM_BLOCKS, seed=1)
    sender = create_sender(backend, timeout_s=30)
    sender.register(KVLayout(src, dims))
    return receiver, sender, src, dims


@pytest.mark.parametrize("backend", ["tcp", "ipc", "ucx"])
def test_a_priming_transfer_ends_done_on_both_ends_and_holds_nothing(backend: str) -> None:
    receiver, sender, _, _ = _pair(backend)
    try:
        desc = receiver.call("expect", request_id="prime-1", dst_block_ids=[], layers=LAYERS)
        assert prime(sender, "prime-1", desc, 30).state is TransferState.DONE
        assert receiver.call("wait", rid="prime-1") == ["done", ""]
        assert sender.held() == []
    finally:
        sender.close()
        receiver.close()


def test_after_priming_the_first_ipc_transfer_opens_no_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    opened = count_pool_opens(monkeypatch)
    receiver, sender, src, dims = _pair("ipc")
    try:
        desc = receiver.call("expect", request_id="prime-1", dst_block_ids=[], layers=LAYERS)
        assert prime(sender, "prime-1", desc, 30).state is TransferState.DONE
        assert len(opened) == 1  # the receiver's pool, opened by the prime
        desc = receiver.call("expect", request_id="r", dst_block_ids=[5, 6, 9], layers=LAYERS)
        sender.start("r", desc)
        for layer in LAYERS:
            sender.send_layer("r", layer, [1, 2, 3])
        sender.finish("r")
        assert sender.wait("r", 30).state is TransferState.DONE
        assert len(opened) == 1  # the request's transfer used it
        for layer in LAYERS:
            assert receiver.call("dump", layer=layer, blocks=[5, 6, 9]) == block_bytes(src, dims, layer, [1, 2, 3])
    finally:
        sender.close()
        receiver.close()


def test_a_descriptor_with_blocks_is_no_priming_one() -> None:
    receiver, sender, _, _ = _pair("tcp")
    try:
        desc = receiver.call("expect", request_id="r", dst_block_ids=[3], layers=LAYERS)
        with pytest.raises(TransferError, match="no blocks"):
            prime(sender, "r", desc, 30)
        assert sender.held() == []
        receiver.call("abort", request_id="r")
    finally:
        sender.close()
        receiver.close()
