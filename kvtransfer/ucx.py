"""UCX transport (ucxx): shared memory on one host, CUDA IPC between GPUs, RDMA/TCP across.

Endpoints are made from *worker addresses* (carried in the descriptor and in
``begin``), not from IP:port, so UCX picks shared memory / CUDA IPC on one host;
endpoint error handling is off because with it UCX falls back to TCP (~0.7 GB/s vs
~5 GB/s here). A dead peer is therefore noticed by the ``timeout_s`` watchdogs.

Messages are tagged sends, not RMA: ucxx's Python API exposes no memory
registration or put/get, and large tagged sends already use UCX's zero-copy
rendezvous protocol (the receiver pulls). Tags:
- control to a receiver: ``CTRL | receiver id``; acks to a sender: ``ACK | sender id``;
  both carry ``wire.seal`` frames (magic, length, crc32) into a fixed buffer.
- data: ``serial << 31 | layer << 21 | announced << 20 | run * planes + plane``, where
  ``serial`` is 32 bits derived from the transfer token (``wire.token_serial``), unique among
  the receiving process's recent requests, so a stale message never matches another request's
  receive and a sender without the token (one the router did not introduce) cannot name a
  posted receive; ``announced`` says the layer's runs came in a ``layers`` message rather than
  being the destination's own (pre-posted) runs.
- authentication: UCX messages carry no sender identity, so every control message carries the
  transfer token and is dropped without it (``authenticate``), before ``begin`` makes an
  endpoint or anything is posted for it. Pre-posted receives wait for data under tags only a
  holder of the token can compute; guessing one means guessing 32 bits per pending request.

Receives are posted as soon as ``expect`` is called (queued on the loop; ``expect`` does
not wait), before the sender exists: every layer, over the destination's own runs
(maximal stretches of consecutive destination blocks). A sender
whose source is contiguous wherever the destination is (the usual case) sends into them
without any announcement; nothing on the receiver stands between ``begin`` and the first
byte. A layer with other runs is announced; its pre-posted receives are retired and the
announced runs posted under the ``announced`` tags, so the two can never mix.

Threads: the process-wide loop thread (``runtime()``, shared by every UcxSender and
UcxReceiver of the process) and, in a receiving process, ``PDSERVE_UCX_LANES`` lane
threads (default 2). ucxx's asyncio layer (progress thread, ``Request.wait`` polling with
``sleep(0)``) is not used; ``_Driver`` drives ucxx's core API from the loop thread, as
ucx_perftest does: post, ``worker.progress()``, reap completions by callback, sleep on
the worker's epoll descriptor when idle. Control messages go through the driver's worker;
data sends through its second, never-armed worker, reaped on a timer (``send_data``). Data
receives go to the lanes (``_Lane``): one UCX worker and thread
each, layer ``l`` on lane ``l % lanes``, whose addresses the descriptor carries. The
receiver pulls the bytes, so the lanes copy in parallel; a lane busy-polls only while
receives of a transfer that began are pending. ``UCXPY_*`` variables have no effect;
``PDSERVE_UCX_SPIN=0`` turns the busy-polling off. ``UCX_*`` variables apply.

Careful: ucxx 0.52 cannot cancel a posted receive from Python. A receive that must go
(its transfer failed, or its layer was announced with other runs) is *retired*: the
receiver sends a zero-byte message with its tag to its own worker, which completes it
without writing a byte; a request turns terminal only once all its receives completed,
so a late send from an aborted sender can never land in blocks that were handed back.
(A receive already matched to a sender's data completes with that data first; the
zero-byte message then stays in UCX's unexpected queue, a few bytes.)
"""

from __future__ import annotations

import asyncio
import collections
import ipaddress
import logging
import os
import secrets
import select
import threading
import time
from collections.abc import Callable
from typing import Any, cast

import numpy as np
import torch

from kvtransfer import wire
from kvtransfer.base import Descriptor
from kvtransfer.layout import coalesce
from kvtransfer.loop import LoopThread
from kvtransfer.receiver import ProtocolError, StreamingReceiver, _In, _log_failure
from kvtransfer.sender import Link, StreamingSender

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
# ucxx's synchronous core API (what its asyncio layer is built on); UCX reads UCX_* here.
from ucxx._lib import libucxx as ucx_api  # noqa: E402
from ucxx._lib.arr import Array  # noqa: E402

