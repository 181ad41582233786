"""The decode node's gRPC face (DecodeControl): reservations, first-token messages from
prefill nodes, aborts, and the multiplexed output stream (one per subscriber). The colocated
node's (ColocatedControl) is the same but for Submit, which takes a whole request.

An Outputs stream's `subscriber` is its owner (a router instance id; DecodeNode "Owners"):
when the owner's last stream ends (the router is gone: its connection closed), the node drops
that owner's requests. The stream loop notices a gone caller within OUTPUTS_POLL_S."""

from __future__ import annotations

import queue

import grpc
import msgpack

from decode_node.colocated import ColocatedNode
from decode_node.node import DecodeNode
from decode_node.synthetic import SyntheticNode
from engine.tp.channel import Lockstep
from kvtransfer import TransferError
from kvtransfer.prime import expect_prime
from protos import node_pb2, node_pb2_grpc
from protos.convert import check_request_id, sampling_from_proto, unpack_token_ids
from protos.messages import FirstToken, MessageError, pack_outputs
from protos.serving import KEEPALIVE_S, refuse_if_failed, start_server
from protos.tls import NodeTls

MAX_SUBSCRIBER = 128
OUTPUTS_POLL_S = 0.5  # how often an idle output stream checks that its caller is still there
MAX_STEPS_PER_MESSAGE = 16  # a stream that fell behind sends the steps queued since in one message


class DecodeServicer(node_pb2_grpc.DecodeControlServicer):
    kind = "decode"

    def __init__(self, node: DecodeNode, node_id: str) -> None:
        self.node, self.node_id = node, node_id
        self.vocab = node.vocab

    def Reserve(self, request, context):
        refuse_if_failed(self.node, context)
        try:
            rid = check_request_id(request.request_id)
            params, seed, stops = sampling_from_proto(request.sampling, self.vocab)
            prompt = unpack_token_ids(request.prompt_token_ids_packed, self.vocab) or None  # checked against prompt_len by the node
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        res = self.node.reserve(rid, request.prompt_len, params, seed, stops, prompt).result(timeout=30)
        if not res.fits:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, res.reason)
        data = msgpack.packb(res.descriptor, use_bin_type=True) if res.admitted else b""
        return node_pb2.ReserveReply(admitted=res.admitted, reason=res.reason, descriptor_msgpack=data)

    def Prime(self, request, context):
        refuse_if_failed(self.node, context)
        if isinstance(self.node, Lockstep):  # each rank would need its own: their first request opens them
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "this decode node (tensor parallel) takes no priming transfer")
        try:  # no block reserved, so not the loop's business: the receiver takes `expect` from any thread
            layers = list(range(self.node.num_layers))
            descriptor = expect_prime(self.node.receiver, check_request_id(request.request_id), layers)
        except (ValueError, TransferError) as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return node_pb2.ReserveReply(admitted=True, descriptor_msgpack=msgpack.packb(descriptor, use_bin_type=True))

    def FirstToken(self, request, context):
        try:
            msg = FirstToken.unpack(request.msgpack, self.vocab, max_drafts=self.node.k)
        except MessageError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        self.node.first_token(msg)
        return node_pb2.Ack(ok=True)

    def Abort(self, request, context):
        self.node.abort(request.request_id, request.reason or "aborted by router")
        return node_pb2.Ack(ok=True)

    def Outputs(self, request, context):
        owner = request.subscriber
        if len(owner) > MAX_SUBSCRIBER or "/" in owner:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"subscriber: at most {MAX_SUBSCRIBER} characters, no '/'")
        q = self.node.subscribe(owner)
        context.send_initial_metadata(())  # tells the subscriber it is registered: nothing is missed
        try:
            while context.is_active():
                try:
                    items = q.get(timeout=OUTPUTS_POLL_S)
                except queue.Empty:
                    continue
                if items is None:  # the node is stopping
                    return
                items, stopping = _more_steps(q, items)
                yield node_pb2.Payload(msgpack=pack_outputs(items))
                if stopping:
                    return
        finally:
            self.node.unsubscribe(q, owner)

    def Status(self, request, context):
        self.node.hold_status()  # the status_delay_s test hook
        s = self.node.status()
        return node_pb2.NodeStatus(node_id=self.node_id, kind=self.kind, healthy=self.node.loop_error is None,
                                   num_speculative_tokens=self.node.k, **s)


def _more_steps(q: queue.SimpleQueue, items: list) -> tuple[list, bool]:
    """`items` and the steps' batches queued behind it (at most MAX_STEPS_PER_MESSAGE in all): one
    message when the stream fell behind the loop, in step order. True when the node is stopping."""
    for _ in range(MAX_STEPS_PER_MESSAGE - 1):
        try:
            more = q.get_nowait()
        except queue.Empty:
            break
        if more is None:
            return items, True
        items = items + more
    return items, False


def serve_decode(node: DecodeNode, node_id: str, host: str = "127.0.0.1", port: int = 0,
                 workers: int = 32, secret: str | None = None,
                 tls: NodeTls | None = None,
                 keepalive_s: float = KEEPALIVE_S) -> tuple[grpc.Server, int]:
    """DecodeControl on `host`; with `secret` (the cluster secret) calls without it are refused;
    with `tls`, mutual TLS only."""
    return start_server(node_pb2_grpc.add_DecodeControlServicer_to_server, DecodeServicer(node, node_id),
                        host, port, workers, secret, tls, keepalive_s)


class ColocatedServicer(DecodeServicer):
    """ColocatedControl: Submit, and DecodeControl's Abort, Outputs and Status (over a ColocatedNode,
    or the SyntheticNode test backend: decode_node/synthetic.py)."""

    kind = "colocated"
    node: ColocatedNode

    def Submit(self, request, context):
        refuse_if_failed(self.node, context)
        try:
            rid = check_request_id(request.request_id)
            params, seed, stops = sampling_from_proto(request.sampling, self.vocab)
            prompt = unpack_token_ids(request.prompt_token_ids_packed, self.vocab)
            if not prompt or len(prompt) != request.prompt_len:
                raise ValueError("prompt_token_ids_packed must hold prompt_len (> 0) ids")
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        res = self.node.submit(rid, prompt, params, seed, stops).result(timeout=30)
        if not res.fits:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, res.reason)
        return node_pb2.ReserveReply(admitted=res.admitted, reason=res.reason)


def serve_colocated(node: ColocatedNode | SyntheticNode, node_id: str, host: str = "127.0.0.1", port: int = 0,
                    workers: int = 32, secret: str | None = None, tls: NodeTls | None = None,
                    keepalive_s: float = KEEPALIVE_S) -> tuple[grpc.Server, int]:
    """ColocatedControl on `host`, with the cluster secret and TLS rules of `serve_decode`."""
    servicer = ColocatedServicer(node, node_id)  # type: ignore[arg-type]  # the synthetic one quacks alike
    return start_server(node_pb2_grpc.add_ColocatedControlServicer_to_server, servicer,
                        host, port, workers, secret, tls, keepalive_s)
