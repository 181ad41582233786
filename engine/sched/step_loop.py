"""StepLoop: one thread that calls `step()` until stopped; other threads only `wake()` it.

The prefill and decode nodes are StepLoops: their loop thread is the single owner of the
runner, the block manager and the scheduler state, so none of those needs a lock.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod


class StepLoop(ABC):
    loop_name = "step-loop"

    def __init__(self) -> None:
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @abstractmethod
    def step(self) -> bool:
        """One round of work on the loop thread; False when there was nothing to do."""

    def idle_wait_s(self) -> float:
        """How long to sleep when idle (a `wake` ends it early)."""
        return 0.05

    def wake(self) -> None:
        self._wake.set()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=self.loop_name, daemon=True)
        self._thread.start()

    def stop_loop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.step():
                self._wake.wait(self.idle_wait_s())
                self._wake.clear()
