"""Two-process transfers: destination bytes equal source bytes, for every backend."""

from __future__ import annotations

import asyncio
import random
import threading

import pytest
import torch

from kvtransfer import KVLayout, TransferError, TransferState, create_receiver, create_sender
from kvtransfer.layout import coalesce
from tests.kvtransfer.peer import Peer, block_bytes, make_cache

NUM_BLOCKS = 64
LAYERS = [0, 1, 2, 3]


def shuffled_runs(rng: random.Random, n: int) -> list[int]:
    """0..n-1 cut into runs of 1-5 consecutive ids, runs in random order."""
    runs, start = [], 0
    while start < n:
        size = rng.randint(1, 5)
        runs.append(list(range(start, min(n, start + size))))
        start += size
    rng.shuffle(runs)
    return [b for run in runs for b in run]


def block_maps(seed: int, requests: int) -> list[tuple[list[int], list[int]]]:
    """Per request (src ids, dst ids): random lengths, disjoint destinations."""
    rng = random.Random(seed)
    src_pool, dst_pool = shuffled_runs(rng, NUM_BLOCKS), shuffled_runs(rng, NUM_BLOCKS)
    maps = []
    for _ in range(requests):
        k = rng.randint(1, 7)
        maps.append((src_pool[:k], dst_pool[:k]))
        src_pool, dst_pool = src_pool[k:] + src_pool[:k], dst_pool[k:]
    return maps


def interleaved_send(sender, maps: list[tuple[list[int], list[int]]], seed: int) -> None:
    rng = random.Random(seed)
    rids = [f"req-{i}" for i in range(len(maps))]
    for layer in LAYERS:
        order = list(range(len(maps)))
        rng.shuffle(order)
        for i in order:
            sender.send_layer(rids[i], layer, maps[i][0])
    for rid in rids:
        sender.finish(rid)


