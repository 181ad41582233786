"""Scripted fake prefill and decode nodes: real gRPC servers on 127.0.0.1 speaking node.proto
(PrefillControl, DecodeControl) with deterministic behaviour, for testing the router before
the real nodes exist. Vocabulary: the `tiny` model's (320 ids; bytes are 0..255, BOS 256,
EOS 257).

FakePrefill, each request on a PrefillStream (a task of its own, `_prefill`):
  - first token = (prompt[-1] + 1) % 320 (a prompt ending in BOS 256 gives EOS 257), logprob
    -0.5, rank 1, top-N ids first + j;
  - `finished` is "stop" when that token is a stop id, "length" when max_tokens == 1;
  - sends the FirstToken message to the decode node named in the request (over gRPC, as the
    real P does), then answers the router with the same message.
  Knobs: `fail` (answer UNAVAILABLE), `fail_after_first_token` (UNAVAILABLE after D got
  the first token), `hold` (an asyncio.Event the request waits on, to keep a
  prefill outstanding), `queued_tokens` (reported by Status), `status_delay_s` (Status answers
  that late: a busy node). Prime records (request id, decode address) in `primes` and answers
  ok, after `prime_hold` is set when there is one, or not ok when `refuse_primes`.

FakeDecode:
  - Reserve admits while `refuse` is False and `free_blocks` (blocks = ceil((prompt_len +
    max_tokens) / 16)) allow; the descriptor is msgpack {v, node, rid}.
  - FirstToken starts the request, unless it is `finished` (then the reservation is released
    silently). A step loop advances every running request by a batch of 1, 2, 3, 1, 2, 3, ...
    tokens from `script` (cycled), one multiplexed Outputs message per step for all requests.
    A request ends with one terminal item: "stop" at a stop id, "length" at max_tokens
    (the first token counts), "abort" after Abort. Logprobs are fixed (-0.25, rank 1).
  - `pause_after=n`: a request stops after n tokens (first token included) until `resume()`.
  - `fail_transfers=n`: the next n first-token messages end their request with an error item,
    as a real D does when the KV transfer fails (its prefill node died mid-transfer).
  - `corrupt=n`: in each of the next n steps, the first request's item carries a token id
    outside the vocabulary (a broken or hostile node), the step's other items are intact.
  - Prime answers a priming descriptor msgpack {v, node, rid, prime} (recorded in `primes`).
  - `die()` stops the server at once (streams break); `start(port)` can bring a new one up
    at the same address. Status can be told to report `free_blocks_report` instead of the
    real count (least-load tests) and `report_unhealthy`.
Every list of calls (`reserves`, `aborts`, `calls`, ...) records node-side request ids, and
`until(pred)` awaits a state change (no sleeps).
"""

from __future__ import annotations

import asyncio
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import msgpack

from protos import node_pb2, node_pb2_grpc
from protos.convert import unpack_token_ids
from protos.messages import FirstToken, OutputItem, TokenLogprobs, pack_outputs

VOCAB = 320
BLOCK_SIZE = 16


class Watched:
    """`await until(pred)` returns once `pred()` holds; `changed()` re-checks the waiters."""

    def __init__(self) -> None:
        self._waiters: list[tuple[Callable[[], bool], asyncio.Future[None]]] = []

    def changed(self) -> None:
        for pred, fut in list(self._waiters):
            if not fut.done() and pred():
                fut.set_result(None)

    async def until(self, pred: Callable[[], bool], timeout: float = 20.0) -> None:
        if pred():
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (pred, fut)
        self._waiters.append(entry)
        try:
            await asyncio.wait_for(fut, timeout)  # a safety net, not a synchronization
        finally:
            self._waiters.remove(entry)


