"""NodeDirectory: which prefill, decode and colocated nodes exist (host:port of their gRPC servers).

Written by whoever owns membership (deploy's Ray supervisor as actors die and restart, or a
test); read by the router's NodePool, which reconciles its connections with it. Every method
is thread-safe; listeners run on the mutating thread, outside the lock, and must not block.
Holds addresses only: health, load and connections belong to the router.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Literal

Kind = Literal["prefill", "decode", "colocated"]
KINDS: tuple[Kind, ...] = ("prefill", "decode", "colocated")


class NodeDirectory:
    def __init__(self, prefill: Iterable[str] = (), decode: Iterable[str] = (),
                 colocated: Iterable[str] = ()) -> None:
        self._lock = threading.Lock()
        self._nodes: dict[Kind, list[str]] = {kind: [] for kind in KINDS}
        self._listeners: list[Callable[[], None]] = []
        for kind, addresses in zip(KINDS, (prefill, decode, colocated), strict=True):
            for a in addresses:
                self._add(self._nodes[kind], a)

    # ---- writers ----------------------------------------------------------------------
    def add(self, kind: Kind, address: str) -> bool:
        """Add a node; False when it was already listed."""
        with self._lock:
            added = self._add(self._list(kind), address)
        if added:
            self._notify()
        return added

    def remove(self, kind: Kind, address: str) -> bool:
        """Remove a node; False when it was not listed."""
        with self._lock:
            nodes = self._list(kind)
            found = address in nodes
            if found:
                nodes.remove(address)
        if found:
            self._notify()
        return found

    def replace(self, kind: Kind, old: str, new: str) -> None:
        """A restarted node at a new address (one notification)."""
        with self._lock:
            nodes = self._list(kind)
            if old in nodes:
                nodes.remove(old)
            self._add(nodes, new)
        self._notify()

    # ---- readers ----------------------------------------------------------------------
    def addresses(self, kind: Kind) -> tuple[str, ...]:
        with self._lock:
            return tuple(self._list(kind))

    def subscribe(self, listener: Callable[[], None]) -> Callable[[], None]:
        """Call `listener()` after every change; returns a function that unsubscribes."""
        with self._lock:
            self._listeners.append(listener)

        def unsubscribe() -> None:
            with self._lock:
                if listener in self._listeners:
                    self._listeners.remove(listener)

        return unsubscribe

    # ---- internals --------------------------------------------------------------------
    def _list(self, kind: Kind) -> list[str]:
        if kind not in self._nodes:
            raise ValueError(f"node kind must be one of {', '.join(KINDS)}, got {kind!r}")
        return self._nodes[kind]

    @staticmethod
    def _add(nodes: list[str], address: str) -> bool:
        host, sep, port = address.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"node address must be host:port, got {address!r}")
        if address in nodes:
            return False
        nodes.append(address)
        return True

    def _notify(self) -> None:
        with self._lock:
            listeners = list(self._listeners)
        for listener in listeners:
            listener()
