"""Committed gRPC stubs match the .proto files; msgpack node messages and packed token ids
round-trip and reject malformed, oversized, wrong-version and out-of-range input."""

from __future__ import annotations

import struct
from pathlib import Path

import msgpack
import pytest

from protos import build, node_pb2
from protos.convert import pack_token_ids, unpack_token_ids
from protos.messages import (
    FirstToken,
    MessageError,
    OutputItem,
    TokenLogprobs,
    pack_meta,
    pack_outputs,
    read_outputs,
    unpack_meta,
    unpack_outputs,
)

VOCAB = 100


def test_committed_stubs_are_fresh(tmp_path):
    generated = build.generate(tmp_path)
    assert generated, "protoc produced nothing"
    for f in generated:
        committed = Path(build.ROOT) / "protos" / f.name
        assert committed.exists(), f"{f.name} is not committed: run `make protos`"
        assert committed.read_bytes() == f.read_bytes(), f"{f.name} is stale: run `make protos`"


def test_meta_word_packs_flag_and_num_logprobs():
    assert unpack_meta(pack_meta(5, 20)) == (5, 20)
    assert pack_meta(3, 2) == 3 | 2 << 8
    with pytest.raises(MessageError):
        pack_meta(256, 0)
    with pytest.raises(MessageError):
        pack_meta(0, 65536)


def lps(n, top):
    return TokenLogprobs([-0.5] * n, [1] * n, [[i + 1 for i in range(top)]] * n, [[-1.0] * top] * n)


def test_first_token_round_trip():
    msg = FirstToken("r1", 7, 3, lps(1, 3), [1, 2], struct.pack("<200f", *([0.01] * 200)))
    back = FirstToken.unpack(msg.pack(), VOCAB, max_drafts=2)
    assert back == msg
    plain = FirstToken("r2", 9, None, None, [], b"", finished="stop")
    assert FirstToken.unpack(plain.pack(), VOCAB, 4) == plain
    hit = FirstToken("r3", 9, None, None, [], b"", cached_tokens=32)  # a prefix-cache hit on P
    assert FirstToken.unpack(hit.pack(), VOCAB, 4) == hit


def test_output_batch_round_trip_reads_exactly_the_asked_columns():
    items = [OutputItem("a", [1, 2, 3], 2, lps(3, 2)), OutputItem("b", [4], None, None, "stop", steps=3, accepted=2),
             OutputItem("c", [], error="decode node failed")]
    assert unpack_outputs(pack_outputs(items), VOCAB) == items


def test_output_item_leaves_out_its_default_fields():
    """A step's plain item is three keys on the wire; every other field comes back as sent."""
    assert set(OutputItem("a", [1]).to_obj()) == {"rid", "toks", "meta"}
    assert set(OutputItem("a", [1], 0, lps(1, 0)).to_obj()) == {"rid", "toks", "meta", "lp"}
    items = [OutputItem("a", [1, 2], steps=1, accepted=1), OutputItem("b", [3], index=2),
             OutputItem("c", [], finish_reason="abort"), OutputItem("d", [4], 1, lps(1, 1), num_prompt_logprobs=0,
                                                                  prompt_logprobs=lps(2, 0)),
             OutputItem("e", [5], finish_reason="stop", cached_tokens=16)]
    assert unpack_outputs(pack_outputs(items), VOCAB) == items


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda o: o.update(v=2), "version"),
        (lambda o: o.update(tok=VOCAB), "out of range"),
        (lambda o: o.update(meta=1 | 21 << 8), "out of range"),
        (lambda o: o.update(meta=1 | 3 << 8), "expected a list"),  # 3 columns announced, 2 sent
        (lambda o: o.update(drafts=[1, 2, 3, 4, 5]), "at most k"),
        (lambda o: o.update(rid=5), "wrong type"),
        (lambda o: o.update(dprobs=b"xx"), "wrong size"),
        (lambda o: o.update(cached=-1), "cached token count"),
        (lambda o: o.update(cached="16"), "cached token count"),
    ],
)
def test_bad_first_token_is_rejected(mutate, message):
    o = msgpack.unpackb(FirstToken("r", 1, 2, lps(1, 2), [3]).pack())
    mutate(o)
    with pytest.raises(MessageError, match=message):
        FirstToken.unpack(msgpack.packb(o, use_bin_type=True), VOCAB, max_drafts=4)