class _Server(Watched):
    name: str

    def __init__(self) -> None:
        super().__init__()
        self.server: grpc.aio.Server | None = None
        self.address = ""
        self.dead = False

    async def start(self, add: Callable[[object, grpc.aio.Server], None], port: int = 0) -> str:
        self.server = grpc.aio.server()
        add(self, self.server)
        port = self.server.add_insecure_port(f"127.0.0.1:{port}")
        await self.server.start()
        self.address = f"127.0.0.1:{port}"
        return self.address

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(0)

    async def die(self) -> None:
        """Stop serving at once: open streams break, calls answer UNAVAILABLE."""
        self.dead = True
        await self.stop()
        self.changed()


def fake_logprobs(tokens: list[int], n: int, first_lp: float) -> TokenLogprobs:
    return TokenLogprobs([first_lp] * len(tokens), [1] * len(tokens),
                         [[(t + j) % VOCAB for j in range(n)] for t in tokens],
                         [[first_lp - j for j in range(n)] for _ in tokens])


# ---- decode -----------------------------------------------------------------------------
@dataclass
class _Seq:
    rid: str
    prompt_len: int
    sampling: node_pb2.Sampling
    blocks: int
    started: bool = False
    generated: int = 0
    cursor: int = 0


class FakeDecode(_Server, node_pb2_grpc.DecodeControlServicer):
    def __init__(self, name: str, script: bytes | list[int] = b"hello world ", total_blocks: int = 1000,
                 pause_after: int | None = None, num_speculative_tokens: int = 2) -> None:
        super().__init__()
        self.name = name
        self.script = list(script)
        self.total_blocks = total_blocks
        self.pause_after = pause_after
        self.k = num_speculative_tokens
        self.refuse = False
        self.fail_transfers = 0
        self.corrupt = 0
        self.reserve_gate: asyncio.Event | None = None  # Reserve decides, then waits for it
        self.free_blocks_report: int | None = None
        self.report_unhealthy = False
        self.seqs: dict[str, _Seq] = {}
        self.reserves: list[str] = []
        self.admitted: list[str] = []
        self.first_tokens: list[str] = []
        self.aborts: list[str] = []
        self.finished: dict[str, str] = {}  # rid -> terminal reason sent
        self.subscribers: list[asyncio.Queue[bytes]] = []
        self.primes: list[str] = []
        self._resumed = asyncio.Event()
        self._work = asyncio.Event()
        self._batches = itertools.cycle((1, 2, 3))
        self._stepper: asyncio.Task[None] | None = None

    async def start(self, port: int = 0) -> str:  # type: ignore[override]
        address = await super().start(node_pb2_grpc.add_DecodeControlServicer_to_server, port)
        self._stepper = asyncio.create_task(self._step_loop())
        return address

    async def stop(self) -> None:
        if self._stepper is not None:
            self._stepper.cancel()
        await super().stop()

    @property
    def held(self) -> int:
        return len(self.seqs)

    @property
    def free_blocks(self) -> int:
        return self.total_blocks - sum(s.blocks for s in self.seqs.values())

    def resume(self) -> None:
        self.pause_after = None
        self._resumed.set()
        self._work.set()

    # ---- RPCs ---------------------------------------------------------------------------
    async def Reserve(self, request, context):  # noqa: N802
        if not 0 < len(request.request_id) <= 256:  # as the real nodes check
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id must be 1..256 characters")
        self.reserves.append(request.request_id)
        blocks = math.ceil((request.prompt_len + request.sampling.max_tokens) / BLOCK_SIZE)
        refuse = self.refuse
        if self.reserve_gate is not None:
            self.changed()
            await self.reserve_gate.wait()
        try:
            if refuse:
                return node_pb2.ReserveReply(admitted=False, reason="refusing (test)")
            if blocks > self.free_blocks:
                return node_pb2.ReserveReply(admitted=False, reason="no free KV blocks")
            self.seqs[request.request_id] = _Seq(request.request_id, request.prompt_len, request.sampling, blocks)
            self.admitted.append(request.request_id)
            desc = msgpack.packb({"v": 1, "node": self.name, "rid": request.request_id})
            return node_pb2.ReserveReply(admitted=True, descriptor_msgpack=desc)
        finally:
            self.changed()

    async def Prime(self, request, context):  # noqa: N802
        self.primes.append(request.request_id)
        self.changed()
        desc = msgpack.packb({"v": 1, "node": self.name, "rid": request.request_id, "prime": True})
        return node_pb2.ReserveReply(admitted=True, descriptor_msgpack=desc)

    async def FirstToken(self, request, context):  # noqa: N802
        first = FirstToken.unpack(request.msgpack, VOCAB, max_drafts=8)
        self.first_tokens.append(first.request_id)
        seq = self.seqs.get(first.request_id)
        if seq is None:
            self.changed()
            return node_pb2.Ack(ok=False, reason="unknown request")
        if first.finished:
            del self.seqs[first.request_id]  # released silently: the router sends the terminal
        elif self.fail_transfers > 0:
            self.fail_transfers -= 1
            del self.seqs[first.request_id]
            self._publish([OutputItem(first.request_id, [], error="KV transfer failed: sender gone (test)")])
        else:
            seq.started, seq.generated = True, 1
            self._work.set()
        self.changed()
        return node_pb2.Ack(ok=True)

    async def Abort(self, request, context):  # noqa: N802
        self.aborts.append(request.request_id)
        seq = self.seqs.pop(request.request_id, None)
        if seq is not None and seq.started:
            self._publish([OutputItem(seq.rid, [], finish_reason="abort")])
        self.changed()
        return node_pb2.Ack(ok=True)

    async def Outputs(self, request, context):  # noqa: N802
        queue: asyncio.Queue[bytes] = asyncio.Queue()
        self.subscribers.append(queue)
        await context.send_initial_metadata((("pdserve-outputs", "subscribed"),))
        self.changed()
        try:
            while True:
                yield node_pb2.Payload(msgpack=await queue.get())
        finally:
            self.subscribers.remove(queue)

    async def Status(self, request, context):  # noqa: N802
        free = self.free_blocks if self.free_blocks_report is None else self.free_blocks_report
        return node_pb2.NodeStatus(node_id=self.name, kind="decode", healthy=not self.report_unhealthy,
                                   free_blocks=free,
                                   total_blocks=self.total_blocks, running=len(self.seqs),
                                   num_speculative_tokens=self.k)

    # ---- the "decode loop" --------------------------------------------------------------
    def _publish(self, items: list[OutputItem]) -> None:
        data = pack_outputs(items)
        for q in self.subscribers:
            q.put_nowait(data)

    def _runnable(self) -> list[_Seq]:
        return [s for s in self.seqs.values()
                if s.started and (self.pause_after is None or s.generated < self.pause_after)]

    async def _step_loop(self) -> None:
        while True:
            seqs = self._runnable()
            if not seqs:
                self._work.clear()
                self.changed()
                await self._work.wait()
                continue
            items = [self._advance(s) for s in seqs]
            if self.corrupt > 0:
                self.corrupt -= 1
                items[0].tokens = [*items[0].tokens, VOCAB + 7]
            self._publish(items)
            self.changed()
            await asyncio.sleep(0)

    def _advance(self, s: _Seq) -> OutputItem:
        toks: list[int] = []
        finish = None
        for _ in range(next(self._batches)):
            tok = self.script[s.cursor % len(self.script)]
            s.cursor += 1
            s.generated += 1
            toks.append(tok)
            if tok in s.sampling.stop_token_ids:
                finish = "stop"
            elif s.generated >= s.sampling.max_tokens:
                finish = "length"
            if finish or (self.pause_after is not None and s.generated >= self.pause_after):
                break
        n = s.sampling.logprobs
        item = OutputItem(s.rid, toks, n if n >= 0 else None, fake_logprobs(toks, n, -0.25) if n >= 0 else None,
                          finish_reason=finish, steps=1, accepted=len(toks) - 1)
        if finish:
            del self.seqs[s.rid]
            self.finished[s.rid] = finish
        return item


