"""Issue 18's protections on the whole service (router + P + D actors on a local Ray cluster,
KV over ucx): TLS and the API key on the client API, mutual TLS on the node control channels
(router -> P and D, P -> D) with certificates from `pdserve certs`, the cluster secret made by the
service and required by every node as well, UCX of the local service on loopback only, per-node
KV blocks in Health, and the secret written to no Ray log."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from deploy.certs import write_dev_certs
from engine.sampling.sampling_params import SamplingParams
from protos import node_pb2, node_pb2_grpc
from protos.tls import NodeTls, node_channel
from router.client import RouterClient, RouterError, build_request
from tests.e2e.conftest import router_health_settled, run_async, start_service, wait_blocks_returned
from tests.listening import listening
from tests.tlscert import self_signed

pytestmark = pytest.mark.usefixtures("ray_cluster")
KEY = "e2e-api-key"


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    cert, key = self_signed(tmp_path_factory.mktemp("tls"))
    nodes = write_dev_certs(tmp_path_factory.mktemp("node-tls"))
    svc, address = start_service(1, 1, 2, **{"router.api_key": KEY, "router.tls_cert": cert,
                                             "router.tls_key": key,
                                             "cluster.node_tls_ca": str(nodes["ca.crt"]),
                                             "cluster.node_tls_cert": str(nodes["tls.crt"]),
                                             "cluster.node_tls_key": str(nodes["tls.key"]),
                                             "router.node_wait_s": 30})  # a first request waits for the nodes' first status
    yield svc, address, cert
    svc.stop()


async def _generate(address: str, cert: str, prompts: list[list[int]], key: str | None = KEY) -> list[dict]:
    async with RouterClient(address, key, tls_ca=cert) as client:
        return list(await asyncio.gather(*(client.generate(build_request(p, max_tokens=12, ignore_eos=True))
                                           for p in prompts)))


def test_tls_and_key_serve_greedy_output_equal_to_single_process(secured, tiny_reference):
    svc, address, cert = secured
    prompts = [[5, 6, 7], list(range(40, 90)), [200] * 17]
    got = run_async(_generate(address, cert, prompts))
    ref = tiny_reference(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    assert [g["token_ids"] for g in got] == [r.output_ids for r in ref]
    with pytest.raises(RouterError) as e:
        run_async(_generate(address, cert, prompts[:1], key=None))
    assert e.value.code == "UNAUTHENTICATED"
    wait_blocks_returned(svc)


def _node_status(channel: grpc.Channel, role: str) -> node_pb2.NodeStatus:
    stub = (node_pb2_grpc.DecodeControlStub if role == "decode" else node_pb2_grpc.PrefillControlStub)(channel)
    return stub.Status(node_pb2.StatusRequest(), timeout=10)


def test_nodes_need_the_cluster_certificate_and_the_secret_and_health_shows_their_blocks(secured):
    svc, address, cert = secured
    assert svc.cfg.cluster.secret and len(svc.cfg.cluster.secret) >= 32
    health = run_async(router_health_settled(address, api_key=KEY, tls_ca=cert))
    assert {n.kind for n in health.nodes} == {"prefill", "decode"}
    assert all(n.healthy and n.free_kv_blocks == n.total_kv_blocks > 0 for n in health.nodes)
    c = svc.cfg.cluster
    tls = NodeTls.load(c.node_tls_ca, c.node_tls_cert, c.node_tls_key)
    for (role, _), node_address in svc.addresses.items():
        for channel, code in ((grpc.insecure_channel(node_address), grpc.StatusCode.UNAVAILABLE),  # no handshake
                              (node_channel(node_address, tls, []), grpc.StatusCode.UNAUTHENTICATED)):  # no secret
            with channel, pytest.raises(grpc.RpcError) as err:
                _node_status(channel, role)
            assert err.value.code() == code, (role, err.value)


def test_node_processes_listen_on_loopback_only_and_log_no_secret(secured):
    import ray

    svc, _address, _cert = secured
    for info in svc.node_info().values():
        addrs = listening(info["pid"])
        assert addrs and all(ip == "127.0.0.1" for ip, _port in addrs), (info["role"], addrs)
    logs = Path(ray._private.worker.global_worker.node.get_logs_dir_path())
    secret = svc.cfg.cluster.secret.encode()
    assert not [f for f in logs.rglob("*") if f.is_file() and secret in f.read_bytes()]