@pytest.mark.parametrize(("backend", "lanes"), [("tcp", None), ("ipc", None), ("ucx", None), ("ucx", 1), ("ucx", 3)])
def test_eight_interleaved_requests_arrive_exactly(
    backend: str, lanes: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``lanes``: the receiving process's ucx receive lanes (default 2); layer l goes to lane
    l % lanes, so with 3 lanes and 4 layers one lane carries two layers of every request."""
    if lanes is not None:
        monkeypatch.setenv("PDSERVE_UCX_LANES", str(lanes))  # read by the spawned receiver
    receiver = Peer("receiver", backend, NUM_BLOCKS, timeout_s=30, seed=None)
    src, dims = make_cache(NUM_BLOCKS, seed=1)
    sender = create_sender(backend, timeout_s=30)
    sender.register(KVLayout(src, dims))
    try:
        maps = block_maps(seed=7, requests=8)
        for i, (_, dst) in enumerate(maps):
            desc = receiver.call("expect", request_id=f"req-{i}", dst_block_ids=dst, layers=LAYERS)
            assert len(desc["lanes"]) == (lanes or 2 if backend == "ucx" else 0)
            sender.start(f"req-{i}", desc)
        interleaved_send(sender, maps, seed=3)
        for i, (src_ids, dst) in enumerate(maps):
            assert sender.wait(f"req-{i}", 30).state is TransferState.DONE
            assert receiver.call("wait", rid=f"req-{i}") == ["done", ""]
            for layer in LAYERS:
                got = receiver.call("dump", layer=layer, blocks=dst)
                assert got == block_bytes(src, dims, layer, src_ids), (i, layer)
        assert sender.held() == []
    finally:
        sender.close()
        receiver.close()


def test_local_backend_moves_every_dtype_and_layout() -> None:
    src, dims = make_cache(NUM_BLOCKS, seed=2)
    dst, _ = make_cache(NUM_BLOCKS, seed=None)
    receiver, sender = create_receiver("local", timeout_s=10), create_sender("local", timeout_s=10)
    receiver.register(KVLayout(dst, dims))
    sender.register(KVLayout(src, dims))
    maps = block_maps(seed=5, requests=8)
    try:
        for i, (_, d) in enumerate(maps):
            sender.start(f"req-{i}", receiver.expect(f"req-{i}", d, LAYERS))
        interleaved_send(sender, maps, seed=9)
        for i, (s, d) in enumerate(maps):
            assert receiver.wait(f"req-{i}", 10).state is TransferState.DONE
            for layer in LAYERS:
                assert block_bytes(dst, dims, layer, d) == block_bytes(src, dims, layer, s)
    finally:
        sender.close()
        receiver.close()


@pytest.mark.parametrize("backend,planes_per_message", [("tcp", 2), ("local", 2), ("ucx", 1)])
def test_4k_token_request_is_one_message_per_layer_run(backend: str, planes_per_message: int) -> None:
    """4096 tokens / block size 16 = 256 blocks; stacked K/V layout (2 planes per layer).

    tcp and local carry both planes in one message per run; ucx sends one per plane.
    """
    layers = [torch.randn(2, 300, 16, 1, 4) for _ in range(3)]
    dst = [torch.zeros_like(t) for t in layers]
    receiver, sender = create_receiver(backend, timeout_s=10), create_sender(backend, timeout_s=10)
    receiver.register(KVLayout(dst, 1))
    sender.register(KVLayout(layers, 1))
    src_ids = list(range(10, 138)) + list(range(200, 328 - 40)) + list(range(160, 200))
    dst_ids = list(range(0, 256))
    try:
        sender.start("r", receiver.expect("r", dst_ids, [0, 1, 2]))
        for layer in range(3):
            sender.send_layer("r", layer, src_ids)
        sender.finish("r")
        assert sender.wait("r", 10).state is TransferState.DONE
        runs = len(coalesce(src_ids, dst_ids))
        assert runs == 3
        assert sender.messages == 3 * runs * (2 // planes_per_message)
        for layer in range(3):
            assert torch.equal(dst[layer][:, dst_ids], layers[layer][:, src_ids])
    finally:
        sender.close()
        receiver.close()


def test_layout_mismatch_is_refused_at_start() -> None:
    receiver, sender = create_receiver("local"), create_sender("local")
    receiver.register(KVLayout([torch.zeros(2, 8, 4, 2, 8)], 1))
    sender.register(KVLayout([torch.zeros(2, 8, 4, 2, 8, dtype=torch.float16)], 1))
    try:
        with pytest.raises(TransferError, match="layout mismatch"):
            sender.start("r", receiver.expect("r", [1, 2], [0]))
    finally:
        sender.close()
        receiver.close()


def test_ucx_driver_stops_spinning_after_transfers() -> None:
    """Data receives make the ucx lanes busy-poll while they are pending; once every
    transfer is done the loop and every lane must sleep again (a leaked hot receive keeps a
    core busy forever). Likewise the sender's data sends, reaped by a timer rather than on
    wake-ups: every one must be reaped and the timer stopped.
    Back-to-back transfers in one process make ``begin`` and data complete in one
    progress call, the case that once leaked."""
    from kvtransfer import ucx

    layers = [torch.randn(64, 512) for _ in range(4)]
    dst = [torch.zeros_like(t) for t in layers]
    receiver, sender = create_receiver("ucx", timeout_s=10), create_sender("ucx", timeout_s=10)
    receiver.register(KVLayout(dst, 0))
    sender.register(KVLayout(layers, 0))
    stale = len(ucx.driver()._data_pending)  # sends an earlier test left that no receive takes
    try:
        for i in range(8):
            sender.start(f"r{i}", receiver.expect(f"r{i}", list(range(64)), [0, 1, 2, 3]))
            for layer in range(4):
                sender.send_layer(f"r{i}", layer, list(range(64)))
            sender.finish(f"r{i}")
            assert sender.wait(f"r{i}", 10).state is TransferState.DONE
            assert receiver.wait(f"r{i}", 10).state is TransferState.DONE
        assert all(torch.equal(d, s) for d, s in zip(dst, layers, strict=True))
        assert ucx.runtime().submit(_hot()).result(10) == 0
        assert ucx.runtime().submit(_sends_left(stale)).result(10) == (stale, stale > 0)
    finally:
        sender.close()
        receiver.close()


async def _sends_left(stale: int) -> tuple[int, bool]:
    """(data sends not yet reaped, reaping timer still set), once only the ``stale`` ones are
    left and the timer settled, or after 2 s."""
    from kvtransfer import ucx

    drv = ucx.driver()
    for _ in range(200):
        if len(drv._data_pending) == stale and (drv._data_poll is None) == (stale == 0):
            break
        await asyncio.sleep(0.01)
    return len(drv._data_pending), drv._data_poll is not None


async def _hot() -> int:
    from kvtransfer import ucx

    drv = ucx.driver()  # a lane drops a receive from ``_pending`` before its handler runs
    return drv.hot + sum(h.hot for lane in drv.lanes() for h in lane._pending)


def test_ucx_descriptor_without_lanes_fails_the_transfer() -> None:
    """A ucx descriptor must name the receiver's data lanes; one that names none (a
    receiver of an older protocol, or a forged one) fails the transfer with the reason."""
    layers = [torch.randn(8, 64)]
    # no timer in play: the descriptor fails the transfer at once (a short timeout could win the race)
    receiver, sender = create_receiver("ucx", timeout_s=60), create_sender("ucx", timeout_s=60)
    receiver.register(KVLayout([torch.zeros_like(layers[0])], 0))
    sender.register(KVLayout(layers, 0))
    try:
        desc = dict(receiver.expect("r", list(range(8)), [0]))
        desc["lanes"] = []
        sender.start("r", desc)
        status = sender.wait("r", 10)
        assert status.state is TransferState.FAILED and "lane" in status.reason
        assert sender.held() == []
    finally:
        sender.close()
        receiver.close()


def test_ucx_expect_does_not_wait_for_the_transport_thread() -> None:
    """A decode loop calls ``expect``; the ucx thread can be inside one long copy (a whole
    transfer's data phase). ``expect`` must return while that thread is held, and the
    receives it queued must still catch the transfer once the thread is free."""
    layers = [torch.randn(16, 256) for _ in range(2)]
    dst = [torch.zeros_like(t) for t in layers]
    receiver, sender = create_receiver("ucx", timeout_s=10), create_sender("ucx", timeout_s=10)
    receiver.register(KVLayout(dst, 0))
    sender.register(KVLayout(layers, 0))
    hold, got = threading.Event(), []
    try:
        receiver._thread.call(hold.wait, 120)  # the transport thread is busy (until hold is set)
        caller = threading.Thread(target=lambda: got.append(receiver.expect("r", list(range(16)), [0, 1])))
        caller.start()
        caller.join(60)  # an expect that waited for the thread would still be waiting
        returned_while_held = not caller.is_alive()
        hold.set()
        caller.join(10)
        assert returned_while_held, "expect waited for the transport thread"
        sender.start("r", got[0])
        for layer in range(2):
            sender.send_layer("r", layer, list(range(16)))
        sender.finish("r")
        assert sender.wait("r", 10).state is TransferState.DONE
        assert receiver.wait("r", 10).state is TransferState.DONE
        assert all(torch.equal(d, s) for d, s in zip(dst, layers, strict=True))
    finally:
        hold.set()
        sender.close()
        receiver.close()
