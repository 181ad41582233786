"""KV transfers through a sender whose links drop, delay, duplicate and truncate messages
(kvtransfer/faults.py) over the real tcp and ucx transports: every transfer ends on both sides
in time, and one the receiver calls DONE holds exactly the sender's bytes (a fault may fail a
transfer, never corrupt one); a failed transfer writes nothing outside its own blocks."""

from __future__ import annotations

import pytest

from kvtransfer import KVLayout, TransferState, create_receiver, create_sender
from tests.kvtransfer.peer import block_bytes, make_cache

NUM_BLOCKS, LAYERS, TIMEOUT = 64, [0, 1, 2, 3], 2.0
FAULTS = {"drop": 0.03, "delay": 0.05, "duplicate": 0.03, "truncate": 0.03, "delay_s": 0.02, "seed": 7}
UCX_FAULTS = {**FAULTS, "truncate": 0.0}  # see kvtransfer/faults.py: not a wire fault on ucx


@pytest.mark.parametrize("backend,faults", [("tcp", FAULTS), ("ucx", UCX_FAULTS)])
def test_injected_faults_fail_transfers_but_never_corrupt_them(backend: str, faults: dict) -> None:
    dst, dims = make_cache(NUM_BLOCKS, seed=None)
    src, _ = make_cache(NUM_BLOCKS, seed=1)
    receiver = create_receiver(backend, timeout_s=TIMEOUT)
    receiver.register(KVLayout(dst, dims))
    sender = create_sender(backend, timeout_s=TIMEOUT, faults=faults)
    sender.register(KVLayout(src, dims))
    states = []
    try:
        for i in range(20):  # one at a time: each owns blocks 3i..3i+2 on both sides
            blocks = [3 * i, 3 * i + 1, 3 * i + 2]
            desc = receiver.expect(f"r{i}", blocks, LAYERS)
            sender.start(f"r{i}", desc)
            for layer in LAYERS:
                sender.send_layer(f"r{i}", layer, blocks)
            sender.finish(f"r{i}")
            sent = sender.wait(f"r{i}", 4 * TIMEOUT).state
            got = receiver.wait(f"r{i}", 4 * TIMEOUT).state
            assert sent.terminal and got.terminal, (i, sent, got)
            if got is TransferState.DONE:
                assert all(block_bytes(dst, dims, L, blocks) == block_bytes(src, dims, L, blocks) for L in LAYERS)
            states.append(got)
    finally:
        sender.close()
        receiver.close()
    assert TransferState.DONE in states and TransferState.FAILED in states, states  # faults did happen
    untouched = list(range(60, NUM_BLOCKS))
    assert all(not any(block_bytes(dst, dims, L, untouched)) for L in LAYERS)
