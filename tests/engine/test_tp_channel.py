"""The TP control channel over a real gloo group of 2 local processes: rank 0's value reaches
every rank, every rank's (of different sizes) reaches all, msgpack only; and a TP decode node's
descriptor splits back into each rank's own."""

from __future__ import annotations

from engine.tp.channel import TPChannel, rank_descriptor, with_ranks
from engine.tp.launch import spawn_ranks
from engine.tp.tensor_parallel import TPGroup


def _exchange(tp: TPGroup) -> tuple:
    channel = TPChannel(tp)
    sent = {"cmds": [["first", b"\x00\x01" * 300], ["abort", "r1", "gone"]], "now": 1.5} if tp.rank == 0 else None
    got = channel.broadcast(sent)
    every = channel.gather({"rank": tp.rank, "pad": "x" * (1000 * tp.rank)})
    return got, every


def test_broadcast_and_gather_over_gloo():
    (got0, every0), (got1, every1) = spawn_ranks(2, _exchange)
    assert got0 == got1 == {"cmds": [["first", b"\x00\x01" * 300], ["abort", "r1", "gone"]], "now": 1.5}
    assert every0 == every1 == [{"rank": 0, "pad": ""}, {"rank": 1, "pad": "x" * 1000}]


def test_a_tp_descriptor_splits_into_each_ranks_own():
    descs = [{"addr": "a:1", "tok": b"t0"}, {"addr": "a:2", "tok": b"t1"}]
    joined = with_ranks(descs)
    assert [rank_descriptor(joined, r, 2) for r in range(2)] == descs
    assert rank_descriptor(joined, 0, 4) == {} and rank_descriptor(descs[0], 1, 2) == {}  # wrong TP sizes
    assert rank_descriptor(joined, 0, 1) == {} and rank_descriptor(descs[0], 0, 1) == descs[0]
