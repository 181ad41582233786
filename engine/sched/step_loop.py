"""StepLoop: one thread that calls `step()` until stopped; other threads only `wake()` it.

The prefill and decode nodes are StepLoops: their loop thread is the single owner of the
runner, the block manager and the scheduler state, so none of those needs a lock.

A step that raises ends the loop: a device error (a CUDA fault raises torch.AcceleratorError)
leaves the device context unusable, so nothing is retried in this process. The error is kept
(`loop_error`: the node's Status then reports it unhealthy), `_loop_failed` lets the node end its
work, and `on_loop_error` (set by the process's owner: deploy/actors.py ends the process, and Ray
starts a new one) runs last.

Test hooks, for fault drills (docs/service.md, "Faults"):
- `fail_next_step(error)`: the next step raises `error` where a step's device error surfaces;
- `status_delay_s`: the node's gRPC Status answers this many seconds late (a node too busy to
  answer in time; decode_node/server.py, prefill_node/server.py).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")


class StepLoop(ABC):
    loop_name = "step-loop"

    def __init__(self) -> None:
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._injected: BaseException | None = None
        self.loop_error: BaseException | None = None  # what ended the loop, if a step raised
        self.on_loop_error: Callable[[BaseException], None] | None = None
        self.status_delay_s = 0.0  # test hook (module docstring)

    @abstractmethod
    def step(self) -> bool:
        """One round of work on the loop thread; False when there was nothing to do."""

    def idle_wait_s(self) -> float:
        """How long to sleep when idle (a `wake` ends it early)."""
        return 0.05

    def wake(self) -> None:
        self._wake.set()

    def hold_status(self) -> None:
        """Test hook: a Status handler waits `status_delay_s` before it answers (any thread)."""
        if self.status_delay_s > 0:
            time.sleep(self.status_delay_s)

    def fail_next_step(self, error: BaseException) -> None:
        """Test hook: the loop's next step raises `error` (a device error mid-step)."""
        self._injected = error
        self.wake()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=self.loop_name, daemon=True)
        self._thread.start()

    def stop_loop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if not self._step():
                    self._wake.wait(self.idle_wait_s())
                    self._wake.clear()
        except Exception as e:
            self._failed(e)

    def _step(self) -> bool:
        error, self._injected = self._injected, None
        if error is not None:
            raise error
        return self.step()

    def _failed(self, error: Exception) -> None:
        log.critical("%s: a step failed; the loop ends: %r", self.loop_name, error, exc_info=error)
        self.loop_error = error
        self._loop_failed(error)
        if self.on_loop_error is not None:
            self.on_loop_error(error)

    def _loop_failed(self, error: BaseException) -> None:
        """The loop ended on `error` (loop thread): a node ends what it can no longer serve."""
        return None  # nothing to end here; the nodes override it


def drained(q: queue.SimpleQueue[T]) -> Iterator[T]:
    """What `q` holds now, without waiting: a loop's inbox read between its steps."""
    while True:
        try:
            yield q.get_nowait()
        except queue.Empty:
            return