CTRL = 1 << 63
ACK = 3 << 62
SPIN = os.environ.get("PDSERVE_UCX_SPIN", "1") != "0"
"""Busy-poll the worker while data receives are in flight (see ``_Driver``)."""
LANES = max(1, int(os.environ.get("PDSERVE_UCX_LANES", "2")))
"""Receive lanes per process: layer ``l`` is pulled by lane ``l % LANES`` (see ``_Lane``)."""
FLUSH_S = 1e-3
"""A lane hands completions to the loop at least this often while it has some."""
SENT_POLL_S = 2e-3
"""How often the driver reaps its data sends while some are pending (see ``_Driver.send_data``);
the interval doubles, up to 1 s, while none completes (sends to a receiver that died)."""
log = logging.getLogger(__name__)
_runtime: LoopThread | None = None
_driver: _Driver | None = None
_runtime_lock = threading.Lock()

Done = Callable[[BaseException | None], None]


class _Driver:
    """The process's UCX worker, progressed by the runtime loop thread itself.

    ucx_perftest's model: one thread posts, progresses and reaps. No ucxx progress or
    notifier thread, and no per-request coroutine polling (ucxx's ``Request.wait``
    spins the event loop with ``sleep(0)`` while any request is pending, which made
    every process with a posted control receive burn a core forever). Completion is
    a callback run on the loop after ``worker.progress()``. While receives posted here
    ``hot`` are pending the loop busy-polls, as perftest does (data receives live on the
    lanes, so in practice it never does); otherwise it arms the worker and leaves the loop
    idle until the worker's epoll descriptor turns readable, so an idle process costs
    nothing. A sender never spins: under the rendezvous protocol the receiver pulls the
    bytes (CMA / CUDA IPC / RDMA read) and the sender only learns of completion.
    """

    def __init__(self) -> None:
        self.context = ucx_api.UCXContext({}, (ucx_api.Feature.TAG, ucx_api.Feature.WAKEUP))
        self.worker = ucx_api.UCXWorker(self.context, False, False)
        self.worker.init_blocking_progress_mode()
        self.address = bytes(self.worker.address.tobytes())
        self.hot = 0
        self._pending: dict[int, tuple[Any, Any, Done, bool]] = {}  # id(req) -> req, buf, done, hot
        self._loop = asyncio.get_running_loop()
        self._fd = self.worker.epoll_file_descriptor
        self._scheduled = False
        self._endpoints: dict[bytes, Any] = {}
        self._lanes: list[_Lane] = []
        # Data sends go out on a worker of their own that is never armed: see send_data.
        self.data_worker = ucx_api.UCXWorker(self.context, False, False)
        self._data_endpoints: dict[bytes, Any] = {}
        self._data_pending: list[tuple[Any, Any, Done]] = []  # req, buf, done
        self._data_poll: asyncio.TimerHandle | None = None
        self._data_poll_s = SENT_POLL_S
        self._loop.add_reader(self._fd, self._schedule)  # readable only once armed and woken
        self._tick()

    # -- posting -------------------------------------------------------------------
    def send(self, ep: Any, buf: Any, tag: int, done: Done, hot: bool = False) -> None:
        arr = Array(buf)
        self._track(ep.tag_send(arr, ucx_api.UCXXTag(tag)), arr, done, hot)

    def recv(self, buf: Any, tag: int, done: Done, hot: bool = False) -> Any:
        arr = Array(buf)
        req = self.worker.tag_recv(arr, ucx_api.UCXXTag(tag))
        self._track(req, arr, done, hot)
        return req

    def send_data(self, ep: Any, buf: Any, tag: int, done: Done) -> None:
        """Post a data send on the data worker (``ep`` from ``data_endpoint``).

        Under the rendezvous protocol the receiver pulls the bytes (CMA, CUDA IPC, RDMA
        read) without the sender's help; the sender only hears afterwards, one ATS message
        per send, that a buffer is free. Were that worker armed, each ATS would wake this
        thread (~30 per 64 MiB transfer here), taking a vCPU and the GIL from the copies
        for nothing: ``done`` only extends the lease or fails the transfer. So it is never
        armed: it is progressed every ``SENT_POLL_S`` while sends are pending (less often
        while none completes), and on every pass of the control worker (before an ack is
        handled, say). Measured on 2 vCPUs: the sender's loop thread went from ~3.5 to
        ~2.3 ms of CPU per 64 MiB transfer.
        """
        arr = Array(buf)
        req = ep.tag_send(arr, ucx_api.UCXXTag(tag))
        self._data_pending.append((req, arr, done))
        if self._data_poll is not None and self._data_poll_s > SENT_POLL_S:
            self._data_poll.cancel()  # backed off for stale sends; this one is live
            self._data_poll = None
        if self._data_poll is None:
            self._data_poll_s = SENT_POLL_S
            self._data_poll = self._loop.call_later(SENT_POLL_S, self._sent_poll)

    def data_endpoint(self, addr: bytes) -> Any:
        """A cached endpoint from the data worker to the worker at ``addr``."""
        return _endpoint(self.data_worker, self._data_endpoints, addr)

    def _reap_sent(self) -> int:
        """Progress the data worker and complete its finished sends; how many finished."""
        if not self._data_pending:
            return 0
        self.data_worker.progress()
        pending: list[tuple[Any, Any, Done]] = []
        finished: list[tuple[Any, Any, Done]] = []
        for entry in self._data_pending:
            (finished if entry[0].completed else pending).append(entry)
        self._data_pending = pending
        for req, _buf, done in finished:
            self._finish(req, done)
        return len(finished)

    def _sent_poll(self) -> None:
        self._data_poll = None
        if self._reap_sent():
            self._data_poll_s = SENT_POLL_S
        else:
            self._data_poll_s = min(2 * self._data_poll_s, 1.0)
        if self._data_pending:
            self._data_poll = self._loop.call_later(self._data_poll_s, self._sent_poll)

    def lanes(self) -> list[_Lane]:
        """The process's receive lanes, started on first use (on the loop thread)."""
        if not self._lanes:
            self._lanes = [_Lane(self.context, i, self._loop) for i in range(LANES)]
        return self._lanes

    def heat(self, reqs: list[Any], hot: bool = True) -> None:
        """Spin (or stop spinning, ``hot=False``) for these receives while they are pending."""
        lanes: set[_Lane] = set()
        for req in reqs:
            if isinstance(req, _LaneRecv):
                req.hot = hot
                lanes.add(req.lane)
                continue
            entry = self._pending.get(id(req))
            if entry is not None and entry[3] != hot:
                self._pending[id(req)] = (*entry[:3], hot)
                self.hot += 1 if hot else -1
        if hot:
            for lane in lanes:
                lane.wake()

    def retire(self, posted: list[tuple[int, Any]], patience_s: float = 1.0) -> bool:
        """Complete posted receives ``(tag, request)`` that may never match, writing nothing.

        A zero-byte send to our own worker under each tag completes the receive (or, if a
        sender's data already matched it, waits in UCX's unexpected queue). Progresses the
        worker until every one completed; their handlers run later, from ``_reap``. Returns
        False if some did not within ``patience_s`` (a pull still under way from a peer).
        """
        live = [(tag, req) for tag, req in posted
                if not req.completed and not (isinstance(req, _LaneRecv) and req.lane.cancel(req))]
        if not live:
            return True
        for tag, req in live:
            address = req.lane.address if isinstance(req, _LaneRecv) else self.address
            self.send(self.endpoint(address), _EMPTY, tag, _ignore)
        deadline = time.monotonic() + patience_s
        while not all(req.completed for _tag, req in live):
            if time.monotonic() > deadline:
                self.heat([req for _tag, req in live], False)
                return False
            self.worker.progress()
        return True

    def send_future(self, ep: Any, buf: Any, tag: int) -> asyncio.Future[None]:
        fut: asyncio.Future[None] = self._loop.create_future()
        self.send(ep, buf, tag, lambda exc: _settle(fut, exc))
        return fut

    def recv_future(self, buf: Any, tag: int) -> asyncio.Future[None]:
        fut: asyncio.Future[None] = self._loop.create_future()
        self.recv(buf, tag, lambda exc: _settle(fut, exc))
        return fut

    def endpoint(self, addr: bytes) -> Any:
        """A cached endpoint to the worker at ``addr`` (wire-up completes in progress)."""
        return _endpoint(self.worker, self._endpoints, addr)

    def _track(self, req: Any, buf: Any, done: Done, hot: bool) -> None:
        """Call ``done`` on the loop once ``req`` completes; ``buf`` stays alive till then."""
        if req.completed:  # eager sends, receives of already-arrived messages
            self._loop.call_soon(self._finish, req, done)  # never re-entrant
            return
        self._pending[id(req)] = (req, buf, done, hot)
        self.hot += hot
        self._schedule()  # re-evaluate: spin now, or re-arm

    def _finish(self, req: Any, done: Done) -> None:
        try:
            req.check_error()
            exc: BaseException | None = None
        except Exception as e:  # truncated receive, peer error, cancellation
            exc = e
        try:
            done(exc)
        except Exception:  # a completion handler's bug must not stop progress
            log.exception("ucx completion handler failed")

    # -- progress ------------------------------------------------------------------
    def _reap(self) -> None:
        finished = [e[0] for e in self._pending.values() if e[0].completed]
        for req in finished:  # a handler may heat or cool the others: read each entry now
            _req, _buf, done, hot = self._pending.pop(id(req))
            self.hot -= hot
            self._finish(req, done)

    def _schedule(self) -> None:
        """Make one progress pass run soon (once, however many ask before it runs)."""
        if not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self._pass)

    def _pass(self) -> None:
        """Progress and reap; then poll again (spinning, or events arrived meanwhile), or arm
        the worker and leave the loop idle until its descriptor, a post or the tick wakes it.
        Plain callbacks, no task: a wake-up costs the sender one of these per ack it gets."""
        self._scheduled = False
        self.worker.progress()
        self._reap_sent()  # an ack may be among this pass's messages: its data sends first
        self._reap()
        if (SPIN and self.hot) or not self.worker.arm():
            self._schedule()

    def _tick(self) -> None:
        """Belt and braces: progress at least once a second."""
        self._schedule()
        self._loop.call_later(1.0, self._tick)


