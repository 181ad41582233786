"""wire.py: msgpack with a version, every field validated."""

from __future__ import annotations

import msgpack
import pytest

from kvtransfer import wire

TOK = b"t" * wire.TOKEN_BYTES


def test_round_trip() -> None:
    msg = wire.make("layers", rid="r1", tok=TOK, layers=[3, 4], runs=[[0, 4], [4, 1]])
    assert wire.decode(wire.encode(msg)) == msg
    assert wire.unframe(wire.frame(msg) + b"pad") == msg
    assert wire.unseal(wire.seal(msg) + b"\0" * 16) == msg


@pytest.mark.parametrize("bad,text", [
    ({"v": wire.VERSION + 1, "t": "finish", "rid": "r", "layers": 1}, "wrong version"),
    ({"v": wire.VERSION, "t": "exec", "rid": "r"}, "unknown message type"),
    ({"v": wire.VERSION, "t": "finish", "rid": "r"}, "fields"),
    ({"v": wire.VERSION, "t": "finish", "rid": "r", "tok": TOK, "layers": 1, "x": 0}, "fields"),
    ({"v": wire.VERSION, "t": "finish", "rid": "r", "tok": TOK, "layers": -1}, "bad value"),
    ({"v": wire.VERSION, "t": "finish", "rid": "r", "tok": TOK, "layers": True}, "bad value"),
    ({"v": wire.VERSION, "t": "layers", "rid": "r", "tok": TOK, "layers": [0], "runs": [[0, 1, 2]]}, "bad value"),
    ({"v": wire.VERSION, "t": "begin", "rid": "r", "reply": "", "ack_tag": 0, "nblocks": 1}, "fields"),  # no token
    ({"v": wire.VERSION, "t": "finish", "rid": "r", "tok": b"short", "layers": 1}, "bad value for 'tok'"),
    ({"v": wire.VERSION, "t": "finish", "rid": "r", "tok": "t" * 16, "layers": 1}, "bad value for 'tok'"),
    ([1, 2], "not a map"),
])
def test_invalid_messages_are_named(bad: object, text: str) -> None:
    with pytest.raises(wire.WireError, match=text):
        wire.decode(msgpack.packb(bad))


def test_oversized_garbage_and_corrupt_frames() -> None:
    with pytest.raises(wire.WireError, match="over"):
        wire.decode(b"\0" * (wire.MAX_MESSAGE_BYTES + 1))
    with pytest.raises(wire.WireError, match="not msgpack"):
        wire.decode(b"\xc1")
    sealed = bytearray(wire.seal(wire.make("error", reason="x")))
    sealed[-1] ^= 1
    with pytest.raises(wire.WireError, match="checksum"):
        wire.unseal(sealed)


def test_descriptor_skip_is_a_required_non_negative_int() -> None:
    desc = wire.make("desc", rid="r", tok=TOK, backend="tcp", addr="127.0.0.1:1", tag=0, lanes=[],
                     layers=[0], blocks=[5, 6], layout=[[1, 2]], skip=3)
    assert wire.decode(wire.encode(desc))["skip"] == 3
    for bad, text in [({"skip": -1}, "bad value for 'skip'"), ({"skip": True}, "bad value for 'skip'"),
                      ({"skip": "3"}, "bad value for 'skip'")]:
        with pytest.raises(wire.WireError, match=text):
            wire.check({**desc, **bad})
    with pytest.raises(wire.WireError, match="fields"):
        wire.check({k: v for k, v in desc.items() if k != "skip"})


@pytest.mark.parametrize("layout", [[[1], [True]], [[1], (2,)], [[1], [-1]], [[1.0]], [[1 << 64]], [1], "11"])
def test_a_descriptor_layout_of_anything_but_int_lists_is_refused(layout: object) -> None:
    desc = wire.make("desc", rid="r", tok=TOK, backend="tcp", addr="127.0.0.1:1", tag=0, lanes=[],
                     layers=[0, 1], blocks=[5], layout=[[1, 2], []], skip=0)
    with pytest.raises(wire.WireError, match="bad value for 'layout'"):
        wire.check({**desc, "layout": layout})