# ---- prefill ----------------------------------------------------------------------------
class _Refused(Exception):
    """A request's failure: its answer on the stream carries the code and message."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class FakePrefill(_Server, node_pb2_grpc.PrefillControlServicer):
    def __init__(self, name: str, queued_tokens: int = 0) -> None:
        super().__init__()
        self.name = name
        self.queued_tokens = queued_tokens
        self.status_delay_s = 0.0
        self.fail = False
        self.fail_after_first_token = False
        self.hold_failure: asyncio.Event | None = None  # when to fail, after the first token
        self.hold: asyncio.Event | None = None
        self.calls: list[str] = []
        self.prompts: list[tuple[list[int], int]] = []  # per call: prompt ids, max_tokens
        self.aborts: list[str] = []
        self.active: set[str] = set()
        self.deferred: list[str] = []  # Prefill requests made without a descriptor (it comes by Attach)
        self.attaches: list[str] = []  # request ids whose descriptor came by Attach
        self.refuse_attaches = 0  # the next this many Attach calls answer NOT_FOUND (D never hears)
        self.takes_attach = True  # False: its Status says it needs the descriptor with the call (TP)
        self.primes: list[tuple[str, str]] = []  # (request id, decode address) of each Prime call
        self.prime_hold: asyncio.Event | None = None
        self.refuse_primes = False
        self.streams = 0  # PrefillStream calls opened
        self.cancels: list[str] = []  # request ids cancelled on a PrefillStream
        self._attached: dict[str, asyncio.Future[str | None]] = {}  # request id -> its decode address
        self._decode_stubs: dict[str, node_pb2_grpc.DecodeControlStub] = {}
        self._channels: list[grpc.aio.Channel] = []

    async def start(self, port: int = 0) -> str:  # type: ignore[override]
        return await super().start(node_pb2_grpc.add_PrefillControlServicer_to_server, port)

    @property
    def held(self) -> int:
        return len(self.active)

    async def stop(self) -> None:
        await super().stop()
        for channel in self._channels:
            await channel.close()

    async def _prefill(self, request) -> FirstToken:
        """One request's first token, sent to its decode node first; _Refused when it fails."""
        self.calls.append(request.request_id)
        self.prompts.append((unpack_token_ids(request.prompt_token_ids_packed, VOCAB), request.sampling.max_tokens))
        if self.fail:
            self.changed()
            raise _Refused(grpc.StatusCode.UNAVAILABLE, f"prefill node {self.name} is down (test)")
        self.active.add(request.request_id)
        self.changed()
        try:
            if self.hold is not None:
                await self.hold.wait()
            first = FirstToken(request.request_id, *self._first(request))
            address = request.decode_address
            if not address:  # the descriptor comes by Attach; unlike the real node, the answer waits for it
                self.deferred.append(request.request_id)
                address = await self._attach_future(request.request_id)
                if address is None:  # the Attach was refused: answer, D never hears of it
                    return first
            stub = self._decode_stubs.get(address)
            if stub is None:
                channel = grpc.aio.insecure_channel(address)
                self._channels.append(channel)
                stub = self._decode_stubs[address] = node_pb2_grpc.DecodeControlStub(channel)
            await stub.FirstToken(node_pb2.Payload(msgpack=first.pack()))
            if self.fail_after_first_token:  # D already decodes; the router never hears back
                if self.hold_failure is not None:
                    await self.hold_failure.wait()
                raise _Refused(grpc.StatusCode.UNAVAILABLE, f"prefill node {self.name} crashed (test)")
            return first
        finally:
            self.active.discard(request.request_id)
            self._attached.pop(request.request_id, None)  # a client may reuse its request id later
            self.changed()

    async def PrefillStream(self, request_iterator, context):  # noqa: N802
        """Each request runs as a task of its own (`_prefill`); a cancellation cancels its task and is
        recorded in `cancels`; the stream's end cancels them all."""
        self.streams += 1
        self.changed()
        replies: asyncio.Queue[node_pb2.PrefillStreamReply | None] = asyncio.Queue()
        tasks: dict[str, asyncio.Task] = {}
        reader = asyncio.create_task(self._read_stream(request_iterator, tasks, replies))
        try:
            while (reply := await replies.get()) is not None:
                yield reply
        finally:
            reader.cancel()
            for task in tasks.values():
                task.cancel()

    async def _read_stream(self, requests, tasks: dict[str, asyncio.Task], replies: asyncio.Queue) -> None:
        try:
            async for msg in requests:
                if msg.WhichOneof("kind") == "prefill":
                    rid = msg.prefill.request_id
                    tasks[rid] = asyncio.create_task(self._stream_one(msg.prefill, replies))
                    tasks[rid].add_done_callback(lambda t, rid=rid: tasks.pop(rid, None) if tasks.get(rid) is t else None)
                elif msg.WhichOneof("kind") == "cancel":
                    self.cancels.append(msg.cancel.request_id)
                    task = tasks.pop(msg.cancel.request_id, None)
                    if task is not None:
                        task.cancel()
                    self.changed()
        finally:
            replies.put_nowait(None)

    async def _stream_one(self, request, replies: asyncio.Queue) -> None:
        try:
            first = await self._prefill(request)
        except _Refused as e:
            replies.put_nowait(node_pb2.PrefillStreamReply(request_id=request.request_id, code=e.code.value[0],
                                                           details=e.details))
            return
        replies.put_nowait(node_pb2.PrefillStreamReply(request_id=request.request_id,
                                                       first_token_msgpack=first.pack()))

    def _attach_future(self, rid: str) -> asyncio.Future[str | None]:
        if rid not in self._attached:
            self._attached[rid] = asyncio.get_running_loop().create_future()
        return self._attached[rid]

    async def Attach(self, request, context):  # noqa: N802
        self.attaches.append(request.request_id)
        future = self._attach_future(request.request_id)
        refuse = self.refuse_attaches > 0
        self.refuse_attaches -= refuse
        if not future.done():
            future.set_result(None if refuse else request.decode_address)
        self.changed()
        if refuse:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"{request.request_id}: no such prefill job (test)")
        return node_pb2.Ack(ok=True)

    async def Prime(self, request, context):  # noqa: N802
        self.primes.append((request.request_id, request.decode_address))
        self.changed()
        if self.prime_hold is not None:
            await self.prime_hold.wait()
        return node_pb2.Ack(ok=not self.refuse_primes, reason="refusing (test)" if self.refuse_primes else "")

    @staticmethod
    def _first(request) -> tuple:
        tok = (unpack_token_ids(request.prompt_token_ids_packed, VOCAB)[-1] + 1) % VOCAB
        s = request.sampling
        n = s.logprobs if s.logprobs >= 0 else None
        lps = fake_logprobs([tok], n, -0.5) if n is not None else None
        finished = "stop" if tok in s.stop_token_ids else "length" if s.max_tokens <= 1 else None
        return tok, n, lps, [], b"", finished

    async def Abort(self, request, context):  # noqa: N802
        self.aborts.append(request.request_id)
        waiting = self._attached.pop(request.request_id, None)
        if waiting is not None and not waiting.done():  # its request waits for a descriptor: it ends
            waiting.set_exception(RuntimeError(f"{request.request_id} aborted (test)"))
        self.changed()
        return node_pb2.Ack(ok=True)

    async def Status(self, request, context):  # noqa: N802
        if self.fail:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "down (test)")
        if self.status_delay_s:  # busy: the answer comes after the router's deadline
            await asyncio.sleep(self.status_delay_s)
        return node_pb2.NodeStatus(node_id=self.name, kind="prefill", healthy=True, running=len(self.active),
                                   takes_attach=self.takes_attach, queued_tokens=self.queued_tokens)
