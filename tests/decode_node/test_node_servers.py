"""P and D behind their real gRPC servers on 127.0.0.1 with the ucx KV backend, driven with
raw stubs the way the router drives them; malformed node messages are refused cleanly."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time

import grpc
import msgpack
import pytest

from decode_node.node import DecodeNode
from decode_node.server import serve_decode
from engine.engine import EngineConfig, LLMEngine
from engine.model.loader import load_model
from engine.sampling.sampling_params import SamplingParams
from prefill_node.node import PrefillNode
from prefill_node.server import DecodeClients, serve_prefill
from protos import node_pb2, node_pb2_grpc
from protos.convert import pack_token_ids, sampling_to_proto
from protos.messages import FirstToken, unpack_outputs
from tests.prefill_stream import send_prefill


@pytest.fixture(scope="module")
def cluster():
    loaded = load_model("tiny")
    cfg = EngineConfig(num_speculative_tokens=2)
    decode = DecodeNode(loaded, cfg, kv_backend="ucx", kv_timeout_s=5)
    clients = DecodeClients()
    prefill = PrefillNode(loaded, cfg, clients.send_first_token, kv_backend="ucx", kv_timeout_s=5)
    decode.start()
    prefill.start()
    dserver, dport = serve_decode(decode, "d0")
    pserver, pport = serve_prefill(prefill, "p0")
    d = node_pb2_grpc.DecodeControlStub(grpc.insecure_channel(f"127.0.0.1:{dport}"))
    p = node_pb2_grpc.PrefillControlStub(grpc.insecure_channel(f"127.0.0.1:{pport}"))
    outputs: queue.SimpleQueue = queue.SimpleQueue()
    stream = d.Outputs(node_pb2.OutputsRequest(subscriber="test"))

    def read():
        try:
            for payload in stream:
                for item in unpack_outputs(payload.msgpack, loaded.model.config.vocab_size):
                    outputs.put(item)
        except grpc.RpcError:
            pass

    threading.Thread(target=read, daemon=True).start()
    yield loaded, d, p, f"127.0.0.1:{dport}", outputs, decode, prefill
    stream.cancel()
    pserver.stop(0)
    dserver.stop(0)
    prefill.stop()
    decode.stop()


def generate(d, p, daddr, outputs, rid, prompt, params, seed=1):
    sampling = sampling_to_proto(params, seed, ())
    res = d.Reserve(node_pb2.ReserveRequest(request_id=rid, prompt_len=len(prompt), sampling=sampling))
    assert res.admitted, res.reason
    reply = send_prefill(p, node_pb2.PrefillRequest(
        request_id=rid, prompt_token_ids_packed=pack_token_ids(prompt), sampling=sampling,
        descriptor_msgpack=res.descriptor_msgpack, decode_address=daddr))
    first = FirstToken.unpack(reply.msgpack, 10**6, 8)
    tokens = [first.token]
    while True:
        item = outputs.get(timeout=60)
        assert item.request_id == rid
        tokens += item.tokens
        if item.finish_reason or item.error:
            return tokens, item


def test_round_trip_over_grpc_equals_engine(cluster):
    loaded, d, p, daddr, outputs, decode, prefill = cluster
    params = SamplingParams(max_tokens=15, ignore_eos=True)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    tokens, last = generate(d, p, daddr, outputs, "g1", prompt, params)
    ref = LLMEngine(loaded, EngineConfig()).generate([prompt], params)[0].output_ids
    assert tokens == ref and last.finish_reason == "length"
    status = d.Status(node_pb2.StatusRequest())
    assert status.kind == "decode" and status.free_blocks == status.total_blocks


@pytest.mark.parametrize(
    "call, code",
    [
        (lambda d, p: d.FirstToken(node_pb2.Payload(msgpack=b"\x93garbage")), grpc.StatusCode.INVALID_ARGUMENT),
        (lambda d, p: d.Reserve(node_pb2.ReserveRequest(request_id="", prompt_len=3)), grpc.StatusCode.INVALID_ARGUMENT),
        (lambda d, p: d.Reserve(node_pb2.ReserveRequest(
            request_id="x", prompt_len=3, sampling=node_pb2.Sampling(max_tokens=0))), grpc.StatusCode.INVALID_ARGUMENT),
        (lambda d, p: send_prefill(p, node_pb2.PrefillRequest(
            request_id="y", prompt_token_ids_packed=pack_token_ids([10**7]), sampling=node_pb2.Sampling(max_tokens=3))),
         grpc.StatusCode.INVALID_ARGUMENT),
        (lambda d, p: send_prefill(p, node_pb2.PrefillRequest(
            request_id="z", prompt_token_ids_packed=pack_token_ids([1, 2]), sampling=node_pb2.Sampling(max_tokens=3),
            descriptor_msgpack=b"\xc1", decode_address="127.0.0.1:1")), grpc.StatusCode.INVALID_ARGUMENT),
        (lambda d, p: send_prefill(p, node_pb2.PrefillRequest(  # a packed prompt cut mid-id
            request_id="w", prompt_token_ids_packed=b"\x01\x00\x00", sampling=node_pb2.Sampling(max_tokens=3))),
         grpc.StatusCode.INVALID_ARGUMENT),
        (lambda d, p: d.Reserve(node_pb2.ReserveRequest(
            request_id="v", prompt_len=2, prompt_token_ids_packed=pack_token_ids([1, -5]),
            sampling=node_pb2.Sampling(max_tokens=3))), grpc.StatusCode.INVALID_ARGUMENT),
    ],
)
def test_bad_node_messages_are_refused_and_nodes_keep_serving(cluster, call, code):
    loaded, d, p, daddr, outputs, decode, prefill = cluster
    with pytest.raises(grpc.RpcError) as err:
        call(d, p)
    assert err.value.code() == code
    tokens, last = generate(d, p, daddr, outputs, f"after-{id(call)}", [7, 7, 7], SamplingParams(max_tokens=4))
    assert len(tokens) <= 4 and (last.finish_reason or last.error) is not None


def wait_until(cond, timeout=30.0):
    """Poll a condition the node's threads make true (a stream's end is noticed by its poll)."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


