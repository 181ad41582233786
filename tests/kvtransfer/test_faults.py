"""Faults: a dead peer becomes FAILED on the other side, bad messages are contained."""

from __future__ import annotations

import socket
import struct
import zlib

import msgpack
import pytest
import torch

from kvtransfer import KVLayout, TransferState, create_receiver, create_sender, wire
from tests.kvtransfer.peer import Peer, make_cache

NUM_BLOCKS = 16
LAYERS = [0, 1, 2, 3]
TIMEOUT = 2.0  # for an end whose timer is how the test's failure is noticed
NO_TIMER = 60.0  # for an end that must succeed, or fail for another reason first, on any machine


def _sender(backend: str, released: list[str] | None = None, timeout_s: float = NO_TIMER):
    src, dims = make_cache(NUM_BLOCKS, seed=1)
    sender = create_sender(
        backend, timeout_s=timeout_s,
        on_release=None if released is None else lambda rid, st: released.append(rid),
    )
    sender.register(KVLayout(src, dims))
    return sender


def _receiver(backend: str, timeout_s: float = NO_TIMER):
    dst, dims = make_cache(NUM_BLOCKS, seed=None)
    receiver = create_receiver(backend, timeout_s=timeout_s)
    receiver.register(KVLayout(dst, dims))
    return receiver


def _transfer(sender, receiver, rid: str) -> TransferState:
    sender.start(rid, receiver.expect(rid, [4, 5, 6], LAYERS))
    for layer in LAYERS:
        sender.send_layer(rid, layer, [1, 2, 3])
    sender.finish(rid)
    return sender.wait(rid, 10).state


@pytest.mark.parametrize("backend", ["tcp", "ucx"])
def test_receiver_killed_mid_transfer_fails_and_frees_sender(backend: str) -> None:
    released: list[str] = []
    sender = _sender(backend, released, timeout_s=TIMEOUT)  # ucx notices a dead receiver by its timer
    doomed = Peer("receiver", backend, NUM_BLOCKS, timeout_s=TIMEOUT, seed=None)
    healthy = Peer("receiver", backend, NUM_BLOCKS, timeout_s=30, seed=None)
    try:
        sender.start("doomed", doomed.call("expect", request_id="doomed", dst_block_ids=[1, 2], layers=LAYERS))
        sender.send_layer("doomed", 0, [5, 6])
        doomed.kill()
        for layer in LAYERS[1:]:
            sender.send_layer("doomed", layer, [5, 6])
        sender.finish("doomed")
        status = sender.wait("doomed", 10 * TIMEOUT)
        assert status.state is TransferState.FAILED, status
        assert "receiver" in status.reason
        assert sender.held() == [] and released == ["doomed"]
        desc = healthy.call("expect", request_id="ok", dst_block_ids=[3], layers=LAYERS)
        sender.start("ok", desc)
        for layer in LAYERS:
            sender.send_layer("ok", layer, [7])
        sender.finish("ok")
        assert sender.wait("ok", 10).state is TransferState.DONE
    finally:
        sender.close()
        healthy.close()


@pytest.mark.parametrize("backend", ["tcp", "ucx"])
def test_sender_killed_fails_receiver_with_reason(backend: str) -> None:
    receiver = _receiver(backend, timeout_s=TIMEOUT)  # ucx notices a dead sender by its timer
    peer = Peer("sender", backend, NUM_BLOCKS, timeout_s=30, seed=1)
    try:
        desc = receiver.expect("r", [1, 2, 3], LAYERS)
        peer.call("start", request_id="r", descriptor=desc)
        peer.call("send_layers", rid="r", layers=[0], blocks=[4, 5, 6])
        assert receiver.wait("r", 0.01).state is not TransferState.FAILED
        peer.kill()
        status = receiver.wait("r", 10 * TIMEOUT)
        assert status.state is TransferState.FAILED
        assert "timed out" in status.reason or "connection" in status.reason, status.reason
    finally:
        receiver.close()


def test_receiver_abort_reaches_sender() -> None:
    sender, receiver = _sender("local"), _receiver("local")
    try:
        sender.start("r", receiver.expect("r", [1], LAYERS))
        sender.send_layer("r", 0, [2])
        receiver.abort("r", "client went away")
        status = sender.wait("r", 10)
        assert status.state is TransferState.FAILED and "client went away" in status.reason
        assert sender.held() == []
    finally:
        sender.close()
        receiver.close()


def test_sender_abort_reaches_receiver() -> None:
    sender, receiver = _sender("tcp"), _receiver("tcp")
    try:
        sender.start("r", receiver.expect("r", [1], LAYERS))
        sender.send_layer("r", 0, [2])
        sender.abort("r", "prefill preempted")
        status = receiver.wait("r", 10)
        assert status.state is TransferState.FAILED and "prefill preempted" in status.reason
    finally:
        sender.close()
        receiver.close()


def _sealed(obj: object) -> bytes:
    body = msgpack.packb(obj, use_bin_type=True)
    return wire.SEALED.pack(wire.MAGIC, len(body), zlib.crc32(body)) + body


BAD_TCP = {
    "not msgpack": struct.pack(">I", 3) + b"\xc1\xc1\xc1",
    "wrong version": struct.pack(">I", 20) + msgpack.packb({"v": 9, "t": "finish", "rid": "x", "layers": 1}).ljust(20, b"\0"),
    "oversized": struct.pack(">I", wire.MAX_MESSAGE_BYTES + 1),
    "unknown type": wire.HEADER.pack(len(b := msgpack.packb({"v": wire.VERSION, "t": "shell"}))) + b,
}


