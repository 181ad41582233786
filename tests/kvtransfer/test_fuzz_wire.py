"""Fuzzing the kvtransfer control messages (kvtransfer/wire.py) and a live tcp receiver.

The decoders take random bytes, random msgpack values and valid messages of every kind with
fields dropped or replaced; each ends in a WireError or a message its schema accepts (and that
encodes back to the same). Then a real tcp receiver waiting for a transfer gets fuzzed
connections (frames, data runs, garbage, short frames) from a peer without the transfer's token:
every connection is closed promptly, nothing escapes its handler, no byte of the cache is
written, the transfer is still waiting, and the introduced sender then completes it."""

from __future__ import annotations

import itertools
import logging
import socket

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtransfer import KVLayout, TransferState, create_receiver, create_sender, wire
from tests.fuzz import VALUES, fuzz_settings, mutated, packb
from tests.kvtransfer.peer import block_bytes, make_cache

TOK = b"k" * wire.TOKEN_BYTES
VALID = {
    "desc": wire.make("desc", rid="r", tok=TOK, backend="tcp", addr="127.0.0.1:1", tag=0, lanes=[],
                      layers=[0, 1], blocks=[4, 5], layout=[[1, 2]], skip=0),
    "begin": wire.make("begin", rid="r", tok=TOK, reply="", ack_tag=0, nblocks=3),
    "layers": wire.make("layers", rid="r", tok=TOK, layers=[0, 1], runs=[[0, 3]]),
    "data": wire.make("data", rid="r", layer=0, run=0, nbytes=64),
    "finish": wire.make("finish", rid="r", tok=TOK, layers=4),
    "abort": wire.make("abort", rid="r", tok=TOK, reason="x"),
    "ack": wire.make("ack", rid="r", tok=TOK, ok=True, reason=""),
    "error": wire.make("error", reason="x"),
}
EDGE_INTS = st.sampled_from([-1, 0, 1, 3, 4, 2**32, 2**64 - 1]) | st.integers(-(2**63), 2**64 - 1)
FIELD_VALUES = VALUES | EDGE_INTS | st.lists(EDGE_INTS, max_size=4) | st.binary(min_size=15, max_size=17)
MESSAGES = st.sampled_from(sorted(VALID)).flatmap(lambda kind: mutated(VALID[kind], FIELD_VALUES))


def read(decoder, data: bytes) -> None:
    try:
        msg = decoder(data)
    except wire.WireError:
        return
    assert wire.check(dict(msg)) == msg
    assert wire.decode(wire.encode(msg)) == msg


@fuzz_settings(300)
@given(st.binary(max_size=256))
def test_random_bytes(data: bytes) -> None:
    for decoder in (wire.decode, wire.unframe, wire.unseal):
        read(decoder, data)


def read_packed(value: object) -> None:
    """`value` packed, as a bare body and as a framed one."""
    body = packb(value)
    read(wire.decode, body)
    read(wire.unframe, wire.HEADER.pack(len(body)) + body)


@fuzz_settings(300)
@given(VALUES)
def test_any_msgpack_value(value: object) -> None:
    read_packed(value)


@fuzz_settings(500)
@given(MESSAGES)
def test_every_kind_with_fields_dropped_or_replaced(obj: dict) -> None:
    read_packed(obj)


# ---- a live tcp receiver ------------------------------------------------------------------
NUM_BLOCKS, LAYERS, DST = 16, [0, 1, 2, 3], [4, 5, 6]


@st.composite
def chunk(draw: st.DrawFn, rid: str) -> bytes:
    """One piece of what a stranger sends: a framed message (its token is never the real one),
    a data header and some bytes, a frame cut short, or garbage."""
    kind = draw(st.sampled_from(["msg", "msg", "data", "short", "garbage"]))
    if kind == "msg":
        obj = draw(MESSAGES)
        if "rid" in obj and draw(st.booleans()):
            obj["rid"] = rid
        body = packb(obj)
        return wire.HEADER.pack(len(body)) + body
    if kind == "data":
        n = draw(st.integers(0, 512))
        body = packb(wire.make("data", rid=rid, layer=draw(st.integers(0, 5)), run=draw(st.integers(0, 3)), nbytes=n))
        return wire.HEADER.pack(len(body)) + body + draw(st.binary(min_size=n, max_size=n))
    if kind == "short":
        return wire.HEADER.pack(draw(st.integers(1, wire.MAX_MESSAGE_BYTES + 8))) + draw(st.binary(max_size=8))
    return draw(st.binary(max_size=64))


