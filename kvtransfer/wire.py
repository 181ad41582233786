"""Control messages on the wire: msgpack maps with a version, every field validated.

Nothing is pickled. ``decode`` rejects, with a WireError naming the problem: a
payload over ``MAX_MESSAGE_BYTES``, bytes that are not one msgpack map, a missing
or different ``v``, an unknown ``t``, a missing or extra field, a field of the
wrong type or out of range. Bulk KV bytes never go through msgpack; they follow a
``data`` header (tcp) or travel as their own tagged message (ucx).

Framing (``frame`` / ``unframe``): a 4-byte big-endian length, then the msgpack.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import secrets
import struct
import zlib
from collections.abc import Callable
from typing import Any

import msgpack

VERSION = 7  # 2: one ``layers`` announce covers every layer queued at once;
# 3: ucx announces only layers whose runs differ from the destination's (pre-posted) ones;
# 4: ``desc`` names the receiver's data lanes (ucx: one worker address per lane);
# 5: the transfer token ``tok`` (see below) replaces ``serial``;
# 6: ``desc`` says how many of the request's leading blocks the receiver holds already (``skip``);
# 7: ``pool``, the receiver's KV memory opened by a sender of the same host (ipc)
TOKEN_BYTES = 16
MAX_MESSAGE_BYTES = 1 << 20
MAX_LIST = 1 << 17
MAX_STR = 1024
MAX_LANES = 64
MAX_INT = (1 << 64) - 1  # ucx tags use all 64 bits
HEADER = struct.Struct(">I")


class WireError(ValueError):
    """A message from the network broke the protocol; the text says how."""


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_INT


def _str(v: Any) -> bool:
    return isinstance(v, str) and len(v) <= MAX_STR


def _bytes(v: Any) -> bool:
    return isinstance(v, bytes) and len(v) <= 1 << 16


def _addr(v: Any) -> bool:
    return _str(v) or _bytes(v)


def _tok(v: Any) -> bool:
    return isinstance(v, bytes) and len(v) == TOKEN_BYTES


def _ints(v: Any) -> bool:
    # Every element's type exactly int (a bool is not a count), then one min/max, each one pass
    # in C: a descriptor carries a few thousand block ids, and this runs on every hop.
    return (isinstance(v, list) and len(v) <= MAX_LIST
            and (not v or (_INT_ONLY.issuperset(map(type, v)) and min(v) >= 0 and max(v) <= MAX_INT)))


_INT_ONLY = frozenset([int])
_LIST_ONLY = frozenset([list])


def _handle_part(v: Any) -> bool:
    return isinstance(v, bool) or _int(v) or _bytes(v) or _str(v)


def _handle(v: Any) -> bool:
    return isinstance(v, list) and len(v) <= 8 and all(_handle_part(x) for x in v)


def _plane_rows(v: Any) -> bool:
    return _list_of(v, lambda row: _list_of(row, lambda p: _ints(p) and len(p) == 3))


def _pairs(v: Any) -> bool:
    return _list_of(v, lambda p: _ints(p) and len(p) == 2)


def _int_lists(v: Any) -> bool:
    """A list of int lists (a descriptor's layout: one short row a layer), checked as one flat list:
    a Python call per row would cost more than the rest of the descriptor."""
    return (isinstance(v, list) and len(v) <= MAX_LIST
            and (not v or (_LIST_ONLY.issuperset(map(type, v)) and max(map(len, v)) <= MAX_LIST
                           and _ints(list(itertools.chain.from_iterable(v))))))


def _list_of(v: Any, ok: Callable[[Any], bool]) -> bool:
    return isinstance(v, list) and len(v) <= MAX_LIST and all(map(ok, v))


# The transfer token: random bytes the receiver makes at ``expect``, carried only in the
# descriptor (receiver -> router -> the sender the router picked) and in every control message
# of the transfer; the receiver drops any message whose token is not the request's before it
# acts on it (a connection is bound only by an authenticated ``begin``), so a sender the router
# did not introduce cannot write a block. Ucx data tags derive from it (``token_serial``).
_RID = {"rid": _str}
_AUTH = {"rid": _str, "tok": _tok}
SCHEMAS: dict[str, dict[str, Callable[[Any], bool]]] = {
    # Receiver -> router -> sender: where and what to send. ``skip``: the receiver holds the
    # request's first ``skip`` blocks already (a decode-side prefix cache); ``blocks`` are the
    # destinations of the blocks after them. The sender's caller checks it against the prompt.
    "desc": {
        **_AUTH, "backend": _str, "addr": _addr, "tag": _int,
        "lanes": lambda v: _list_of(v, _addr) and len(v) <= MAX_LANES,
        "layers": _ints, "blocks": _ints, "layout": _int_lists, "skip": _int,
    },
    # Sender -> receiver. ``data`` (tcp) is accepted only on a connection an authenticated
    # ``begin`` bound to the request.
    "begin": {**_AUTH, "reply": _addr, "ack_tag": _int, "nblocks": _int},
    "layers": {**_AUTH, "layers": _ints, "runs": _pairs},  # these layers' data follows, same runs
    "data": {**_RID, "layer": _int, "run": _int, "nbytes": _int},
    "finish": {**_AUTH, "layers": _int},
    "abort": {**_AUTH, "reason": _str},
    # Receiver -> sender. ``error`` closes the connection it arrives on.
    "ack": {**_AUTH, "ok": lambda v: isinstance(v, bool), "reason": _str},
    "error": {"reason": _str},
    # Receiver -> sender (ipc), once per connection after its first authenticated ``begin``: how
    # to open the receiver's KV memory (kvtransfer/peer_pool.py; validated again on use).
    "pool": {"host": _str, "pid": _int, "mem": _str, "storages": lambda v: _list_of(v, _handle),
             "planes": _plane_rows},
}


class AuthError(WireError):
    """A message without the transfer's token: dropped (its connection closed), and the
    request it names goes on, so a stranger cannot fail it either."""


def new_token() -> bytes:
    return secrets.token_bytes(TOKEN_BYTES)


def token_serial(tok: bytes) -> int:
    """32 bits derived from a transfer token (ucx data tags): known only to who holds the token."""
    return int.from_bytes(hashlib.blake2b(tok, digest_size=4, person=b"pdkv-serial").digest(), "big")


def authentic(msg: dict[str, Any], tok: bytes) -> bool:
    """Whether a validated message carries ``tok`` (constant-time)."""
    return hmac.compare_digest(msg["tok"], tok)


def check(msg: Any) -> dict[str, Any]:
    """Validate a decoded message against its schema; return it."""
    if not isinstance(msg, dict):
        raise WireError(f"message is a {type(msg).__name__}, not a map")
    if msg.get("v") != VERSION:
        raise WireError(f"wrong version {msg.get('v')!r}, expected {VERSION}")
    kind = msg.get("t")
    schema = SCHEMAS.get(kind) if isinstance(kind, str) else None
    if schema is None:
        raise WireError(f"unknown message type {kind!r}")
    fields = set(msg) - {"v", "t"}
    if fields != set(schema):
        raise WireError(f"{kind}: fields {sorted(fields)} != {sorted(schema)}")
    for name, ok in schema.items():
        if not ok(msg[name]):
            raise WireError(f"{kind}: bad value for {name!r}: {str(msg[name])[:80]}")
    return msg


def make(kind: str, **fields: Any) -> dict[str, Any]:
    """Build and validate a message (a bug here is ours, so it raises WireError too)."""
    return check({"v": VERSION, "t": kind, **fields})


def encode(msg: dict[str, Any]) -> bytes:
    data: bytes = msgpack.packb(check(msg), use_bin_type=True)
    if len(data) > MAX_MESSAGE_BYTES:
        raise WireError(f"message of {len(data)} bytes over {MAX_MESSAGE_BYTES}")
    return data


def decode(data: bytes | bytearray | memoryview) -> dict[str, Any]:
    if len(data) > MAX_MESSAGE_BYTES:
        raise WireError(f"message of {len(data)} bytes over {MAX_MESSAGE_BYTES}")
    try:
        msg = msgpack.unpackb(bytes(data), raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:  # msgpack raises several unrelated types
        raise WireError(f"not msgpack: {type(exc).__name__}: {exc}") from None
    return check(msg)


def frame(msg: dict[str, Any]) -> bytes:
    body = encode(msg)
    return HEADER.pack(len(body)) + body


def frame_length(header: bytes) -> int:
    """Length from a 4-byte header; WireError if over ``MAX_MESSAGE_BYTES``."""
    (n,) = HEADER.unpack(header)
    if n > MAX_MESSAGE_BYTES:
        raise WireError(f"frame of {n} bytes over {MAX_MESSAGE_BYTES}")
    return int(n)


def unframe(buf: bytes | bytearray | memoryview) -> dict[str, Any]:
    """Decode a framed message that may be followed by padding."""
    if len(buf) < HEADER.size:
        raise WireError(f"frame of {len(buf)} bytes has no header")
    n = frame_length(bytes(buf[: HEADER.size]))
    if HEADER.size + n > len(buf):
        raise WireError(f"frame says {n} bytes, only {len(buf) - HEADER.size} arrived")
    return decode(buf[HEADER.size : HEADER.size + n])


SEALED = struct.Struct(">4sII")  # magic, length, crc32 of the body
MAGIC = b"PDKV"


def seal(msg: dict[str, Any]) -> bytes:
    """Frame for transports that deliver into a fixed buffer without a length (ucx)."""
    body = encode(msg)
    return SEALED.pack(MAGIC, len(body), zlib.crc32(body)) + body


def unseal(buf: bytes | bytearray | memoryview) -> dict[str, Any]:
    """Inverse of ``seal``; the caller clears the header bytes before each receive."""
    if len(buf) < SEALED.size:
        raise WireError(f"sealed frame of {len(buf)} bytes has no header")
    magic, n, crc = SEALED.unpack(bytes(buf[: SEALED.size]))
    if magic != MAGIC:
        raise WireError(f"bad magic {magic!r}: not a kvtransfer control message")
    if n > MAX_MESSAGE_BYTES or SEALED.size + n > len(buf):
        raise WireError(f"frame of {n} bytes over {MAX_MESSAGE_BYTES}")
    body = bytes(buf[SEALED.size : SEALED.size + n])
    if zlib.crc32(body) != crc:
        raise WireError("checksum mismatch: truncated or corrupted control message")
    return decode(body)
