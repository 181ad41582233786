"""GPU only (skipped without CUDA): tcp moves CUDA KV blocks exactly (staged through host memory,
kvtransfer/tcp.py) while other work is queued on the device's default stream, each layer sent once
an event recorded after its data has passed."""

from __future__ import annotations

import pytest
import torch

from kvtransfer import KVLayout, TransferState, create_receiver, create_sender
from tests.kvtransfer.peer import block_bytes, make_cache
from tests.kvtransfer.test_transfer import LAYERS, NUM_BLOCKS, block_maps

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def to(layers, device):
    return [tuple(t.to(device) for t in x) if isinstance(x, tuple) else x.to(device) for x in layers]


def test_tcp_moves_cuda_blocks_exactly_while_the_default_stream_is_busy():
    src_cpu, dims = make_cache(NUM_BLOCKS, seed=1)
    src, dst = to(src_cpu, "cuda"), to(make_cache(NUM_BLOCKS, seed=None)[0], "cuda")
    receiver, sender = create_receiver("tcp", timeout_s=30), create_sender("tcp", timeout_s=30)
    receiver.register(KVLayout(dst, dims))
    sender.register(KVLayout(src, dims))
    busy = torch.randn(4096, 4096, device="cuda")
    try:
        maps = block_maps(seed=7, requests=6)
        for i, (_, dst_ids) in enumerate(maps):
            sender.start(f"r{i}", receiver.expect(request_id=f"r{i}", dst_block_ids=dst_ids, layers=LAYERS))
        for layer in LAYERS:
            ready = torch.cuda.Event()
            ready.record()  # the layer's data is ready here; more work follows on the default stream
            for _ in range(20):
                busy = busy @ busy / 64
            for i, (src_ids, _) in enumerate(maps):
                sender.send_layer(f"r{i}", layer, src_ids, ready=ready)
        for i in range(len(maps)):
            sender.finish(f"r{i}")
        for i in range(len(maps)):
            assert sender.wait(f"r{i}", 30).state is TransferState.DONE
            assert receiver.wait(f"r{i}", 30).state is TransferState.DONE
        torch.cuda.synchronize()
        got = to(dst, "cpu")
        for src_ids, dst_ids in maps:
            for layer in LAYERS:
                assert block_bytes(got, dims, layer, dst_ids) == block_bytes(src_cpu, dims, layer, src_ids)
    finally:
        sender.close()
        receiver.close()
