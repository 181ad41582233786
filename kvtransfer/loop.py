"""The transport thread: one asyncio event loop running in a daemon thread.

Public sender/receiver methods run on the caller's thread and hand work to this
loop with ``call`` (fire and forget), ``defer`` (fire and forget, no wake-up: it goes with
the next ``call``) or ``submit`` (a concurrent Future). All transfer state is changed on the
loop thread only.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")
log = logging.getLogger(__name__)


class LoopThread:
    def __init__(self, name: str) -> None:
        # The stock loop by name, not the policy's: a Ray worker installs uvloop's policy wherever
        # uvloop is importable (it is, for the router's sake), and the transports are built and
        # tested on this one.
        self.loop = asyncio.SelectorEventLoop()
        self._calls: collections.deque[tuple[Callable[..., Any], tuple[Any, ...]]] = collections.deque()
        self._calls_lock = threading.Lock()
        self._drain_scheduled = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the loop, in call order. A burst of calls (a prefill queueing
        every layer) wakes the loop once: each wake-up also makes the loop thread contend
        for the GIL with the caller."""
        with self._calls_lock:
            self._calls.append((fn, args))
            if self._drain_scheduled:
                return
            self._drain_scheduled = True
        self.loop.call_soon_threadsafe(self._drain)

    def defer(self, fn: Callable[..., Any], *args: Any) -> None:
        """Queue ``fn(*args)`` like ``call`` but wake no one: it runs in order with the next
        ``call``'s drain, or at the latest at the owner's next ``run_deferred`` (its tick)."""
        with self._calls_lock:
            self._calls.append((fn, args))

    def run_deferred(self) -> None:
        """On the loop: run what ``defer`` queued and no ``call`` has drained yet."""
        if self._calls:
            self._drain()

    def _drain(self) -> None:
        """Run the queued calls, and those queued while they run: the drain counts as scheduled
        until it finds the queue empty, so a caller queueing meanwhile wakes no one."""
        while True:
            with self._calls_lock:
                if not self._calls:
                    self._drain_scheduled = False
                    return
                batch, self._calls = self._calls, collections.deque()
            for fn, args in batch:
                try:
                    fn(*args)
                except Exception:  # as the loop does for a failing callback: log, go on
                    log.exception("kvtransfer loop call %r failed", fn)

    def on_loop(self) -> bool:
        return threading.current_thread() is self._thread

    def stop(self) -> None:
        """Cancel every task, stop the loop and join the thread."""
        if self.loop.is_running():
            self.submit(self._cancel_all()).result(timeout=5)
            self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self.loop.close()

    async def _cancel_all(self) -> None:
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
