"""Migration: moving a request off a lost placement to another decode node.

A placement is lost when its decode node failed (the NodePool's `on_decode_failure` -> the
request's `lose`), P could not reach D, or D reported the attempt failed. The driver then meets
`AttemptLost` (raised by `unless_lost` around every wait on a node, or by the output reader) and
calls `Migration.move`: the old attempt is aborted, and the driver places the request again with
prompt + tokens already streamed (`RequestState.resume_prompt`), at most `router.max_migrations`
times, else one UNAVAILABLE terminal. Never places anything itself.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import TypeVar

from router.config import RouterConfig
from router.holds import Holds
from router.metrics import RouterMetrics
from router.request import RequestError, RequestState

log = logging.getLogger(__name__)
T = TypeVar("T")


class AttemptLost(Exception):
    """This placement of a request is lost (its decode node failed or gave up on it); the
    request may move to another decode node."""


async def unless_lost(st: RequestState, aw: Awaitable[T]) -> T:
    """`await aw`, unless the placement is lost first: then `aw` is cancelled, AttemptLost."""
    task, lost = asyncio.ensure_future(aw), st.lost
    if lost is None:
        return await task
    try:
        await asyncio.wait((task, lost), return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()  # also when the driver itself was cancelled
    if task.done() and not task.cancelled():
        return task.result()
    raise AttemptLost(lost.result())


class Migration:
    def __init__(self, config: RouterConfig, metrics: RouterMetrics, holds: Holds) -> None:
        self.config, self.metrics, self.holds = config, metrics, holds
        self.count = 0  # requests moved to another decode node (each move counts)

    def move(self, st: RequestState, reason: str) -> None:
        """Give up a lost placement (Abort to its D if D may still hold it); RequestError when the
        request may not move again, else the driver places it anew (resume_prompt)."""
        self.holds.spawn_abort_decode(st, f"migrating: {reason}")
        if not self.config.migrate:
            raise RequestError("UNAVAILABLE", reason)
        if len(st.choices) > 1 and st.num_tokens:
            raise RequestError("UNAVAILABLE", f"{reason} (a request of n > 1 choices does not move once it "
                                              f"has streamed tokens)")
        if st.migrations >= self.config.max_migrations:
            raise RequestError("UNAVAILABLE", f"{reason} (the request already moved {st.migrations} times, "
                                              f"router.max_migrations)")
        st.migrations += 1
        st.moved_from = reason
        self.count += 1
        self.metrics.migrations.inc()
        log.info("request %s moves to another decode node after %d tokens: %s", st.request_id,
                 len(st.tokens), reason)
