"""The UCX transport's tag space: which tag a message travels under (see the package docstring).
Control messages to a receiver go under ``CTRL | receiver id``, acks to a sender under
``ACK | sender id``; data under ``data_tag``, which no control or ack tag can equal."""

from __future__ import annotations

CTRL = 1 << 63
ACK = 3 << 62
ANNOUNCED = 1 << 20  # a data tag's bit: the layer's runs came in a ``layers`` message


def data_tag(serial: int, layer: int, index: int, announced: bool = False) -> int:
    """``serial`` (32 bits, from the transfer token) << 31 | layer (10 bits) << 21 | announced |
    message index (20 bits); bit 63 stays clear, so no data tag is a CTRL or ACK tag."""
    if layer >= 1 << 10 or index >= ANNOUNCED:
        raise ValueError(f"layer {layer} or message {index} beyond the tag space")
    return ((serial & 0xFFFFFFFF) << 31) | (layer << 21) | (ANNOUNCED if announced else 0) | index
