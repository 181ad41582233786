"""The process's UCX worker (``Driver``): control sends and receives, data sends, the receive
lanes, retiring receives that may never match; progressed by the runtime loop thread itself."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import settings
from kvtransfer.ucx.core import (
    EMPTY,
    SPIN,
    Array,
    Done,
    cached_endpoint,
    ignore,
    settle,
    ucx_api,
)
from kvtransfer.ucx.lanes import Lane, LaneRecv

LANES = settings.UCX_LANES
"""Receive lanes per process: layer ``l`` is pulled by lane ``l % LANES`` (see ``Lane``)."""
SENT_POLL_S = 2e-3
"""How often the driver reaps its data sends while some are pending (see ``Driver.send_data``);
the interval doubles, up to 1 s, while none completes (sends to a receiver that died)."""
log = logging.getLogger(__name__)


class Driver:
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
        self._lanes: list[Lane] = []
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
        handled, say), which takes the sender's loop thread about a third less CPU a transfer.
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
        return cached_endpoint(self.data_worker, self._data_endpoints, addr)

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

    def lanes(self) -> list[Lane]:
        """The process's receive lanes, started on first use (on the loop thread)."""
        if not self._lanes:
            self._lanes = [Lane(self.context, i, self._loop) for i in range(LANES)]
        return self._lanes

    def heat(self, reqs: list[Any], hot: bool = True) -> None:
        """Spin (or stop spinning, ``hot=False``) for these receives while they are pending."""
        lanes: set[Lane] = set()
        for req in reqs:
            if isinstance(req, LaneRecv):
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
                if not req.completed and not (isinstance(req, LaneRecv) and req.lane.cancel(req))]
        if not live:
            return True
        for tag, req in live:
            address = req.lane.address if isinstance(req, LaneRecv) else self.address
            self.send(self.endpoint(address), EMPTY, tag, ignore)
        deadline = time.monotonic() + patience_s
        while not all(req.completed for _tag, req in live):
            if time.monotonic() > deadline:
                self.heat([req for _tag, req in live], False)
                return False
            self.worker.progress()
        return True

    def send_future(self, ep: Any, buf: Any, tag: int) -> asyncio.Future[None]:
        fut: asyncio.Future[None] = self._loop.create_future()
        self.send(ep, buf, tag, lambda exc: settle(fut, exc))
        return fut

    def recv_future(self, buf: Any, tag: int) -> asyncio.Future[None]:
        fut: asyncio.Future[None] = self._loop.create_future()
        self.recv(buf, tag, lambda exc: settle(fut, exc))
        return fut

    def endpoint(self, addr: bytes) -> Any:
        """A cached endpoint to the worker at ``addr`` (wire-up completes in progress)."""
        return cached_endpoint(self.worker, self._endpoints, addr)

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
