"""A device error in a node's step (the `fail_next_step` test hook raising torch.AcceleratorError, what
a CUDA fault raises) on real tiny nodes in this process, behind a real router: the node's loop ends
(in a node actor the process then exits and Ray starts it again: tests/e2e/test_faults.py). Its
Status says unhealthy, it takes no more work (UNAVAILABLE), a decode node's streams end, so the
router takes it out and its requests end with one terminal each (no other node to move to here);
the router's view lists the failure, and the other node's KV blocks all come back."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from router.client import RouterClient, build_request
from tests.router.real_service import RealService


@pytest.fixture
def svc():
    service = RealService(k=2, node_wait_s=0.3)
    yield service
    service.close()


def _error(msgs: list) -> tuple[str, str]:
    terminals = [m for m in msgs if m.HasField("error") or m.HasField("finished")]
    assert len(terminals) == 1 and terminals[0] is msgs[-1], msgs
    return msgs[-1].error.code, msgs[-1].error.message


def test_a_device_error_in_a_decode_step_takes_the_node_out_and_ends_its_streams(svc):
    prefill, decode = svc.nodes

    async def main() -> list:
        async with RouterClient(f"127.0.0.1:{svc.router.grpc_port}") as client:
            msgs = []
            async for m in client.stream(build_request("ab", max_tokens=100, ignore_eos=True)):
                msgs.append(m)
                if len(msgs) == 1:  # the first token (from P): D fails before it could finish
                    decode.fail_next_step(torch.AcceleratorError("CUDA error: an illegal memory access (test)"))
            return msgs

    code, message = _error(asyncio.run(main()))
    assert code == "UNAVAILABLE" and "decode node" in message
    assert isinstance(decode.loop_error, torch.AcceleratorError)
    [node] = [n for (kind, _), n in svc.router.pool.nodes.items() if kind == "decode"]
    svc.call(svc.router.refresh())  # its Status now says unhealthy: it stays out
    assert not node.healthy and node.downs == 1 and node.status is not None and not node.status.healthy
    assert [d["address"] for d in svc.router.pool.recent_downs] == [node.address]
    assert prefill.blocks.num_free == prefill.blocks.capacity


def test_a_device_error_in_a_prefill_step_takes_the_node_out_and_frees_the_reservation(svc):
    prefill, decode = svc.nodes
    prefill.fail_next_step(torch.AcceleratorError("CUDA error: an illegal memory access (test)"))

    async def main() -> list:
        async with RouterClient(f"127.0.0.1:{svc.router.grpc_port}") as client:
            return [m async for m in client.stream(build_request("ab", max_tokens=8))]

    code, message = _error(asyncio.run(main()))
    # the Prefill request refused, or the node's Status said unhealthy before the request came
    assert code == "UNAVAILABLE" and "prefill" in message
    [node] = [n for (kind, _), n in svc.router.pool.nodes.items() if kind == "prefill"]
    assert not node.healthy and node.downs == 1
    assert svc.call(svc.router.metrics_text())[0].decode().count('pdserve:node_failures_total{kind="prefill"} 1.0') == 1
    assert _decode_free(decode)


def _decode_free(decode, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while decode.blocks.num_free != decode.blocks.capacity:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True
