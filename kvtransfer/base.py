"""The interfaces of kvtransfer, grouped by which side calls them.

A request's KV moves from a prefill node (the *sender*) to a decode node (the
*receiver*) in five steps:

1. The receiver reserves destination blocks and calls ``expect``; it gets back a
   *descriptor*, a plain msgpack-able dict (its transport address, the block ids,
   the layer ids, the byte layout and a random transfer token). The router carries it
   to the prefill node it picked: that introduction is the sender's only credential.
   The receiver drops every message without the token before acting on it, and takes
   data only from the connection an authenticated ``begin`` bound (tcp) or under tags
   derived from the token (ucx), so no other sender can write a block (``wire.py``).
   With a prefix cache on the receiver's side, the descriptor's ``skip`` says how many of the
   request's leading blocks the receiver holds already; only the rest is expected.
2. The sender calls ``start(request_id, descriptor)``: the request's source blocks
   are now held under a lease.
3. As each layer's KV is written, the sender calls ``send_layer``; the call only
   queues the work and returns at once, and the transport thread moves the bytes
   while the engine computes later layers. The MTP layer is one more layer id.
4. The sender calls ``finish``; the receiver acknowledges once every expected
   layer has landed, and both sides report DONE.
5. Either side may ``abort``. A peer that dies or stalls turns into FAILED, with a
   reason, on the other side once ``timeout_s`` passes without progress.

Nothing here knows about the engine: the caches are lists of tensors (see
``layout.KVLayout``) and blocks are integers. Every transport implements both
ABCs and registers itself in ``kvtransfer.registry``.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvtransfer.layout import KVLayout

Descriptor = dict[str, Any]
"""What ``expect`` returns and ``start`` consumes: msgpack-able, validated on use."""


class TransferState(enum.Enum):
    """Where one request's transfer stands, as ``poll`` reports it."""

    WAITING = "waiting"  # known, no byte moved yet
    TRANSFERRING = "transferring"  # the peer is connected and bytes are moving
    DONE = "done"  # every expected layer landed and was acknowledged
    FAILED = "failed"  # ended without the data; ``TransferStatus.reason`` says why

    @property
    def terminal(self) -> bool:
        return self in (TransferState.DONE, TransferState.FAILED)


@dataclass(frozen=True)
class TransferStatus:
    """A snapshot of one request's transfer: its state and, when FAILED, why."""

    state: TransferState
    reason: str = ""


class TransferError(RuntimeError):
    """A caller broke a rule (unknown request, layer sent twice, bad descriptor)."""


ReleaseCallback = Callable[[str, TransferStatus], None]
"""Called once per request when the sender's lease ends (DONE, FAILED or aborted)."""


class KVSender(ABC):
    """The prefill side. One instance per process and transport.

    Rules:
    - ``register`` is called once, before anything else, with the local cache.
    - ``start``, ``send_layer``, ``finish`` and ``abort`` may be called from any
      thread and never block on the network: they queue work for the transport
      thread. Calls for one request must come from one thread, in that order.
    - The source blocks named by ``send_layer`` must hold the layer's final bytes
      when it is called (on GPU: the producing stream is synchronized, or
      ``ready`` is an event recorded after the write) and must stay untouched until
      the lease ends: ``poll`` is terminal and ``on_release`` was called.
    - The lease ends on the receiver's acknowledgement (DONE), on ``abort``, on a
      peer error, or when ``timeout_s`` passes without progress (FAILED).
    """

    @abstractmethod
    def register(self, layout: KVLayout) -> None:
        """Describe the local KV cache; called once before ``start``."""

    @abstractmethod
    def start(self, request_id: str, descriptor: Descriptor) -> None:
        """Open a transfer to the receiver named by ``descriptor`` (from ``expect``).

        Raises TransferError at once if the descriptor is malformed or its layout
        does not match the registered one. Takes the lease on the request's blocks.
        """

    @abstractmethod
    def send_layer(
        self, request_id: str, layer: int, src_block_ids: Sequence[int], ready: Any = None
    ) -> None:
        """Queue layer ``layer`` of the request; called once per expected layer.

        ``src_block_ids[i]`` lands in the descriptor's ``blocks[i]``; both lists have
        the same length. Never blocks. ``ready``: an optional CUDA event the
        transport thread waits on before reading the blocks.
        """

    @abstractmethod
    def finish(self, request_id: str) -> None:
        """No more layers for this request; the receiver will acknowledge."""

    @abstractmethod
    def abort(self, request_id: str, reason: str = "aborted by sender") -> None:
        """Stop the transfer, tell the receiver (best effort) and end the lease."""

    @abstractmethod
    def poll(self, request_id: str) -> TransferStatus:
        """Non-blocking. Raises TransferError for an unknown request."""

    @abstractmethod
    def wait(self, request_id: str, timeout: float | None = None) -> TransferStatus:
        """Block the calling thread until the request is terminal or ``timeout``.

        Returns the current status when ``timeout`` expires first.
        """

    @abstractmethod
    def held(self) -> list[str]:
        """Requests whose source blocks are still under lease."""

    @abstractmethod
    def close(self) -> None:
        """Fail every open transfer, release every lease, stop the transport."""


class KVReceiver(ABC):
    """The decode side. One instance per process and transport.

    Rules:
    - ``register`` is called once, before ``expect``, with the local cache.
    - ``expect`` is called once per request, from any thread, before the
      descriptor leaves the process. It does not block on the network or wait
      for the transport thread (a decode loop calls it).
    - The destination blocks must not be read until ``poll`` is DONE, nor reused
      until it is terminal.
    - A request is FAILED when the sender aborts, sends a malformed message, drops
      the connection, or sends nothing for ``timeout_s`` (counted from ``expect``
      and from every message since).
    - A malformed, oversized or wrong-version message fails only the transfers on
      the connection it came from; the receiver keeps serving the others.
    - Terminal requests are forgotten after ``retain_s``; ``poll`` then raises.
    """

    @abstractmethod
    def register(self, layout: KVLayout) -> None:
        """Describe the local KV cache; called once before ``expect``."""

    @abstractmethod
    def expect(
        self, request_id: str, dst_block_ids: Sequence[int], layers: Sequence[int], skip: int = 0
    ) -> Descriptor:
        """Reserve a transfer into ``dst_block_ids`` for ``layers``; return its descriptor.

        ``skip``: the receiver already holds the request's first ``skip`` blocks, so
        ``dst_block_ids`` receive the sender's blocks from ``skip`` on. Carried in the
        descriptor for the sender's caller, which validates it and sends only those.
        """

    @abstractmethod
    def poll(self, request_id: str) -> TransferStatus:
        """Non-blocking. Raises TransferError for an unknown request."""

    @abstractmethod
    def wait(self, request_id: str, timeout: float | None = None) -> TransferStatus:
        """Block the calling thread until the request is terminal or ``timeout``."""

    @abstractmethod
    def abort(self, request_id: str, reason: str = "aborted by receiver") -> None:
        """Stop expecting the request (FAILED); tell the sender when connected."""

    @abstractmethod
    def on_end(self, request_id: str, fn: Callable[[], None]) -> None:
        """Call ``fn()`` once the request is terminal: at once if it is, else on the transport's
        thread, so ``fn`` must be quick and never block (wake the caller's loop, not poll)."""

    @abstractmethod
    def close(self) -> None:
        """Fail every open transfer and stop the transport."""
