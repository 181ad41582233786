"""The prefill node's side of PrefillStream (prefill_node/stream.py) over a node stand-in (I6: the
session is a plain object): every request gets one answer naming it, a refused or failed one with
its status code and message; a cancellation and the stream's end abort the jobs left;
and over a real gRPC server with the cluster secret, a stream without it is refused."""

from __future__ import annotations

import queue
import threading
from types import SimpleNamespace

import grpc
import pytest

from prefill_node.node import NeverFits, PrefillJob
from prefill_node.server import serve_prefill
from prefill_node.stream import CANCELLED, PrefillSession
from protos import node_pb2, node_pb2_grpc
from protos.convert import pack_token_ids
from protos.messages import FirstToken
from protos.serving import with_secret

VOCAB = 320


class _Node:
    """What the session and the intake read of a PrefillNode; jobs end when the test says."""

    takes_attach = True

    def __init__(self) -> None:
        self.loaded = SimpleNamespace(model=SimpleNamespace(config=SimpleNamespace(vocab_size=VOCAB)))
        self.loop_error: BaseException | None = None
        self.never_fits = False
        self.jobs: dict[str, PrefillJob] = {}
        self.aborts: list[tuple[str, str]] = []
        self.submitted = threading.Semaphore(0)

    def submit(self, job: PrefillJob):
        if self.never_fits:
            raise NeverFits("the prompt needs more KV blocks than the node has (test)")
        self.jobs[job.request_id] = job
        self.submitted.release()
        return job.future

    def abort(self, rid: str, reason: str) -> None:
        self.aborts.append((rid, reason))
        job = self.jobs.get(rid)
        if job is not None and not job.future.done():
            job.future.set_exception(RuntimeError(reason))

    def finish(self, rid: str) -> None:
        self.jobs[rid].future.set_result(FirstToken(rid, 7, None, None, [], b"", None))


def _prefill(rid: str, prompt: list[int] | None = None) -> node_pb2.PrefillStreamRequest:
    return node_pb2.PrefillStreamRequest(prefill=node_pb2.PrefillRequest(
        request_id=rid, prompt_token_ids_packed=pack_token_ids([1, 2] if prompt is None else prompt),
        sampling=node_pb2.Sampling(max_tokens=4, logprobs=-1)))  # no descriptor: it comes by Attach


def _cancel(rid: str) -> node_pb2.PrefillStreamRequest:
    return node_pb2.PrefillStreamRequest(cancel=node_pb2.AbortRequest(request_id=rid))


class _Session:
    """A session fed from a queue, its answers collected on a thread (as the gRPC server runs it)."""

    def __init__(self, node: _Node) -> None:
        self.session = PrefillSession(node)
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.out: queue.SimpleQueue = queue.SimpleQueue()
        self.session.read_from(iter(self.inbox.get, None))
        self.done = threading.Thread(target=self._collect, daemon=True)
        self.done.start()

    def _collect(self) -> None:
        for reply in self.session.replies():
            self.out.put(reply)
        self.out.put(None)

    def send(self, msg: node_pb2.PrefillStreamRequest) -> None:
        self.inbox.put(msg)

    def reply(self) -> node_pb2.PrefillStreamReply:
        return self.out.get(timeout=10)


def test_refused_requests_are_answered_with_the_calls_codes_and_their_ids():
    node = _Node()
    s = _Session(node)
    s.send(_prefill("empty", prompt=[]))
    s.send(_prefill("big", prompt=[VOCAB]))  # an id outside the vocabulary
    s.send(_prefill(""))  # no id at all: answered under the id it came with
    got = [s.reply() for _ in range(3)]
    assert [(r.request_id, grpc.StatusCode.INVALID_ARGUMENT.value[0]) for r in got] == \
        [(r.request_id, r.code) for r in got] and [r.request_id for r in got] == ["empty", "big", ""]
    node.never_fits = True
    s.send(_prefill("huge"))
    r = s.reply()
    assert (r.request_id, r.code) == ("huge", grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]) and "test" in r.details
    node.never_fits, node.loop_error = False, RuntimeError("device lost (test)")
    s.send(_prefill("down"))
    r = s.reply()
    assert (r.request_id, r.code) == ("down", grpc.StatusCode.UNAVAILABLE.value[0]) and not node.jobs
    s.send(None)
    assert s.out.get(timeout=10) is None  # the router's end of writing ends the session


def _session_with(*rids: str) -> tuple[_Node, _Session]:
    """A session whose node took a job for each of `rids`."""
    node = _Node()
    s = _Session(node)
    for rid in rids:
        s.send(_prefill(rid))
        assert node.submitted.acquire(timeout=10)
    return node, s


def test_jobs_are_answered_as_they_end_failures_with_their_codes():
    node, s = _session_with("a", "b", "c")
    s.send(_prefill("a"))  # a second request under an id still open on this stream
    dup = s.reply()
    assert (dup.request_id, dup.code) == ("a", grpc.StatusCode.INVALID_ARGUMENT.value[0])
    node.jobs["c"].future.set_exception(ConnectionError("decode node unreachable (test)"))
    node.finish("a")
    node.jobs["b"].future.set_exception(RuntimeError("dropped (test)"))
    c, a, b = s.reply(), s.reply(), s.reply()
    assert (c.request_id, c.code) == ("c", grpc.StatusCode.FAILED_PRECONDITION.value[0])
    assert (a.request_id, a.code) == ("a", 0) and FirstToken.unpack(a.first_token_msgpack, VOCAB, 8).token == 7
    assert (b.request_id, b.code) == ("b", grpc.StatusCode.ABORTED.value[0])
    assert node.jobs["a"].answered.wait(10)  # the loop's follow-up work may go on (let_answer)
    assert not node.aborts
    s.send(None)


def test_a_cancellation_and_the_streams_end_abort_the_jobs_left():
    node, s = _session_with("x", "y", "z")
    s.send(_cancel("x"))
    s.send(_cancel("nobody"))  # not open here: touches nothing
    s.send(_prefill("w"))
    assert node.submitted.acquire(timeout=10)
    assert node.aborts == [("x", CANCELLED)]
    node.finish("y")
    assert s.reply().request_id == "y"  # x was cancelled: no answer for it
    s.session.close()  # the RPC ended (the router went away, the connection broke)
    assert sorted(node.aborts) == [("w", CANCELLED), ("x", CANCELLED), ("z", CANCELLED)]
    assert s.out.get(timeout=10) is None and node.jobs["z"].answered.is_set()


def test_a_stream_without_the_cluster_secret_is_refused_and_one_with_it_served():
    node = _Node()
    server, port = serve_prefill(node, "p0", secret="s3cret")  # type: ignore[arg-type]
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        bare = node_pb2_grpc.PrefillControlStub(channel)
        with pytest.raises(grpc.RpcError) as e:
            list(bare.PrefillStream(iter([_prefill("r0")])))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED and not node.jobs
        stub = with_secret(bare, "s3cret")
        msgs: queue.SimpleQueue = queue.SimpleQueue()
        msgs.put(_prefill("r1"))
        replies = stub.PrefillStream(iter(msgs.get, None))
        assert node.submitted.acquire(timeout=10)
        node.finish("r1")
        r = next(replies)
        assert (r.request_id, r.code) == ("r1", 0)
        msgs.put(None)
        assert list(replies) == []
    finally:
        channel.close()
        server.stop(0)
