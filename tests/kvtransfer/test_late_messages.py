"""Messages for a transfer the receiver does not know (never expected, or ended and forgotten) are a
per-transfer condition: the healthy transfers sharing the connection complete with the right bytes,
the late sender learns at once that its transfer failed, and the receiver keeps nothing of it.
Malformed input still closes the connection it came on."""

from __future__ import annotations

import socket
import time

import pytest

from kvtransfer import KVLayout, TransferError, TransferState, create_receiver, create_sender, wire
from tests.kvtransfer.peer import block_bytes, make_cache

NUM_BLOCKS = 16
LAYERS = [0, 1, 2, 3]
NO_TIMER = 60.0  # no timer may end these transfers: a late sender that fails did so on the receiver's word
EXPIRY = 1.5  # the receiver's KV timeout in the expiry tests: the late transfer ends by it
LEARNS_S = 10.0  # a late sender hears of its failure well before its own (NO_TIMER) lease


def _receiver(backend: str, timeout_s: float = NO_TIMER, retain_s: float = 60.0):
    dst, dims = make_cache(NUM_BLOCKS, seed=None)
    receiver = create_receiver(backend, timeout_s=timeout_s, retain_s=retain_s)
    receiver.register(KVLayout(dst, dims))
    return receiver, dst, dims


def _sender(backend: str):
    src, dims = make_cache(NUM_BLOCKS, seed=1)
    sender = create_sender(backend, timeout_s=NO_TIMER)
    sender.register(KVLayout(src, dims))
    return sender, src


