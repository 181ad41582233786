"""A priming transfer: no blocks, every layer, over the path a request's transfer will take.

A sender's first transfer to a receiver pays for what every later one reuses: the connection
(tcp), the endpoints (ucx), and with ipc the receiver's KV memory mapped into the sender's
process (``peer_pool``) and the copier's address tables. A priming transfer pays it before a
request does. The receiver ``expect``s no blocks, so nothing is reserved and nothing can leak;
the descriptor reaches the sender by the same introduction as a request's (the router), so its
token is the sender's only credential and the receiver still opens its memory only to a sender
the router introduced. The sender begins, sends every layer's zero blocks and finishes; the
receiver acknowledges, and both ends forget the transfer as they forget any ended one.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtransfer.base import Descriptor, KVReceiver, KVSender, TransferError, TransferStatus


def expect_prime(receiver: KVReceiver, request_id: str, layers: Sequence[int]) -> Descriptor:
    """The receiver's side: a descriptor of no blocks for ``layers`` (every layer a request sends)."""
    return receiver.expect(request_id, [], layers)


def prime(sender: KVSender, request_id: str, descriptor: Descriptor, timeout: float) -> TransferStatus:
    """The sender's side: run the priming transfer ``descriptor`` names; its status once it ended,
    or after ``timeout`` (then aborted). TransferError for a descriptor that is not a priming one."""
    if descriptor.get("blocks") != [] or descriptor.get("skip") != 0:
        raise TransferError("a priming descriptor names no blocks")
    sender.start(request_id, descriptor)  # validates the rest, the layers among it
    try:
        for layer in descriptor["layers"]:
            sender.send_layer(request_id, layer, [])
        sender.finish(request_id)
    except TransferError as exc:
        sender.abort(request_id, f"priming refused: {exc}")
        raise
    status = sender.wait(request_id, timeout)
    if not status.state.terminal:
        sender.abort(request_id, f"priming did not end in {timeout:.1f} s")
    return status
