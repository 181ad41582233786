"""First-token messages from a prefill node to decode nodes, sent off the prefill loop.

A finished prompt's message (its first token and logprobs, the MTP drafts and their
probabilities) goes to the decode node that holds the request from a small pool of sender
threads, so neither the loop nor the router's call waits on the network. Undelivered, the
request's KV transfer is aborted: the decode node then fails the request's attempt, and the
router, which has streamed the first token, moves the request on (its migration resumes after
that token). Before any of that, the router's own answer goes (`let_answer`).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable

from kvtransfer import KVSender
from protos.messages import FirstToken

FirstTokenSink = Callable[[str, FirstToken], None]  # (decode address, message)

log = logging.getLogger(__name__)

# The most a step's follow-up work waits for its first tokens' answers (`let_answer`): about what
# a handler takes to wake and answer, far less than a prefill step.
ANSWER_WAIT_S = 0.002


def let_answer(answered: list[threading.Event], busy: bool = False) -> None:
    """Wait, at most ANSWER_WAIT_S, until the callers waiting on a step's first tokens (the Prefill
    handlers) have answered with them; not when `busy` (jobs wait for the next step). What the loop
    thread does next (the drafts' messages, KV held for a descriptor that came meanwhile, the next
    commands) and what that wakes (KV sends, an Attach call's answer, the decode node's first-token
    message) takes the GIL and the host's cores: an answer left to wait behind it waits on every
    request's time to first token, while the follow-up work is on none."""
    if busy:
        return
    deadline = time.monotonic() + ANSWER_WAIT_S
    for event in answered:
        if not event.wait(max(0.0, deadline - time.monotonic())):
            return


class FirstTokenSends:
    """The sender threads of a prefill node's first-token messages (module docstring)."""

    def __init__(self, sender: KVSender, threads: int = 4) -> None:
        self.sender = sender  # the node's KV sender: an undelivered message aborts its transfer
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="first-token")

    def send(self, sink: FirstTokenSink, address: str, msg: FirstToken) -> None:
        """Queue `msg` for the decode node at `address`; never waits."""
        self._pool.submit(self._send, sink, address, msg)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _send(self, sink: FirstTokenSink, address: str, msg: FirstToken) -> None:
        try:
            sink(address, msg)
        except Exception as e:
            log.warning("first-token message for %s not delivered to %s: %s", msg.request_id, address, e)
            try:
                self.sender.abort(msg.request_id, f"first-token message not delivered: {e}")
            except Exception:  # already ended (the decode node gave up first, or the router aborted)
                pass