def _forgotten(receiver, rid: str) -> None:
    """Wait until the receiver ended ``rid`` and no longer knows it."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            receiver.poll(rid)
        except TransferError:
            return
        time.sleep(0.05)
    pytest.fail(f"the receiver still knows {rid}")


def _late_descriptor(receiver, how: str) -> dict:
    """A descriptor the receiver does not know by the time its sender begins."""
    if how == "never expected":
        desc = dict(receiver.expect("probe", [12, 13], LAYERS))
        receiver.abort("probe")
        return {**desc, "rid": "late", "tok": wire.new_token()}
    desc = dict(receiver.expect("late", [12, 13], LAYERS))
    assert receiver.wait("late", 10 * EXPIRY).state is TransferState.FAILED  # no sender came in time
    _forgotten(receiver, "late")
    return desc


@pytest.mark.parametrize("how", ["never expected", "expired"])
@pytest.mark.parametrize("backend", ["tcp", "ipc"])
def test_a_late_transfer_fails_alone_on_a_shared_connection(backend: str, how: str) -> None:
    receiver, dst, dims = _receiver(backend, timeout_s=EXPIRY if how == "expired" else NO_TIMER, retain_s=0.1)
    sender, src = _sender(backend)
    try:
        late = _late_descriptor(receiver, how)
        sender.start("ok", receiver.expect("ok", [4, 5, 6], LAYERS))
        sender.send_layer("ok", 0, [1, 2, 3])
        sender.start("late", late)  # the same sender: the same connection as "ok"
        for layer in LAYERS:
            sender.send_layer("late", layer, [7, 8])
        sender.finish("late")
        status = sender.wait("late", LEARNS_S)
        assert status.state is TransferState.FAILED and "unknown or expired" in status.reason, status
        for layer in LAYERS[1:]:
            sender.send_layer("ok", layer, [1, 2, 3])
        sender.finish("ok")
        assert sender.wait("ok", NO_TIMER).state is TransferState.DONE
        assert receiver.wait("ok", NO_TIMER).state is TransferState.DONE
        for layer in LAYERS:
            assert block_bytes(dst, dims, layer, [4, 5, 6]) == block_bytes(src, dims, layer, [1, 2, 3])
        assert not receiver.errors and receiver.strays >= 2  # type: ignore[attr-defined]  # begin and finish
        assert set(receiver._in) <= {"ok", "probe"}  # type: ignore[attr-defined]  # nothing kept of "late"
    finally:
        sender.close()
        receiver.close()


def test_ucx_late_begin_is_answered_on_a_known_peer() -> None:
    """Ucx has no connection to close, but a late sender waited for its own lease: it is told now
    when the receiver already talks to it (no endpoint is made for an unknown transfer's address)."""
    pytest.importorskip("ucxx")
    receiver, dst, dims = _receiver("ucx", retain_s=0.1)
    sender, src = _sender("ucx")
    try:
        sender.start("ok", receiver.expect("ok", [4, 5, 6], LAYERS))
        for layer in LAYERS:
            sender.send_layer("ok", layer, [1, 2, 3])
        sender.finish("ok")
        assert sender.wait("ok", NO_TIMER).state is TransferState.DONE  # the receiver knows this sender now
        late = _late_descriptor(receiver, "never expected")
        sender.start("late", late)
        sender.finish("late")
        status = sender.wait("late", LEARNS_S)
        assert status.state is TransferState.FAILED and "unknown or expired" in status.reason, status
        assert not receiver.errors and receiver.strays >= 1  # type: ignore[attr-defined]
    finally:
        sender.close()
        receiver.close()


def _frames(sock: socket.socket, count: int) -> list[dict]:
    reader, msgs = sock.makefile("rb"), []
    for _ in range(count):
        msgs.append(wire.decode(reader.read(wire.frame_length(reader.read(wire.HEADER.size)))))
    return msgs


def test_tcp_stray_messages_keep_the_stream_in_frame() -> None:
    """A raw peer: a begin, layers, data (with its bytes) and finish for an unknown request are
    dropped in frame, the begin and finish answered with a failure under their own token, and the
    connection still serves."""
    receiver, dst, dims = _receiver("tcp")
    try:
        desc = receiver.expect("probe", [1], LAYERS)
        host, port = desc["addr"].rsplit(":", 1)
        tok = wire.new_token()
        nbytes = len(block_bytes(dst, dims, 0, [1]))
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(wire.frame(wire.make("begin", rid="ghost", tok=tok, reply="", ack_tag=0, nblocks=1)))
            sock.sendall(wire.frame(wire.make("layers", rid="ghost", tok=tok, layers=[0], runs=[[0, 1]])))
            sock.sendall(wire.frame(wire.make("data", rid="ghost", layer=0, run=0, nbytes=nbytes)) + b"\xff" * nbytes)
            sock.sendall(wire.frame(wire.make("finish", rid="ghost", tok=tok, layers=1)))
            sock.sendall(wire.frame(wire.make("begin", rid="ghost-2", tok=tok, reply="", ack_tag=0, nblocks=1)))
            nacks = _frames(sock, 3)  # the third: the connection still reads after the data
        assert [m["rid"] for m in nacks] == ["ghost", "ghost", "ghost-2"]
        assert all(m["t"] == "ack" and not m["ok"] and m["tok"] == tok for m in nacks)
        assert not any(block_bytes(dst, dims, 0, list(range(NUM_BLOCKS))))
        assert not receiver.errors and receiver.strays == 5  # type: ignore[attr-defined]
        assert receiver.poll("probe").state is TransferState.WAITING
    finally:
        receiver.close()


def test_tcp_data_beyond_any_run_still_closes_the_connection() -> None:
    receiver, _, _ = _receiver("tcp")
    try:
        desc = receiver.expect("probe", [1], LAYERS)
        host, port = desc["addr"].rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(wire.frame(wire.make("data", rid="ghost", layer=0, run=0, nbytes=1 << 40)))
            reply = sock.makefile("rb").read()  # until the receiver closes
        msg = wire.decode(reply[4 : 4 + wire.frame_length(reply[:4])])
        assert msg["t"] == "error" and "bytes" in msg["reason"]
        assert receiver.poll("probe").state is TransferState.WAITING
    finally:
        receiver.close()
