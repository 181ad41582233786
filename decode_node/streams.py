"""OutputStreams: a decode-side node's output streams and the owners rule, shared by the decode,
colocated and synthetic nodes.

Any thread may `subscribe` (a new stream, optionally named for its owner: a router instance)
and `unsubscribe`; the loop thread `publish`es each step's items. An owner's first stream queues
`OwnerBack`, its last one ending queues `OwnerGone` on the node's inbox (decode_node/commands.py),
so the loop learns of them in order with the owner's reservations; the loop then keeps the set of
gone owners here (`owner_back`, `owner_gone`, `refuses`). What a gone owner's running requests
become is the node's business (it aborts them).
"""

from __future__ import annotations

import queue
import threading
from collections import Counter

from decode_node.commands import Command, OwnerBack, OwnerGone
from protos.messages import OutputItem

Stream = queue.SimpleQueue[list[OutputItem] | None]  # a step's items; None: the node stopped


def owner_of(request_id: str) -> str:
    """The owner named by a request id (`owner/...`); '' when it names none."""
    head, sep, _ = request_id.partition("/")
    return head if sep else ""


def publish_to_owners(items: list[OutputItem], streams: list[tuple[queue.SimpleQueue, str]]) -> None:
    """One step's items to the output streams: a stream whose subscriber names an owner gets that
    owner's items and those of no owner (several router processes each get their own requests'
    tokens, not every router's); a stream without an owner gets them all. A stream with nothing
    of its own this step gets nothing. A lone stream gets every item (nobody else could read them)."""
    if len(streams) == 1:
        streams[0][0].put(items)
        return
    mine: dict[str, list[OutputItem]] = {}
    for item in items:
        mine.setdefault(owner_of(item.request_id), []).append(item)
    shared = mine.get("", [])
    for q, owner in streams:
        if not owner:
            q.put(items)
        elif owner in mine or shared:
            q.put(mine.get(owner, []) + shared if shared else mine[owner])


class OutputStreams:
    def __init__(self, inbox: queue.SimpleQueue[Command]) -> None:
        self._inbox = inbox  # the node's: OwnerBack / OwnerGone go there
        self._subscribers: list[tuple[Stream, str]] = []  # (stream, owner)
        self._lock = threading.Lock()
        self.owner_streams: Counter[str] = Counter()  # owner -> open output streams (under _lock)
        self._gone: set[str] = set()  # owners whose last stream ended (loop thread)

    # ---- any thread ------------------------------------------------------------------
    def subscribe(self, owner: str = "") -> Stream:
        """A new output stream; `owner` (optional) names the requests it owns (ids `owner/...`)."""
        q: Stream = queue.SimpleQueue()
        with self._lock:
            self._subscribers.append((q, owner))
            if owner:
                self.owner_streams[owner] += 1
                self._inbox.put(OwnerBack(owner))  # before any Reserve the owner sends next
        return q

    def unsubscribe(self, q: queue.SimpleQueue, owner: str = "") -> None:
        """End a stream; the owner's last one ending queues OwnerGone (the caller wakes the loop)."""
        with self._lock:
            if (q, owner) not in self._subscribers:
                return
            self._subscribers.remove((q, owner))
            if owner:
                self.owner_streams[owner] -= 1
                if self.owner_streams[owner] <= 0:
                    del self.owner_streams[owner]
                    self._inbox.put(OwnerGone(owner))

    def close(self) -> None:
        """The node stopped: every stream ends."""
        with self._lock:
            for q, _ in self._subscribers:
                q.put(None)

    # ---- the loop thread -------------------------------------------------------------
    def publish(self, items: list[OutputItem]) -> None:
        with self._lock:
            publish_to_owners(items, self._subscribers)

    def owner_back(self, owner: str) -> None:
        self._gone.discard(owner)

    def owner_gone(self, owner: str) -> None:
        self._gone.add(owner)

    def refuses(self, request_id: str) -> bool:
        """Whether the request's owner is gone (its new reservations are refused)."""
        return owner_of(request_id) in self._gone
