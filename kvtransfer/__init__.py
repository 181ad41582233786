"""Moving KV cache blocks between processes, layer by layer (see base.py)."""

from kvtransfer.base import (
    Descriptor,
    KVReceiver,
    KVSender,
    TransferError,
    TransferState,
    TransferStatus,
)
from kvtransfer.layout import KVLayout
from kvtransfer.registry import BACKENDS, create_receiver, create_sender

__all__ = [
    "BACKENDS", "Descriptor", "KVLayout", "KVReceiver", "KVSender", "TransferError",
    "TransferState", "TransferStatus", "create_receiver", "create_sender",
]