def test_garbage_and_oversized_are_rejected():
    with pytest.raises(MessageError):
        unpack_outputs(b"\xc1\x00garbage", VOCAB)
    with pytest.raises(MessageError):
        unpack_outputs(b"\x00" * (65 << 20), VOCAB)
    with pytest.raises(MessageError, match="out of range"):
        unpack_outputs(pack_outputs([OutputItem("a", [VOCAB])]), VOCAB)


def test_a_bad_item_that_names_its_request_becomes_its_error_and_the_others_are_read():
    good = [OutputItem("a", [1, 2], 2, lps(2, 2)), OutputItem("c", [3], None, None, "length", steps=1)]
    objs = [good[0].to_obj(), {**good[1].to_obj(), "rid": "b", "toks": [VOCAB]}, good[1].to_obj()]
    data = msgpack.packb({"v": 1, "kind": "outputs", "items": objs}, use_bin_type=True)
    a, b, c = read_outputs(data, VOCAB)
    assert a == good[0] and c == good[1] and not a.malformed
    assert b.request_id == "b" and b.malformed and not b.tokens and "out of range" in b.error
    with pytest.raises(MessageError):  # the strict reader refuses the batch
        unpack_outputs(data, VOCAB)
    for nameless in ({**objs[1], "rid": 5}, [1, 2], {"toks": [1]}, {**objs[1], "rid": ""}):
        data = msgpack.packb({"v": 1, "kind": "outputs", "items": [objs[0], nameless]}, use_bin_type=True)
        with pytest.raises(MessageError):  # nobody to give the error to: the batch is refused
            read_outputs(data, VOCAB)


def test_the_choice_index_and_prompt_logprobs_are_read_by_exact_type():
    item = OutputItem("a", [1], index=2, num_prompt_logprobs=1, prompt_logprobs=lps(3, 1))
    assert unpack_outputs(pack_outputs([item]), VOCAB) == [item]
    obj = item.to_obj()
    for bad in ({"idx": True}, {"idx": 2.0}, {"idx": 16}, {"plp_n": True}, {"plp_top": 1.0},
                {"plp": [[-0.5, True, -0.5], [1, 1, 1], [1, 2, 3], [-0.5] * 3]}):
        data = msgpack.packb({"v": 1, "kind": "outputs", "items": [{**obj, **bad}]}, use_bin_type=True)
        with pytest.raises(MessageError):
            unpack_outputs(data, VOCAB)
        (refused,) = read_outputs(data, VOCAB)  # the router's reader: that request's error only
        assert refused.malformed and refused.request_id == "a" and refused.error and refused.index == 0


def test_a_packed_prompt_round_trips_through_its_proto_field():
    ids = [0, 1, VOCAB - 1, 42] * 300
    wire = node_pb2.PrefillRequest(request_id="r", prompt_token_ids_packed=pack_token_ids(ids)).SerializeToString()
    got = unpack_token_ids(node_pb2.PrefillRequest.FromString(wire).prompt_token_ids_packed, VOCAB)
    assert got == ids and all(type(t) is int for t in got)
    assert len(pack_token_ids(ids)) == 4 * len(ids)
    assert pack_token_ids([1, 256]) == b"\x01\x00\x00\x00\x00\x01\x00\x00"  # little-endian on every host
    assert unpack_token_ids(b"", VOCAB) == []


@pytest.mark.parametrize("data, message", [
    (b"\x01\x00\x00", "not a multiple of 4"),
    (pack_token_ids([1, 2])[:-1], "not a multiple of 4"),
    (pack_token_ids([1, VOCAB]), "outside the vocabulary"),
    (pack_token_ids([-1, 2]), "outside the vocabulary"),
    (struct.pack("<i", 2**31 - 1), "outside the vocabulary"),
])
def test_a_malformed_packed_prompt_is_refused_with_a_clear_error(data, message):
    with pytest.raises(ValueError, match=message):
        unpack_token_ids(data, VOCAB)
