"""Mutual TLS on the node control channels: real P and D behind their gRPC servers on 127.0.0.1,
with node TLS and the cluster secret. A plain-text client, a TLS client without a certificate,
one whose certificate another CA signed, and one that does not trust the cluster CA all fail
(the handshake does: UNAVAILABLE); one with the cluster's certificate but no secret is refused
(UNAUTHENTICATED); a real Router holding both generates through P and D (P's FirstToken to D
goes over mutual TLS too) the tokens of the single-process engine, and one without TLS cannot."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from decode_node.node import DecodeNode
from decode_node.server import serve_decode
from deploy.certs import write_dev_certs
from deploy.config import RouterConfig
from engine.engine import EngineConfig, LLMEngine
from engine.model.loader import load_model, load_model_info
from engine.sampling.sampling_params import SamplingParams
from prefill_node.node import PrefillNode
from prefill_node.server import DecodeClients, serve_prefill
from protos import node_pb2, node_pb2_grpc
from protos.serving import with_secret
from protos.tls import NodeTls, node_channel
from router import NodeDirectory, Router
from router.client import RouterClient, RouterError, build_request

SECRET = "cluster-secret-for-tls-tests-0123456789"


def _load(paths: dict) -> NodeTls:
    return NodeTls.load(str(paths["ca.crt"]), str(paths["tls.crt"]), str(paths["tls.key"]))


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    """The cluster's files and another cluster's (another CA)."""
    root = tmp_path_factory.mktemp("node-tls")
    return _load(write_dev_certs(root / "ours")), _load(write_dev_certs(root / "theirs"))


@pytest.fixture(scope="module")
def nodes(certs):
    ours, _ = certs
    loaded = load_model("tiny")
    cfg = EngineConfig(num_speculative_tokens=2)
    decode = DecodeNode(loaded, cfg, kv_backend="tcp", kv_timeout_s=5)
    prefill = PrefillNode(loaded, cfg, DecodeClients(secret=SECRET, tls=ours).send_first_token, kv_backend="tcp",
                          kv_timeout_s=5)
    decode.start()
    prefill.start()
    dserver, dport = serve_decode(decode, "d0", secret=SECRET, tls=ours)
    pserver, pport = serve_prefill(prefill, "p0", secret=SECRET, tls=ours)
    yield f"127.0.0.1:{pport}", f"127.0.0.1:{dport}", loaded
    pserver.stop(0)
    dserver.stop(0)
    prefill.stop()
    decode.stop()


def _no_client_cert(address: str, tls: NodeTls) -> grpc.Channel:
    creds = grpc.ssl_channel_credentials(root_certificates=tls.ca)  # server checked, none presented
    return grpc.secure_channel(address, creds, options=tls.channel_options())


CLIENTS = {
    "plain text": lambda a, ours, theirs: grpc.insecure_channel(a),
    "TLS without a client certificate": lambda a, ours, theirs: _no_client_cert(a, ours),
    "a client certificate of another CA": lambda a, ours, theirs: node_channel(
        a, NodeTls(ours.ca, theirs.cert, theirs.key), []),
    "trusting another CA": lambda a, ours, theirs: node_channel(a, theirs, []),
}


def _status(channel: grpc.Channel, role: str, secret: str | None) -> node_pb2.NodeStatus:
    stub_cls = node_pb2_grpc.DecodeControlStub if role == "decode" else node_pb2_grpc.PrefillControlStub
    return with_secret(stub_cls(channel), secret).Status(node_pb2.StatusRequest(), timeout=10)


@pytest.mark.parametrize("role", ["prefill", "decode"])
@pytest.mark.parametrize("client", list(CLIENTS))
def test_a_tls_node_refuses_clients_without_the_cluster_certificate(nodes, certs, client, role):
    paddr, daddr, _ = nodes
    ours, theirs = certs
    address = paddr if role == "prefill" else daddr
    with CLIENTS[client](address, ours, theirs) as channel, pytest.raises(grpc.RpcError) as err:
        _status(channel, role, SECRET)  # the secret is right: TLS alone refuses
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
    with node_channel(address, ours, []) as channel:
        assert _status(channel, role, SECRET).kind == role


def test_the_cluster_secret_is_still_checked_over_tls(nodes, certs):
    _, daddr, _ = nodes
    with node_channel(daddr, certs[0], []) as channel, pytest.raises(grpc.RpcError) as err:
        _status(channel, "decode", None)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def _generate_through_router(paddr: str, daddr: str, tls: NodeTls | None, prompt: list[int]) -> dict:
    cfg = RouterConfig(port=0, http_port=None, status_interval_s=0.2, rpc_timeout_s=5, node_wait_s=0)  # refused: at once
    router = Router(load_model_info("tiny"), NodeDirectory([paddr], [daddr]), cfg, max_model_len=256,
                    num_speculative_tokens=2, cluster_secret=SECRET, node_tls=tls)
    port = await router.start()
    try:
        async with RouterClient(f"127.0.0.1:{port}") as client:
            return await client.generate(build_request(prompt, max_tokens=8, ignore_eos=True))
    finally:
        await router.stop()


def test_a_router_with_the_cluster_certificate_generates_the_reference_tokens(nodes, certs):
    paddr, daddr, loaded = nodes
    prompt = [5, 6, 7, 8]
    out = asyncio.run(_generate_through_router(paddr, daddr, certs[0], prompt))
    ref = LLMEngine(loaded, EngineConfig()).generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))
    assert out["token_ids"] == ref[0].output_ids
    with pytest.raises(RouterError) as e:
        asyncio.run(_generate_through_router(paddr, daddr, None, prompt))
    assert e.value.code == "UNAVAILABLE"  # a plain-text router sees no node it may use