@pytest.mark.parametrize("kind", sorted(BAD_TCP))
def test_tcp_bad_message_closes_only_its_connection(kind: str) -> None:
    receiver, sender = _receiver("tcp"), _sender("tcp")
    try:
        victim_desc = receiver.expect("victim", [9], LAYERS)
        host, port = victim_desc["addr"].rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(wire.frame(wire.make("begin", rid="victim", tok=victim_desc["tok"], reply="", ack_tag=0,
                                              nblocks=1)))
            sock.sendall(BAD_TCP[kind])
            reply = sock.makefile("rb").read()  # until the receiver closes
        header_len = wire.frame_length(reply[:4])
        assert wire.decode(reply[4 : 4 + header_len])["t"] == "error"
        assert receiver.wait("victim", NO_TIMER).state is TransferState.FAILED
        assert "protocol error" in receiver.poll("victim").reason
        assert _transfer(sender, receiver, "bystander") is TransferState.DONE
    finally:
        sender.close()
        receiver.close()


def test_ucx_bad_messages_are_contained() -> None:
    receiver, sender = _receiver("ucx"), _sender("ucx")
    attacker = Peer("attacker", "ucx", NUM_BLOCKS, timeout_s=TIMEOUT, seed=None)
    try:
        victim = receiver.expect("victim", [9], LAYERS)
        bad = [
            b"\x00garbage",
            _sealed({"v": wire.VERSION + 7, "t": "finish", "rid": "victim", "layers": 4}),
            _sealed({"v": wire.VERSION, "t": "finish", "rid": "victim", "layers": 4, "extra": 1}),
            bytes(wire.SEALED.size + wire.MAX_MESSAGE_BYTES + 1),  # over the receive buffer
            wire.seal(wire.make("layers", rid="victim", tok=victim["tok"], layers=[0], runs=[[0, 1]])),  # before begin
        ]
        for payload in bad:
            attacker.call("raw_ucx", addr=victim["addr"], tag=victim["tag"], payload=payload)
        status = receiver.wait("victim", 10)
        assert status.state is TransferState.FAILED and "before begin" in status.reason
        assert _transfer(sender, receiver, "bystander") is TransferState.DONE
        errors = receiver.errors  # type: ignore[attr-defined]
        assert len(errors) == len(bad)
        assert any("wrong version" in e for e in errors) and any("fields" in e for e in errors)
        assert any("runcat" in e.lower() or "truncat" in e.lower() for e in errors)
    finally:
        attacker.close()
        sender.close()
        receiver.close()


def test_ucx_late_data_cannot_land_after_failure() -> None:
    """Receives are posted at ``expect``; once the transfer fails they must be retired, or a
    late send with the request's tag would still write into blocks the caller reused."""
    from kvtransfer import ucx

    receiver = _receiver("ucx", timeout_s=TIMEOUT)
    late = Peer("late sender", "ucx", NUM_BLOCKS, timeout_s=TIMEOUT, seed=None)
    try:
        desc = receiver.expect("r", [1, 2], LAYERS)
        status = receiver.wait("r", 10 * TIMEOUT)  # no sender ever begins: timed out
        assert status.state is TransferState.FAILED and "timed out" in status.reason
        plane = receiver.layout.run_views(0, 1, 2)[0]  # type: ignore[attr-defined]
        tag = ucx.data_tag(wire.token_serial(desc["tok"]), 0, 0)  # layer 0, run 0, plane 0: pre-posted
        lane = desc["lanes"][0]  # layer 0's lane, where its receives are posted
        late.call("raw_ucx", addr=lane, tag=tag, payload=b"\xff" * plane.numel())
        sender = _sender("ucx")  # the receiver keeps serving (and progressing its worker)
        try:
            assert _transfer(sender, receiver, "next") is TransferState.DONE
        finally:
            sender.close()
        assert not plane.any(), "late data landed in the failed request's blocks"
    finally:
        late.close()
        receiver.close()


def test_ucx_sends_nobody_takes_are_polled_ever_less_often() -> None:
    """A data send no receive ever takes (its receiver died, or posted other tags) fails its
    transfer at the lease and stays pending in UCX for good, since a posted send cannot be
    withdrawn. The sender's loop reaps data sends on a timer; for such sends the timer must
    back off towards 1 s, not wake the loop every few milliseconds forever."""
    from kvtransfer import ucx

    layers = [torch.randn(64, 1024) for _ in range(2)]  # 256 KiB a layer: rendezvous sends
    receiver = create_receiver("ucx", timeout_s=30)
    receiver.register(KVLayout([torch.zeros_like(t) for t in layers], 0))
    sender = create_sender("ucx", timeout_s=1.0)
    sender.register(KVLayout(layers, 0))
    try:
        desc = dict(receiver.expect("r", list(range(64)), [0, 1]))
        # Data tags no receive in this process is posted under: another token's (the receiver
        # drops this sender's control messages too). Stale sends under a used serial would be
        # taken by the next test's receives.
        desc["tok"] = wire.new_token()
        sender.start("r", desc)
        for layer in (0, 1):
            sender.send_layer("r", layer, list(range(64)))
        sender.finish("r")
        status = sender.wait("r", 10)
        assert status.state is TransferState.FAILED and "lease expired" in status.reason
        pending, interval = ucx.runtime().submit(_stale_polling(0.25)).result(60)
        assert pending >= 2, "the sends completed: this test no longer has stale sends"
        assert interval >= 0.25
    finally:
        sender.close()
        receiver.close()


async def _stale_polling(enough_s: float) -> tuple[int, float]:
    """(data sends pending, reaping interval) once the interval reached ``enough_s`` or 30 s passed."""
    import asyncio

    from kvtransfer import ucx

    drv = ucx.driver()
    for _ in range(3000):
        if drv._data_poll_s >= enough_s:
            break
        await asyncio.sleep(0.01)
    return len(drv._data_pending), drv._data_poll_s
