"""The cluster secret between router and nodes: real P and D behind their gRPC servers on
127.0.0.1 refuse every control call (Reserve, FirstToken, Abort, Outputs, Status, Prefill) that
lacks it with UNAUTHENTICATED, and a real Router that holds it (and P's calls to D) are served."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from decode_node.node import DecodeNode
from decode_node.server import serve_decode
from deploy.config import RouterConfig
from engine.engine import EngineConfig
from engine.model.loader import load_model, load_model_info
from prefill_node.node import PrefillNode
from prefill_node.server import DecodeClients, serve_prefill
from protos import node_pb2, node_pb2_grpc
from protos.convert import pack_token_ids
from protos.serving import with_secret
from router import NodeDirectory, Router
from router.client import RouterClient, RouterError, build_request
from tests.prefill_stream import send_prefill

SECRET = "cluster-secret-for-tests-0123456789"


@pytest.fixture(scope="module")
def nodes():
    loaded = load_model("tiny")
    cfg = EngineConfig(num_speculative_tokens=2)
    decode = DecodeNode(loaded, cfg, kv_backend="tcp", kv_timeout_s=5)
    prefill = PrefillNode(loaded, cfg, DecodeClients(secret=SECRET).send_first_token, kv_backend="tcp",
                          kv_timeout_s=5)
    decode.start()
    prefill.start()
    dserver, dport = serve_decode(decode, "d0", secret=SECRET)
    pserver, pport = serve_prefill(prefill, "p0", secret=SECRET)
    yield f"127.0.0.1:{pport}", f"127.0.0.1:{dport}", decode
    pserver.stop(0)
    dserver.stop(0)
    prefill.stop()
    decode.stop()


CALLS = {
    "Reserve": lambda d, p: d.Reserve(node_pb2.ReserveRequest(
        request_id="r", prompt_len=3, sampling=node_pb2.Sampling(max_tokens=3))),
    "FirstToken": lambda d, p: d.FirstToken(node_pb2.Payload(msgpack=b"")),
    "Abort": lambda d, p: d.Abort(node_pb2.AbortRequest(request_id="r")),
    "Status": lambda d, p: d.Status(node_pb2.StatusRequest()),
    "Outputs": lambda d, p: next(iter(d.Outputs(node_pb2.OutputsRequest(subscriber="x")))),
    "PrefillStream": lambda d, p: send_prefill(p, node_pb2.PrefillRequest(request_id="r", prompt_token_ids_packed=pack_token_ids([1, 2]))),
    "Prefill.Status": lambda d, p: p.Status(node_pb2.StatusRequest()),
}


@pytest.mark.parametrize("secret", [None, "wrong-secret-of-good-length"])
@pytest.mark.parametrize("name", list(CALLS))
def test_nodes_refuse_control_calls_without_the_secret(nodes, name, secret):
    paddr, daddr, decode = nodes
    free = decode.status()["free_blocks"]
    d = with_secret(node_pb2_grpc.DecodeControlStub(grpc.insecure_channel(daddr)), secret)
    p = with_secret(node_pb2_grpc.PrefillControlStub(grpc.insecure_channel(paddr)), secret)
    with pytest.raises(grpc.RpcError) as err:
        CALLS[name](d, p)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, err.value
    assert "cluster secret" in err.value.details()
    assert decode.status()["free_blocks"] == free  # nothing was reserved
    right = node_pb2_grpc.DecodeControlStub(grpc.insecure_channel(daddr))
    assert with_secret(right, SECRET).Status(node_pb2.StatusRequest()).kind == "decode"


async def _generate_through_router(paddr: str, daddr: str, secret: str) -> dict:
    cfg = RouterConfig(port=0, http_port=None, status_interval_s=0.2, rpc_timeout_s=5, node_wait_s=0)  # refused: at once
    router = Router(load_model_info("tiny"), NodeDirectory([paddr], [daddr]), cfg, max_model_len=256,
                    num_speculative_tokens=2, cluster_secret=secret)
    port = await router.start()
    try:
        async with RouterClient(f"127.0.0.1:{port}") as client:
            return await client.generate(build_request([5, 6, 7], max_tokens=6, ignore_eos=True))
    finally:
        await router.stop()


def test_a_router_with_the_secret_is_served_and_one_without_is_not(nodes):
    paddr, daddr, decode = nodes
    free = decode.status()["free_blocks"]
    out = asyncio.run(_generate_through_router(paddr, daddr, SECRET))  # P -> D FirstToken carries it too
    assert out["finish_reason"] == "length" and len(out["token_ids"]) == 6
    with pytest.raises(RouterError) as e:
        asyncio.run(_generate_through_router(paddr, daddr, "wrong-secret-of-good-length"))
    assert e.value.code == "UNAVAILABLE"  # it sees no node it may use
    assert decode.status()["free_blocks"] == free
