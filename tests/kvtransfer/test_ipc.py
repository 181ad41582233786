"""The ipc backend's own rules: one host only, a pool that stays inside its storages, no data
messages, and the CUDA path between two processes (the byte-exact transfers on the CPU are in
test_transfer.py, beside the other backends)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from bench import kv as bench_kv
from kvtransfer import KVLayout, TransferState, create_receiver, wire
from kvtransfer.peer_pool import PeerPool, PoolError, export, host_id
from kvtransfer.tcp import read_msg


def _layout(blocks: int = 8) -> KVLayout:
    return KVLayout([torch.zeros(2, blocks, 64, dtype=torch.uint8) for _ in range(3)], 1)


def test_a_pool_from_another_host_is_refused() -> None:
    pool = export(_layout())
    pool["host"] = host_id() + "-elsewhere"
    with pytest.raises(PoolError, match="one host"):
        PeerPool.open(pool, _layout())


def test_a_pool_whose_plane_passes_its_storage_is_refused() -> None:
    exported = _layout()  # kept alive: its shared memory goes with it
    pool = export(exported)
    assert PeerPool.open(pool, _layout()).num_blocks == 8
    pool["planes"][2][1][2] = 9  # nine blocks claimed in an eight-block plane
    with pytest.raises(PoolError, match="outside storage"):
        PeerPool.open(pool, _layout())


def test_a_pool_with_another_plane_count_is_refused() -> None:
    exported = _layout()
    pool = export(exported)
    pool["planes"][0].pop()
    with pytest.raises(PoolError, match="planes exported"):
        PeerPool.open(pool, _layout())


def test_the_receiver_takes_no_data_from_the_wire() -> None:
    """A sender with the right token that announces layers (as tcp would) fails its transfer; the
    pool comes once, after the authenticated begin."""
    receiver = create_receiver("ipc", timeout_s=10)
    receiver.register(_layout())
    desc = receiver.expect("r", [1, 2], [0, 1, 2])

    async def talk() -> tuple[str, str]:
        host, port = desc["addr"].rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        auth = {"rid": "r", "tok": desc["tok"]}
        writer.write(wire.frame(wire.make("begin", **auth, reply="", ack_tag=0, nblocks=2)))
        pool = await asyncio.wait_for(read_msg(reader), 10)
        writer.write(wire.frame(wire.make("layers", **auth, layers=[0], runs=[[0, 2]])))
        await writer.drain()
        answer = await asyncio.wait_for(read_msg(reader), 10)  # the connection's error, or a nack
        writer.close()
        assert pool is not None and answer is not None and not answer.get("ok", False)
        return pool["t"], answer["reason"]

    try:
        kind, reason = asyncio.run(talk())
        assert kind == "pool" and "no layers announce" in reason
        status = receiver.wait("r", 10)
        assert status.state is TransferState.FAILED and "no layers announce" in status.reason
    finally:
        receiver.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("isolate", [False, True])
def test_cuda_ipc_between_two_processes_lands_every_byte(isolate: bool) -> None:
    """Sender on cuda:0, receiver on cuda:1 (or the same GPU); both K/V planes of every layer,
    source bytes changed before each transfer, destination hashed against the source."""
    args = ["--backend", "ipc", "--device", "cuda", "--layers", "5", "--planes", "2", "--blocks", "16",
            "--block-bytes", "4096", "--iters", "2", "--rounds", "1", "--json"]
    if isolate and torch.cuda.device_count() > 1:
        args.append("--isolate")
    assert bench_kv.main(args) == 0  # non-zero unless every transfer landed intact
