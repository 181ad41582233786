"""Commands to a decode-side node's loop thread (decode, colocated, synthetic and TP nodes).

Any thread queues them on the node's inbox (`reserve`, `abort`, a stream opened or closed, ...);
the loop thread alone applies them, in order, at the start of a step (`DecodeNode._apply`, a
`match` over `Command` that a type checker follows). A command that answers its caller carries
the future it answers on. A tensor-parallel node sends them to its other ranks as plain values
(decode_node/tp.py).
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass

from engine.sampling.sampling_params import SamplingParams
from protos.messages import FirstToken


@dataclass(frozen=True)
class Reserve:
    """Admit a request whose KV a prefill node will send; `future` gets a Reservation. `prompt`
    (its token ids, optional) lets the prefix cache supply the blocks it holds."""

    request_id: str
    prompt_len: int
    params: SamplingParams
    seed: int
    stop_ids: tuple[int, ...]
    prompt: list[int] | None
    future: concurrent.futures.Future


@dataclass(frozen=True)
class Submit:
    """Admit a whole request, prompt and all (a colocated or synthetic node); `future` gets a Reservation."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    seed: int
    stop_ids: tuple[int, ...]
    future: concurrent.futures.Future


@dataclass(frozen=True)
class First:
    """A prefill node's first-token message for a reserved request."""

    msg: FirstToken


@dataclass(frozen=True)
class Abort:
    """End request `request_id` (every choice), or one choice of it (`{id}#{i}`)."""

    request_id: str
    reason: str


@dataclass(frozen=True)
class OwnerBack:
    """`owner` opened an output stream: its reservations are taken again."""

    owner: str


@dataclass(frozen=True)
class OwnerGone:
    """`owner`'s last output stream ended: its requests end, its reservations are refused."""

    owner: str


Command = Reserve | Submit | First | Abort | OwnerBack | OwnerGone
