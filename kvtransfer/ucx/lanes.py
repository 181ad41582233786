"""The receive lanes: UCX workers for data receives, each with a thread of its own that posts,
progresses and reaps, so the pulls of different layers copy in parallel (see ``Lane``)."""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import select
import threading
import time
from collections.abc import Callable
from typing import Any

from kvtransfer.ucx.core import SPIN, Array, Done, deliver, ucx_api

FLUSH_S = 1e-3
"""A lane hands completions to the loop at least this often while it has some."""
log = logging.getLogger(__name__)


class LaneRecv:
    """A receive handed to a lane; its thread posts it (``req``) soon after."""

    __slots__ = ("lane", "arr", "tag", "done", "hot", "req", "cancelled")

    def __init__(self, lane: Lane, arr: Any, tag: int, done: Done, hot: bool) -> None:
        self.lane, self.arr, self.tag, self.done, self.hot = lane, arr, tag, done, hot
        self.req: Any = None
        self.cancelled = False

    @property
    def completed(self) -> bool:
        return self.cancelled or (self.req is not None and self.req.completed)


class Lane:
    """A UCX worker for data receives with a thread of its own that posts, progresses, reaps.

    Under the rendezvous protocol the receiver pulls the bytes, so on one host the copy (CMA)
    runs inside the receiver's ``worker.progress()``, which releases the GIL: lanes copy in
    parallel. One worker copies at what one core moves, so a second lane on a second core
    shortens a transfer (BENCHMARKS.md, UCX lanes).
    The sender sends layer ``l`` to lane ``l % lanes`` (``Descriptor['lanes']``).

    Completion handlers run on the loop thread, in batches (``call_soon_threadsafe``): a
    batch goes when the lane has nothing left pending, before it sleeps, on an error, or
    once its oldest completion waited ``FLUSH_S``; so a transfer wakes the loop about once
    per lane, not once per message (each wake costs the loop thread a GIL hand-over and a
    vCPU the copies need). The lane spins while one of its receives is hot (its sender began, as
    ``Driver`` does), otherwise it sleeps on its worker's epoll descriptor and an eventfd
    that ``recv``/``heat`` write. Its state is the lane thread's, but for ``cancel`` (under
    ``_lock``): a receive still queued is dropped there, never posted.
    """

    def __init__(self, context: Any, index: int, loop: asyncio.AbstractEventLoop) -> None:
        self.worker = ucx_api.UCXWorker(context, False, False)
        self.worker.init_blocking_progress_mode()
        self.address = bytes(self.worker.address.tobytes())
        self._loop = loop
        self._lock = threading.Lock()
        self._ops: collections.deque[LaneRecv | Callable[[], None]] = collections.deque()
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._signalled = False  # the eventfd was written and the thread has not looked yet
        self._pending: list[LaneRecv] = []
        self._batch: list[tuple[Done, BaseException | None]] = []
        self._batch_t0 = 0.0
        threading.Thread(target=self._run, name=f"kv-ucx-lane{index}", daemon=True).start()

    # -- loop side -----------------------------------------------------------------
    def recv(self, buf: Any, tag: int, done: Done, hot: bool) -> LaneRecv:
        handle = LaneRecv(self, Array(buf), tag, done, hot)
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

    def cancel(self, handle: LaneRecv) -> bool:
        """Drop a receive the lane has not posted yet; False if it is posted."""
        with self._lock:
            if handle.req is None:
                handle.cancelled = True
            return handle.cancelled

    def _submit(self, op: LaneRecv | Callable[[], None]) -> None:
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

    def _take(self, op: LaneRecv | Callable[[], None]) -> None:
        if not isinstance(op, LaneRecv):
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
                self._loop.call_soon_threadsafe(deliver, failed)
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
        self._loop.call_soon_threadsafe(deliver, batch)