class _LaneRecv:
    """A receive handed to a lane; its thread posts it (``req``) soon after."""

    __slots__ = ("lane", "arr", "tag", "done", "hot", "req", "cancelled")

    def __init__(self, lane: _Lane, arr: Any, tag: int, done: Done, hot: bool) -> None:
        self.lane, self.arr, self.tag, self.done, self.hot = lane, arr, tag, done, hot
        self.req: Any = None
        self.cancelled = False

    @property
    def completed(self) -> bool:
        return self.cancelled or (self.req is not None and self.req.completed)


class _Lane:
    """A UCX worker for data receives with a thread of its own that posts, progresses, reaps.

    Under the rendezvous protocol the receiver pulls the bytes, so on one host the copy (CMA)
    runs inside the receiver's ``worker.progress()``, which releases the GIL: lanes copy in
    parallel. One worker copies at what one core moves; measured on the 2-vCPU VM (bare ucxx,
    32 x 2 MiB resident, see BENCHMARKS.md): one lane 7.4-7.9 ms per 64 MiB, two 5.4-6.5 ms.
    The sender sends layer ``l`` to lane ``l % lanes`` (``Descriptor['lanes']``).

    Completion handlers run on the loop thread, in batches (``call_soon_threadsafe``): a
    batch goes when the lane has nothing left pending, before it sleeps, on an error, or
    once its oldest completion waited ``FLUSH_S``; so a transfer wakes the loop about once
    per lane, not once per message (each wake costs the loop thread a GIL hand-over and a
    vCPU the copies need). The lane spins while one of its receives is hot (its sender began, as
    ``_Driver`` does), otherwise it sleeps on its worker's epoll descriptor and an eventfd
    that ``recv``/``heat`` write. Its state is the lane thread's, but for ``cancel`` (under
    ``_lock``): a receive still queued is dropped there, never posted.
    """

    def __init__(self, context: Any, index: int, loop: asyncio.AbstractEventLoop) -> None:
        self.worker = ucx_api.UCXWorker(context, False, False)
        self.worker.init_blocking_progress_mode()
        self.address = bytes(self.worker.address.tobytes())
        self._loop = loop
        self._lock = threading.Lock()
        self._ops: collections.deque[_LaneRecv | Callable[[], None]] = collections.deque()
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._signalled = False  # the eventfd was written and the thread has not looked yet
        self._pending: list[_LaneRecv] = []
        self._batch: list[tuple[Done, BaseException | None]] = []
        self._batch_t0 = 0.0
        threading.Thread(target=self._run, name=f"kv-ucx-lane{index}", daemon=True).start()

    # -- loop side -----------------------------------------------------------------
    def recv(self, buf: Any, tag: int, done: Done, hot: bool) -> _LaneRecv:
        handle = _LaneRecv(self, Array(buf), tag, done, hot)
        self._submit(handle)
        return handle

    def call(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the lane's thread (binding a CUDA device)."""
        self._submit(fn)

    def wake(self) -> None:
        """Make the lane look at its queue and its receives' heat now (once per burst: an
        eventfd write that wakes the thread costs the caller ~20 us here)."""
        if not self._signalled:
            self._signalled = True
            os.eventfd_write(self._wake, 1)

    def cancel(self, handle: _LaneRecv) -> bool:
        """Drop a receive the lane has not posted yet; False if it is posted."""
        with self._lock:
            if handle.req is None:
                handle.cancelled = True
            return handle.cancelled

    def _submit(self, op: _LaneRecv | Callable[[], None]) -> None:
        self._ops.append(op)
        self.wake()

    # -- lane thread ---------------------------------------------------------------
    def _run(self) -> None:
        fd = self.worker.epoll_file_descriptor
        while True:
            try:
                self._signalled = False  # before draining: a later op writes the eventfd again
                while self._ops:
                    self._take(self._ops.popleft())
                self.worker.progress()  # the copies happen here, without the GIL
                if self._pending:
                    self._reap()
                if self._batch and (not self._pending or time.monotonic() - self._batch_t0 > FLUSH_S):
                    self._flush()
                if SPIN and any(h.hot for h in self._pending):
                    os.sched_yield()  # spin, but let a runnable thread (the sender's) have the vCPU
                    continue
                if self._ops or not self.worker.arm():
                    continue
                if self._batch:
                    self._flush()
                if self._wake in select.select([fd, self._wake], [], [], 1.0)[0]:
                    os.eventfd_read(self._wake)
            except Exception:  # never let the lane die: its receives would hang until timeout
                log.exception("ucx lane failed a pass")
                time.sleep(0.01)

    def _take(self, op: _LaneRecv | Callable[[], None]) -> None:
        if not isinstance(op, _LaneRecv):
            op()
            return
        with self._lock:
            if op.cancelled:
                return
            try:
                op.req = self.worker.tag_recv(op.arr, ucx_api.UCXXTag(op.tag))
            except Exception as exc:
                op.cancelled = True
                failed: list[tuple[Done, BaseException | None]] = [(op.done, exc)]
                self._loop.call_soon_threadsafe(_deliver, failed)
                return
        self._pending.append(op)

    def _reap(self) -> None:
        keep, failed = [], False
        for h in self._pending:
            if not h.req.completed:
                keep.append(h)
                continue
            if not self._batch:
                self._batch_t0 = time.monotonic()
            try:
                h.req.check_error()
                self._batch.append((h.done, None))
            except Exception as exc:  # truncated receive, peer error
                self._batch.append((h.done, exc))
                failed = True
        if len(keep) != len(self._pending):
            self._pending = keep
        if failed:
            self._flush()

    def _flush(self) -> None:
        batch, self._batch = self._batch, []
        self._loop.call_soon_threadsafe(_deliver, batch)


def _endpoint(worker: Any, cache: dict[bytes, Any], addr: bytes) -> Any:
    ep = cache.get(addr)
    if ep is None:
        address = ucx_api.UCXAddress.create_from_buffer(np.frombuffer(addr, np.uint8))
        ep = ucx_api.UCXEndpoint.create_from_worker_address(worker, address, False)
        cache[addr] = ep
    return ep


def _deliver(batch: list[tuple[Done, BaseException | None]]) -> None:
    for done, exc in batch:
        try:
            done(exc)
        except Exception:  # a completion handler's bug must not stop the others
            log.exception("ucx completion handler failed")


_EMPTY = np.zeros(0, np.uint8)


def _ignore(exc: BaseException | None) -> None:
    pass


def _settle(fut: asyncio.Future[None], exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is None:
        fut.set_result(None)
    else:
        fut.set_exception(exc)


def restrict_to_loopback(host: str) -> bool:
    """For a local service (``host`` a loopback address): make this process's UCX use only the
    loopback network device, so its TCP listeners do not bind the machine's outward addresses
    (shared memory and CUDA IPC are not network devices and stay). Must run before the first
    UcxSender/UcxReceiver of the process (UCX reads it when its context is made); an explicit
    ``UCX_NET_DEVICES`` wins. Other hosts are left alone: limiting UCX to one IP interface
    would also turn off RDMA devices. Returns whether it restricted."""
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if not loopback or "UCX_NET_DEVICES" in os.environ:
        return False
    with _runtime_lock:
        if _runtime is not None:
            raise RuntimeError("restrict_to_loopback() after UCX started in this process")
        os.environ["UCX_NET_DEVICES"] = "lo"
    return True


def runtime() -> LoopThread:
    """The process's ucxx loop thread, started on first use."""
    global _runtime
    with _runtime_lock:
        if _runtime is None:
            rt = LoopThread("kv-ucx")
            rt.submit(_start_driver()).result(timeout=60)
            _runtime = rt
    return _runtime


def driver() -> _Driver:
    runtime()
    assert _driver is not None
    return _driver


async def _start_driver() -> None:
    global _driver
    _driver = _Driver()


ANNOUNCED = 1 << 20


def data_tag(serial: int, layer: int, index: int, announced: bool = False) -> int:
    """``serial`` (32 bits, from the transfer token) << 31 | layer (10 bits) << 21 | announced |
    message index (20 bits); bit 63 stays clear, so no data tag is a CTRL or ACK tag."""
    if layer >= 1 << 10 or index >= ANNOUNCED:
        raise ValueError(f"layer {layer} or message {index} beyond the tag space")
    return ((serial & 0xFFFFFFFF) << 31) | (layer << 21) | (ANNOUNCED if announced else 0) | index


def _buffer(view: Any) -> Any:
    return view.numpy() if isinstance(view, torch.Tensor) and not view.is_cuda else view


async def send_raw(addr: bytes, tag: int, payload: bytes) -> None:
    """Send ``payload`` as-is to a worker's tag (runs on the runtime loop; for tests)."""
    drv = driver()
    await drv.send_future(drv.endpoint(addr), np.frombuffer(payload, np.uint8), tag)


class _Peer(Link):
    """Sends to one (worker, tag) pair: a receiver's control tag or a sender's ack tag."""

    def __init__(self, ep: Any, tag: int, lanes: list[Any] | None = None) -> None:
        self.ep, self.tag = ep, tag
        self.lanes = lanes or [ep]  # data endpoints: layer l goes to lanes[l % len]

    def send_ctrl(self, msg: dict[str, Any]) -> asyncio.Future[None]:
        """Post the send now (in order with later sends); the future says when it went."""
        return driver().send_future(self.ep, np.frombuffer(wire.seal(msg), np.uint8), self.tag)

    def run_messages(self, views: list[Any]) -> int:
        return len(views)  # one tagged message per plane

    def views(self, layout: Any, layer: int, first_block: int, count: int) -> list[Any]:
        return layout.run_buffers(layer, first_block, count)  # numpy slices for host memory

    def send_run(
        self, desc: Descriptor, layer: int, run: int, views: list[Any], announced: bool,
        sent: Done | None = None,
    ) -> None:
        """Post every plane's send at once; ``sent`` hears of each one's completion."""
        drv, n = driver(), len(views)
        ep = self.lanes[layer % len(self.lanes)]
        serial = wire.token_serial(desc["tok"])  # a sender without the token sends under other tags
        for p, v in enumerate(views):
            drv.send_data(ep, _buffer(v), data_tag(serial, layer, run * n + p, announced), sent or _ignore)


class _CtrlReceiver:
    """Receives sealed control messages on one tag, one at a time, and hands them on.

    A message arriving while none is posted waits in UCX's unexpected queue; the
    receive is re-posted from the completion handler, so no message is lost.
    """

    def __init__(self, tag: int, handle: Callable[[dict[str, Any]], None],
                 on_error: Callable[[Exception], None]) -> None:
        self.tag, self.handle, self.on_error = tag, handle, on_error
        self.buf = np.zeros(wire.SEALED.size + wire.MAX_MESSAGE_BYTES, np.uint8)
        self.closed = False
        self._post()

    def _post(self) -> None:
        if not self.closed:
            self.buf[: wire.SEALED.size] = 0
            driver().recv(self.buf, self.tag, self._done)

    def _done(self, exc: BaseException | None) -> None:
        if self.closed:
            return
        try:
            if exc is not None:  # e.g. truncated: an oversized message
                raise exc
            self.handle(wire.unseal(memoryview(cast(Any, self.buf))))
        except Exception as e:  # wire or protocol error
            self.on_error(e)
        self._post()


class UcxReceiver(StreamingReceiver):
    backend = "ucx"
    _owns_loop = False
    _preposts = True

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._tag = CTRL | secrets.randbits(32)
        self._peers: dict[tuple[bytes, int], _Peer] = {}
        self._posted: dict[str, dict[int, tuple[Any, _PostedRun]]] = {}  # rid -> tag -> pending receive
        self._ctrl = self._thread.submit(self._open_ctrl()).result(timeout=30)

    async def _open_ctrl(self) -> _CtrlReceiver:
        self._data_lanes = driver().lanes()
        return _CtrlReceiver(self._tag, self._dispatch, self._bad)

    def _make_loop(self) -> LoopThread:
        return runtime()

    def register(self, layout: Any) -> None:
        super().register(layout)
        _bind_device(self._thread, layout.device)
        if layout.device.type == "cuda":
            # CUDA IPC pulls are copy-engine work a lane only enqueues and polls: one lane
            # keeps up, and a second only adds a spinning thread and a hand-over (2x H200,
            # 512 MiB: 166 GB/s with one lane, 151 with two; BENCHMARKS.md).
            self._data_lanes = self._data_lanes[:1]

    def _address(self) -> tuple[bytes, int]:
        return driver().address, self._tag

    def _lanes(self) -> list[bytes]:
        return [lane.address for lane in self._data_lanes]

    async def _reply(self, link: Any, msg: dict[str, Any]) -> None:
        await link.send_ctrl(msg)

    def _send(self, link: Any, msg: dict[str, Any]) -> None:
        """Post now, from the handler that decided it: no task, no loop pass before the ack
        leaves (the base's ``wait_for`` task took ~0.3 ms here). A posted send needs no
        timeout: a request stays tracked until UCX completes it."""
        try:
            sent = link.send_ctrl(msg)
        except Exception as exc:  # as the base logs a reply that failed: the peer may be gone
            log.debug("kvtransfer reply not posted: %r", exc)
            return
        sent.add_done_callback(_log_failure)

    def _bad(self, exc: Exception) -> None:
        if not isinstance(exc, wire.WireError):
            exc = wire.WireError(f"bad control message: {type(exc).__name__}: {exc}")
        self._protocol_error(None, exc)

    def _dispatch(self, msg: dict[str, Any]) -> None:
        if msg["t"] == "begin":
            self.authenticate(msg)  # before an endpoint is made to the address it names
            link: Any = self._peer(msg)
        else:
            with self._lock:
                rec = self._in.get(msg.get("rid", ""))
            link = rec.link if rec is not None else None
        self._on_message(msg, link)

    def _peer(self, msg: dict[str, Any]) -> _Peer:
        key = (msg["reply"], msg["ack_tag"])
        if not isinstance(key[0], bytes) or not key[1] & ACK == ACK:
            raise ProtocolError(msg["rid"], "begin without a ucx reply address and ack tag")
        if key not in self._peers:
            try:
                ep = driver().endpoint(key[0])
            except Exception as exc:
                raise ProtocolError(msg["rid"], f"bad reply address: {exc}") from None
            self._peers[key] = _Peer(ep, key[1])
        return self._peers[key]

    def _prepost(self, rec: _In) -> None:
        """Post every layer's receives over the destination's own runs; cold until ``begin``.

        Queued by ``expect``, which does not wait for it: the loop may be inside a copy.
        A ``begin`` or ``layers`` message handled in the same progress pass can come first;
        announced layers keep their own receives. (``finish`` cannot come first: the
        sender finishes only after all its data was received.)"""
        layers = [layer for layer in rec.layers if layer not in rec.announced]
        if not rec.state.terminal and layers:
            runs = [[r.index, r.count] for r in coalesce(rec.blocks, rec.blocks)]
            self._post(rec, layers, runs, announced=False, hot=rec.link is not None)

    def _on_begin(self, rec: _In, msg: dict[str, Any], link: Any) -> None:
        super()._on_begin(rec, msg, link)
        driver().heat([req for req, _run in self._posted.get(rec.rid, {}).values()])

    def _announce(self, rec: _In, layers: list[int], runs: list[list[int]]) -> None:
        """Other runs than the pre-posted ones: retire those layers' receives, post these."""
        self._check_runs(rec, runs)
        posted = self._posted.get(rec.rid, {})
        old = [(tag, req) for tag, (req, run) in posted.items() if run.layer in layers]
        self._retire(rec, old)
        for key in [k for k in rec.views if k[0] in layers]:
            del rec.views[key]
        self._post(rec, layers, runs, announced=True, hot=True)

    def _post(self, rec: _In, layers: list[int], runs: list[list[int]], announced: bool, hot: bool) -> None:
        assert self.layout is not None
        posted, lanes = self._posted.setdefault(rec.rid, {}), self._data_lanes
        for layer in layers:
            lane = lanes[layer % len(lanes)]
            rec.remaining[layer] = len(runs)
            for i, (index, count) in enumerate(runs):
                views = self.layout.run_buffers(layer, rec.blocks[index], count)
                rec.views[(layer, i)] = views
                run = _PostedRun(self, rec, layer, i, len(views))
                for p, v in enumerate(views):
                    tag = data_tag(rec.serial, layer, i * len(views) + p, announced)
                    posted[tag] = (lane.recv(_buffer(v), tag, run.landed(posted, tag), hot), run)

    def _retire(self, rec: _In, posted: list[tuple[int, Any]]) -> None:
        """Take these receives out of play before their blocks are handed back."""
        table = self._posted.get(rec.rid, {})
        for tag, _req in posted:
            table.pop(tag)[1].live = False
        if not driver().retire(posted):
            log.warning("%s: %d receives still under way after the transfer ended",
                        rec.rid, sum(not req.completed for _tag, req in posted))

    def _end(self, rec: _In, state: Any, reason: str) -> None:
        if not rec.state.terminal:
            self._retire(rec, [(tag, req) for tag, (req, _run) in self._posted.get(rec.rid, {}).items()])
            self._posted.pop(rec.rid, None)
        super()._end(rec, state, reason)

    async def _close_transport(self) -> None:
        self._ctrl.closed = True


class _PostedRun:
    """The plane receives of one run of one layer; ``live`` until retired."""

    __slots__ = ("receiver", "rec", "layer", "run", "left", "live")

    def __init__(self, receiver: UcxReceiver, rec: _In, layer: int, run: int, planes: int) -> None:
        self.receiver, self.rec, self.layer, self.run, self.left = receiver, rec, layer, run, planes
        self.live = True

    def landed(self, posted: dict[int, Any], tag: int) -> Done:
        def done(exc: BaseException | None) -> None:
            if not self.live:
                return
            posted.pop(tag, None)
            if exc is not None:
                self.receiver._fail(self.rec, f"receive failed: {type(exc).__name__}: {exc}")
                return
            self.left -= 1
            if self.left == 0:
                self.receiver._on_run_done(self.rec.rid, self.layer, self.run)
        return done


class UcxSender(StreamingSender):
    backend = "ucx"
    _owns_loop = False
    _preposted = True

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._tag = ACK | secrets.randbits(32)
        self._peers: dict[tuple[Any, ...], _Peer] = {}
        self._ctrl = self._thread.submit(self._open_ctrl()).result(timeout=30)

    async def _open_ctrl(self) -> _CtrlReceiver:
        return _CtrlReceiver(self._tag, self._on_message, self._bad)

    def _make_loop(self) -> LoopThread:
        return runtime()

    def register(self, layout: Any) -> None:
        super().register(layout)
        _bind_device(self._thread, layout.device)

    def _reply_info(self) -> tuple[bytes, int]:
        return driver().address, self._tag

    def _bad(self, exc: Exception) -> None:
        self._on_message(wire.make("error", reason=str(exc)[: wire.MAX_STR]))

    async def _open(self, desc: Descriptor) -> Link:
        addr, tag, lanes = desc["addr"], desc["tag"], desc["lanes"]
        if not isinstance(addr, bytes) or tag & ACK != CTRL:
            raise ValueError("ucx descriptor without a worker address and control tag")
        if not lanes or not all(isinstance(a, bytes) for a in lanes):
            raise ValueError("ucx descriptor without lane worker addresses")
        key = (addr, tag, *lanes)
        if key not in self._peers:
            drv = driver()
            self._peers[key] = _Peer(drv.endpoint(addr), tag, [drv.data_endpoint(a) for a in lanes])
        return self._peers[key]

    async def _close_transport(self) -> None:
        self._ctrl.closed = True


def _bind_device(thread: LoopThread, device: torch.device) -> None:
    """CUDA memory: the progressing (loop) thread needs the device's context current."""
    if device.type == "cuda":
        thread.submit(_set_device(device)).result(timeout=60)


async def _set_device(device: torch.device) -> None:
    _bind(device)
    for lane in driver().lanes():  # a lane's thread pulls (CUDA IPC) into this device's memory
        lane.call(lambda: _bind(device))


def _bind(device: torch.device) -> None:
    torch.cuda.set_device(device)
    torch.empty(1, device=device)  # creates the primary context if not yet there
