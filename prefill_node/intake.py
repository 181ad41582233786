"""A Prefill request as the node takes it, and a job's end as the router reads it.

Receives a PrefillRequest from the network (a router's PrefillStream, prefill_node/stream.py),
checks every field (id, packed ids against the vocabulary, sampling, the descriptor) and submits a
PrefillJob; maps what the job's future raised to the gRPC status code and message the router acts
on (retry elsewhere, move the request, or end it), carried in the request's answer. Never waits
for the job.
"""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Any

import grpc
import msgpack

from prefill_node.node import NeverFits, PrefillJob, PrefillNode
from protos import node_pb2
from protos.convert import check_request_id, sampling_from_proto, unpack_token_ids


class Refused(Exception):
    """A request refused before it became a job: its status code and message."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


def submit(node: PrefillNode, request: node_pb2.PrefillRequest, received: float,
           answered: threading.Event) -> tuple[str, concurrent.futures.Future]:
    """Check `request` and submit its job (queue time from `received`); its id and future.
    Refused (INVALID_ARGUMENT, RESOURCE_EXHAUSTED, UNAVAILABLE) when it cannot be a job."""
    if node.loop_error is not None:  # its process is ending: the router takes it out, tries another
        raise Refused(grpc.StatusCode.UNAVAILABLE, f"the node's step loop failed: {node.loop_error!r}")
    vocab = node.loaded.model.config.vocab_size
    try:
        rid = check_request_id(request.request_id)
        prompt = unpack_token_ids(request.prompt_token_ids_packed, vocab)
        if not prompt:
            raise ValueError("the prompt (prompt_token_ids_packed) is empty")
        params, seed, stops = sampling_from_proto(request.sampling, vocab)
        later = not request.descriptor_msgpack and not request.decode_address  # from Attach
        if later and not node.takes_attach:
            raise ValueError("this prefill node (tensor parallel) needs the KV descriptor with the request")
        descriptor = None if later else read_descriptor(request.descriptor_msgpack, request.decode_address)
        job = PrefillJob(rid, prompt, params, seed, stops, descriptor, request.decode_address, received=received,
                         answered=answered)
        return rid, node.submit(job)
    except NeverFits as e:
        raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)) from None
    except (ValueError, msgpack.UnpackException) as e:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None


def failure_status(node: PrefillNode, error: BaseException) -> tuple[grpc.StatusCode, str]:
    """How a job that raised `error` ends for the router."""
    if isinstance(error, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(error)
    if isinstance(error, ConnectionError):  # the decode node, not this one: the router moves the request
        return grpc.StatusCode.FAILED_PRECONDITION, str(error)
    # the node's loop failed (a device error): the router tries another node; else the job was dropped
    code = grpc.StatusCode.UNAVAILABLE if node.loop_error is not None else grpc.StatusCode.ABORTED
    return code, str(error)


def read_descriptor(data: bytes, decode_address: str) -> dict[str, Any]:
    """A KV descriptor map and the decode node it belongs to, both required (checked further by
    the node and its KV sender)."""
    descriptor = msgpack.unpackb(data, raw=False)
    if not isinstance(descriptor, dict) or not decode_address:
        raise ValueError("a KV descriptor map and a decode_address are required")
    return descriptor