class _Errors(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture(scope="module")
def tcp_receiver():
    dst, dims = make_cache(NUM_BLOCKS, seed=None)
    # "r" waits through the whole fuzz for its real sender (the last test): longer than a long run
    receiver = create_receiver("tcp", timeout_s=3600)
    receiver.register(KVLayout(dst, dims))
    desc = receiver.expect("r", DST, LAYERS)
    errors = _Errors()
    logging.getLogger().addHandler(errors)
    yield receiver, desc, dst, dims, errors
    logging.getLogger().removeHandler(errors)
    receiver.close()


def send_and_close(addr: str, data: bytes) -> None:
    """Send `data`, end our side, and wait for the receiver to close the connection (5 s at most)."""
    host, port = addr.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
            while sock.recv(65536):
                pass
        except ConnectionResetError:
            pass  # it closed on us while we were still sending: closed is what we wait for
        except TimeoutError:
            pytest.fail("the receiver kept a fuzzed connection open")


@fuzz_settings(150)
@given(st.lists(chunk("r"), min_size=1, max_size=4))
def test_fuzzed_connections_never_write_and_the_real_transfer_completes(tcp_receiver, chunks: list[bytes]) -> None:
    receiver, desc, dst, dims, errors = tcp_receiver
    send_and_close(desc["addr"], b"".join(chunks))
    assert not errors.records, [r.getMessage() for r in errors.records]
    assert receiver.poll("r").state is TransferState.WAITING


OWN = [8, 9, 10]  # the blocks of the transfers an introduced but misbehaving sender fuzzes
RUNS = st.sampled_from([[[0, 1], [1, 2]], [[0, 2]], [[1, 2]], [[0, 4]], []]) | st.lists(
    st.lists(st.integers(0, 4), min_size=2, max_size=2), max_size=3)


def run_bytes(layer: int, count: int) -> int:
    dst, dims = make_cache(NUM_BLOCKS, seed=None)
    return count * len(block_bytes(dst, dims, layer, [0]))


@st.composite
def session(draw: st.DrawFn, rid: str, tok: bytes) -> bytes:
    """What a sender holding the token might send: a valid transfer of some layers (begin, an
    announce and a data run per layer, finish), each message's values perturbed now and then
    (counts, layers, runs and sizes at and past their bounds), messages dropped or repeated."""
    def maybe(value: object, other: st.SearchStrategy) -> object:
        return draw(other) if draw(st.integers(0, 4)) == 0 else value

    layers = draw(st.lists(st.sampled_from(LAYERS), min_size=1, max_size=4, unique=True))
    msgs: list[tuple[dict, int]] = [(wire.make("begin", rid=rid, tok=tok, reply="", ack_tag=0,
                                               nblocks=maybe(3, st.integers(0, 5))), 0)]
    for layer in layers:
        msgs.append((wire.make("layers", rid=rid, tok=tok, layers=maybe([layer], st.lists(st.integers(0, 5), max_size=3)),
                               runs=maybe([[0, 3]], RUNS)), 0))
        n = maybe(run_bytes(layer, 3), st.integers(0, 2048) | st.sampled_from([run_bytes(x, 1) for x in LAYERS]))
        msgs.append((wire.make("data", rid=rid, layer=maybe(layer, st.integers(0, 5)), run=maybe(0, st.integers(0, 3)),
                               nbytes=n), n))
    msgs.append((wire.make("finish", rid=rid, tok=tok, layers=maybe(len(layers), st.integers(0, 5))), 0))
    if draw(st.integers(0, 3)) == 0:
        msgs.insert(draw(st.integers(0, len(msgs))), (wire.make("abort", rid=rid, tok=tok, reason="fuzz"), 0))
    if draw(st.integers(0, 3)) == 0:
        msgs.insert(draw(st.integers(0, len(msgs))), msgs[draw(st.integers(0, len(msgs) - 1))])
    if draw(st.integers(0, 3)) == 0:
        del msgs[draw(st.integers(0, len(msgs) - 1))]
    return b"".join(wire.frame(m) + b"\xab" * n for m, n in msgs)


_OWN_IDS = itertools.count()  # unique request ids: the receiver forgets finished ones, so its size repeats


@fuzz_settings(120)
@given(st.data())
def test_a_sender_with_the_token_writes_only_its_own_blocks(tcp_receiver, data: st.DataObject) -> None:
    receiver, _desc, dst, dims, errors = tcp_receiver
    rid = f"own-{next(_OWN_IDS)}"
    desc = receiver.expect(rid, OWN, LAYERS)
    send_and_close(desc["addr"], data.draw(session(rid, desc["tok"])))
    assert not errors.records, [r.getMessage() for r in errors.records]
    if not receiver.poll(rid).state.terminal:
        receiver.abort(rid, "fuzz case over")


def test_after_the_fuzz_the_cache_is_untouched_and_the_introduced_sender_completes(tcp_receiver) -> None:
    receiver, desc, dst, dims, errors = tcp_receiver
    others = [b for b in range(NUM_BLOCKS) if b not in OWN]
    assert all(not any(block_bytes(dst, dims, layer, others)) for layer in LAYERS)
    assert any(any(block_bytes(dst, dims, layer, OWN)) for layer in LAYERS), "the fuzz never reached a write"
    src, _ = make_cache(NUM_BLOCKS, seed=1)
    sender = create_sender("tcp", timeout_s=10)
    sender.register(KVLayout(src, dims))
    try:
        sender.start("r", desc)
        for layer in LAYERS:
            sender.send_layer("r", layer, [1, 2, 3])
        sender.finish("r")
        assert sender.wait("r", 10).state is TransferState.DONE
        assert receiver.wait("r", 5).state is TransferState.DONE
        for layer in LAYERS:
            assert block_bytes(dst, dims, layer, DST) == block_bytes(src, dims, layer, [1, 2, 3])
    finally:
        sender.close()
    assert not errors.records