def test_an_owners_last_output_stream_ending_drops_its_requests_and_only_them(cluster):
    """A router instance's requests (ids `owner/...`) are dropped when its last Outputs stream
    ends (the router died), their blocks come back, its new reservations are refused until it
    subscribes again; another owner's requests are untouched."""
    loaded, d, p, daddr, outputs, decode, prefill = cluster
    sampling = sampling_to_proto(SamplingParams(max_tokens=8, ignore_eos=True), 1, ())

    def reserve(rid):
        return d.Reserve(node_pb2.ReserveRequest(request_id=rid, prompt_len=5, sampling=sampling))

    streams = [d.Outputs(node_pb2.OutputsRequest(subscriber="r1")) for _ in range(2)]
    for s in streams:
        s.initial_metadata()  # registered
    assert reserve("r1/a/1").admitted and reserve("r2/a/1").admitted
    streams[0].cancel()
    wait_until(lambda: decode.streams.owner_streams["r1"] == 1)
    assert "r1/a/1" in decode.requests  # one stream of its owner is still open
    streams[1].cancel()
    wait_until(lambda: "r1/a/1" not in decode.requests)
    assert "r2/a/1" in decode.requests and decode.orphans_dropped == 1
    refused = reserve("r1/b/1")
    assert not refused.admitted and "no output stream" in refused.reason
    again = d.Outputs(node_pb2.OutputsRequest(subscriber="r1"))
    again.initial_metadata()
    assert reserve("r1/c/1").admitted
    for rid in ("r2/a/1", "r1/c/1"):
        d.Abort(node_pb2.AbortRequest(request_id=rid, reason="test"))
    again.cancel()
    status = d.Status(node_pb2.StatusRequest())
    wait_until(lambda: decode.status()["free_blocks"] == status.total_blocks)  # after the quarantine
    with pytest.raises(grpc.RpcError) as err:
        next(iter(d.Outputs(node_pb2.OutputsRequest(subscriber="a/b"))))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


FROZEN_ROUTER = """
import sys, time, grpc
from protos import node_pb2, node_pb2_grpc
stream = node_pb2_grpc.DecodeControlStub(grpc.insecure_channel(sys.argv[1])).Outputs(
    node_pb2.OutputsRequest(subscriber="frozen"))
stream.initial_metadata()  # registered
print("ready", flush=True)
time.sleep(600)
"""


def test_a_router_that_stops_answering_loses_its_stream_to_keepalive_and_its_requests(cluster):
    """A router process that freezes (SIGSTOP: its connection stays open, as when its host
    vanishes) stops answering the server's keepalive pings; the server closes the connection,
    the owner's last stream ends, and the decode node drops the owner's request."""
    loaded, d, p, daddr, outputs, decode, prefill = cluster
    server, port = serve_decode(decode, "d0-keepalive", keepalive_s=0.5)
    child = subprocess.Popen([sys.executable, "-c", FROZEN_ROUTER, f"127.0.0.1:{port}"], stdout=subprocess.PIPE,
                             text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        sampling = sampling_to_proto(SamplingParams(max_tokens=8, ignore_eos=True), 1, ())
        assert d.Reserve(node_pb2.ReserveRequest(request_id="frozen/a/1", prompt_len=5, sampling=sampling)).admitted
        dropped = decode.orphans_dropped
        os.kill(child.pid, signal.SIGSTOP)
        wait_until(lambda: "frozen/a/1" not in decode.requests, timeout=30)
        assert decode.orphans_dropped == dropped + 1
    finally:
        child.kill()
        child.wait()
        server.stop(0)


def test_attaches_ahead_of_their_jobs_do_not_hold_the_server(cluster):
    """More Attach calls than the server has threads, each ahead of its job (its Prefill request
    not yet served): each answers ok within ATTACH_WAIT_S, queued in the node, instead of holding a
    thread until its job comes, so the server still answers (a Status call here, a PrefillStream
    opening in the service) and aborts clear them."""
    loaded, d, p, daddr, outputs, decode, prefill = cluster
    desc = node_pb2.AttachRequest(descriptor_msgpack=msgpack.packb({"backend": "ucx"}), decode_address=daddr)
    rids = [f"early-{i}" for i in range(40)]
    calls = [p.Attach.future(node_pb2.AttachRequest(request_id=r, descriptor_msgpack=desc.descriptor_msgpack,
                                                    decode_address=daddr), timeout=20) for r in rids]
    start = time.monotonic()
    assert p.Status(node_pb2.StatusRequest(), timeout=5).healthy
    assert all(c.result().ok for c in calls)
    assert time.monotonic() - start < 10
    for r in rids:
        p.Abort(node_pb2.AbortRequest(request_id=r, reason="test"))
    wait_until(lambda: not prefill._early)
