"""ucxx's synchronous core API (what its asyncio layer is built on), imported here alone: UCX
reads its ``UCX_*`` variables at this import, so pdserve's defaults are set first. Also what the
driver's loop and the lanes' threads share: the busy-poll switch, the completion callback type,
endpoints made from worker addresses, and how completions are delivered.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from typing import Any

import numpy as np

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
from ucxx._lib import libucxx as ucx_api  # noqa: E402
from ucxx._lib.arr import Array  # noqa: E402

import settings

__all__ = ["EMPTY", "SPIN", "Array", "Done", "cached_endpoint", "deliver", "ignore", "settle", "ucx_api"]

SPIN = settings.UCX_SPIN
"""Busy-poll the worker while data receives are in flight (see ``Driver``)."""
Done = Callable[[BaseException | None], None]
"""A completion handler: called on the loop thread with None, or with the request's error."""
EMPTY = np.zeros(0, np.uint8)
log = logging.getLogger(__name__)


def cached_endpoint(worker: Any, cache: dict[bytes, Any], addr: bytes) -> Any:
    """``worker``'s endpoint to the worker at ``addr``, made once and kept in ``cache``."""
    ep = cache.get(addr)
    if ep is None:
        address = ucx_api.UCXAddress.create_from_buffer(np.frombuffer(addr, np.uint8))
        ep = ucx_api.UCXEndpoint.create_from_worker_address(worker, address, False)
        cache[addr] = ep
    return ep


def deliver(batch: list[tuple[Done, BaseException | None]]) -> None:
    """Run a lane's batch of completion handlers (on the loop thread)."""
    for done, exc in batch:
        try:
            done(exc)
        except Exception:  # a completion handler's bug must not stop the others
            log.exception("ucx completion handler failed")


def ignore(exc: BaseException | None) -> None:
    pass


def settle(fut: asyncio.Future[None], exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is None:
        fut.set_result(None)
    else:
        fut.set_exception(exc)
