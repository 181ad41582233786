"""AdmissionQueue: requests that no decode node would admit, waiting (FIFO, bounded) for capacity.

Receives `wait()` from a request's driver after every healthy decode node refused it; hands
the request back (the awaited call returns) when `wake_one()` says capacity may have freed
(a request on some decode node ended, a node came back, a Status poll ran). A woken request
that is still refused re-enters at the head, so order is kept. Holds futures only; never
talks to a node. A full queue is the caller's RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

import asyncio
from collections import deque


class AdmissionQueue:
    def __init__(self, size: int) -> None:
        self.size = size
        self._waiters: deque[asyncio.Future[None]] = deque()
        self.epoch = 0  # wake-ups so far: a request asking nodes meanwhile must ask again

    def __len__(self) -> int:
        return len(self._waiters)

    async def wait(self, front: bool = False) -> bool:
        """Wait for a wake-up; False at once when the queue is full (`front`: a woken request
        going back to the head, which is always let in)."""
        if not front and len(self._waiters) >= self.size:
            return False
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if front:
            self._waiters.appendleft(fut)
        else:
            self._waiters.append(fut)
        try:
            await fut
        finally:
            if fut in self._waiters:  # cancelled (deadline, abort) while waiting
                self._waiters.remove(fut)
        return True

    def wake_one(self) -> None:
        self.epoch += 1
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return
