"""The prefill node's gRPC face (PrefillControl): each router's Prefill requests on its
PrefillStream (prefill_node/stream.py), and Attach, Abort, Status and Prime. Also the client that
delivers first-token messages to decode nodes."""

from __future__ import annotations

import threading
from concurrent import futures
from typing import Any

import grpc
import msgpack

from engine.tp.channel import Lockstep
from kvtransfer import TransferError, TransferState
from kvtransfer.prime import prime
from prefill_node.intake import read_descriptor
from prefill_node.node import PrefillNode
from prefill_node.stream import PrefillSession
from protos import node_pb2, node_pb2_grpc
from protos.convert import check_request_id
from protos.messages import FirstToken
from protos.serving import GRPC_OPTIONS, KEEPALIVE_S, refuse_if_failed, start_server, with_secret
from protos.tls import NodeTls, node_channel


class DecodeClients:
    """One channel per decode node address; `send_first_token` is the node's sink. With `tls`
    the channels are mutual TLS (this node presents its certificate)."""

    def __init__(self, timeout_s: float = 10.0, secret: str | None = None, tls: NodeTls | None = None) -> None:
        self._stubs: dict[str, Any] = {}
        self._lock = threading.Lock()
        self.timeout_s = timeout_s
        self._secret = secret  # the cluster secret, sent on every call
        self._tls = tls

    def stub(self, address: str) -> Any:
        """A DecodeControl stub for `address` (one channel per address, the secret on every call)."""
        with self._lock:
            if address not in self._stubs:
                channel = node_channel(address, self._tls, GRPC_OPTIONS)
                self._stubs[address] = with_secret(node_pb2_grpc.DecodeControlStub(channel), self._secret)
            return self._stubs[address]

    def send_first_token(self, address: str, msg: FirstToken) -> None:
        ack = self.stub(address).FirstToken(node_pb2.Payload(msgpack=msg.pack()), timeout=self.timeout_s)
        if not ack.ok:
            raise ConnectionError(ack.reason)


# How long an Attach call holds its server thread for the node to take the descriptor. An Attach
# that overtook its Prefill request must not wait for the job: with the server's threads all held
# by such waits, the PrefillStream carrying the requests they wait for could not be opened (a
# deadlock until their deadlines; a fresh-clone CI run, 32 requests at once). Past this the call
# answers ok and the node attaches the descriptor when the job comes; a failure then (a bad
# descriptor, an abort, no job within the KV timeout) ends the job, which its answer on the stream
# or the decode node's KV timeout reports.
ATTACH_WAIT_S = 0.25
PRIME_WAIT_S = 60.0  # the most a Prime call holds a server thread, whatever its caller's deadline


class PrefillServicer(node_pb2_grpc.PrefillControlServicer):
    def __init__(self, node: PrefillNode, node_id: str) -> None:
        self.node, self.node_id = node, node_id

    def PrefillStream(self, request_iterator, context):
        """The Prefill requests of one router process's channel, and their answers (PrefillSession)."""
        refuse_if_failed(self.node, context)
        session = PrefillSession(self.node)
        context.add_callback(session.close)  # the stream ended: what it left unfinished is dropped
        session.read_from(request_iterator)
        yield from session.replies()

    def Attach(self, request, context):
        if not self.node.takes_attach:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this prefill node (tensor parallel) takes no Attach")
        try:
            rid = check_request_id(request.request_id)
            descriptor = read_descriptor(request.descriptor_msgpack, request.decode_address)
        except (ValueError, msgpack.UnpackException) as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        try:
            remaining = context.time_remaining()
            self.node.attach(rid, descriptor, request.decode_address).result(
                timeout=ATTACH_WAIT_S if remaining is None else min(remaining, ATTACH_WAIT_S))
        except KeyError as e:
            context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except futures.TimeoutError:
            pass  # queued: its job has not come in yet, or the node is mid-step (ATTACH_WAIT_S)
        return node_pb2.Ack(ok=True)

    def Prime(self, request, context):
        refuse_if_failed(self.node, context)
        if isinstance(self.node, Lockstep):  # each rank would need its own: their first request opens them
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "this prefill node (tensor parallel) takes no priming transfer")
        try:  # on this thread, not the loop's: the transfer holds no block, its lease's end frees nothing
            rid = check_request_id(request.request_id)
            descriptor = read_descriptor(request.descriptor_msgpack, request.decode_address)
            remaining = context.time_remaining()
            timeout = remaining if remaining is not None and remaining < PRIME_WAIT_S else PRIME_WAIT_S
            status = prime(self.node.sender, rid, descriptor, timeout)
        except (ValueError, TransferError, msgpack.UnpackException) as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        ok = status.state is TransferState.DONE
        return node_pb2.Ack(ok=ok, reason="" if ok else status.reason or f"still {status.state.value} at the deadline")

    def Abort(self, request, context):
        self.node.abort(request.request_id, request.reason or "aborted by router")
        return node_pb2.Ack(ok=True)

    def Status(self, request, context):
        self.node.hold_status()  # the status_delay_s test hook
        s = self.node.status()
        return node_pb2.NodeStatus(node_id=self.node_id, kind="prefill", healthy=self.node.loop_error is None,
                                   num_speculative_tokens=self.node.k, **s)


def serve_prefill(node: PrefillNode, node_id: str, host: str = "127.0.0.1", port: int = 0,
                  workers: int = 16, secret: str | None = None,
                  tls: NodeTls | None = None,
                  keepalive_s: float = KEEPALIVE_S) -> tuple[grpc.Server, int]:
    """PrefillControl on `host`; with `secret` (the cluster secret) calls without it are refused;
    with `tls`, mutual TLS only."""
    return start_server(node_pb2_grpc.add_PrefillControlServicer_to_server, PrefillServicer(node, node_id),
                        host, port, workers, secret, tls, keepalive_s)
