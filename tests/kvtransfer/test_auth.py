"""KV transfers are accepted only from senders the router introduced: a sender that holds the
descriptor's public parts (address, control tag, lanes, blocks, layout, request id) but not its
transfer token, or none at all, cannot write a block, cannot end the transfer, and the receiver
then completes the real one."""

from __future__ import annotations

import socket

import pytest

from kvtransfer import KVLayout, TransferState, create_receiver, create_sender, wire
from tests.kvtransfer.peer import block_bytes, make_cache

NUM_BLOCKS = 16
LAYERS = [0, 1, 2, 3]
DST = [4, 5, 6]
TIMEOUT = 1.5  # the intruder's lease: its transfer fails when it runs out
NO_TIMER = 60.0  # the receiver and the introduced sender: no timer ends their transfer first


def _endpoints(backend: str):
    dst, dims = make_cache(NUM_BLOCKS, seed=None)
    receiver = create_receiver(backend, timeout_s=NO_TIMER)  # outlives the intruder's lease
    receiver.register(KVLayout(dst, dims))
    senders = []
    for seed, timeout_s in ((1, NO_TIMER), (2, TIMEOUT)):  # 1: the introduced sender; 2: the intruder (other bytes)
        src, _ = make_cache(NUM_BLOCKS, seed=seed)
        sender = create_sender(backend, timeout_s=timeout_s)
        sender.register(KVLayout(src, dims))
        senders.append((sender, src))
    return receiver, dst, dims, senders


def _send(sender, rid: str, desc: dict) -> TransferState:
    sender.start(rid, desc)
    for layer in LAYERS:
        sender.send_layer(rid, layer, [1, 2, 3])
    sender.finish(rid)
    return sender.wait(rid, NO_TIMER).state


@pytest.mark.parametrize("backend", ["tcp", "ucx", "local"])
def test_a_sender_without_the_token_cannot_write_a_block(backend: str) -> None:
    receiver, dst, dims, [(good, src), (intruder, _)] = _endpoints(backend)
    try:
        desc = receiver.expect("r", DST, LAYERS)
        forged = {**desc, "tok": wire.new_token()}
        assert _send(intruder, "r", forged) is TransferState.FAILED  # refused, or no ack till its lease
        assert all(not any(block_bytes(dst, dims, layer, DST)) for layer in LAYERS), "an intruder wrote"
        assert receiver.poll("r").state is TransferState.WAITING  # it could not fail the transfer either
        assert any("token" in e for e in receiver.errors)  # type: ignore[attr-defined]
        assert _send(good, "r", desc) is TransferState.DONE
        assert receiver.wait("r", NO_TIMER).state is TransferState.DONE
        for layer in LAYERS:
            assert block_bytes(dst, dims, layer, DST) == block_bytes(src, dims, layer, [1, 2, 3])
    finally:
        for s, _ in (good, None), (intruder, None):
            s.close()
        receiver.close()


def _raw_tcp(addr: str, *msgs: dict) -> dict:
    host, port = addr.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        for msg in msgs:
            sock.sendall(msg if isinstance(msg, bytes) else wire.frame(msg))
        reply = sock.makefile("rb").read()  # until the receiver closes
    return wire.decode(reply[4: 4 + wire.frame_length(reply[:4])])


def test_tcp_data_only_on_the_connection_that_began() -> None:
    receiver, dst, dims, [(good, src), (other, _)] = _endpoints("tcp")
    try:
        desc = receiver.expect("r", DST, LAYERS)
        tok = desc["tok"]
        run = wire.make("data", rid="r", layer=0, run=0, nbytes=len(block_bytes(dst, dims, 0, DST)))
        reply = _raw_tcp(desc["addr"], run, b"\xff" * run["nbytes"])  # data with no begin
        assert reply["t"] == "error" and "did not begin on" in reply["reason"]
        begin = wire.make("begin", rid="r", tok=bytes(16), reply="", ack_tag=0, nblocks=len(DST))
        assert "without the transfer's token" in _raw_tcp(desc["addr"], begin)["reason"]
        no_token = {"v": wire.VERSION, "t": "begin", "rid": "r", "reply": "", "ack_tag": 0, "nblocks": 3}
        import msgpack

        body = msgpack.packb(no_token)
        assert "fields" in _raw_tcp(desc["addr"], wire.HEADER.pack(len(body)) + body)["reason"]
        assert not any(block_bytes(dst, dims, 0, DST)) and receiver.poll("r").state is TransferState.WAITING
        assert _send(good, "r", desc) is TransferState.DONE and tok == desc["tok"]
        assert block_bytes(dst, dims, 0, DST) == block_bytes(src, dims, 0, [1, 2, 3])
    finally:
        good.close()
        other.close()
        receiver.close()


def test_tokens_and_their_serials_are_unique_and_unpredictable() -> None:
    receiver, _dst, _dims, senders = _endpoints("local")
    try:
        descs = [receiver.expect(f"r{i}", [i % NUM_BLOCKS], [0]) for i in range(200)]
        toks = [d["tok"] for d in descs]
        assert len(set(toks)) == 200 and all(len(t) == wire.TOKEN_BYTES for t in toks)
        serials = [wire.token_serial(t) for t in toks]
        assert len(set(serials)) == 200
        assert sum(b - a == 1 for a, b in zip(serials, serials[1:], strict=False)) == 0  # no counter
    finally:
        for s, _ in senders:
            s.close()
        receiver.close()
