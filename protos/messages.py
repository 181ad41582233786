"""msgpack messages between nodes: the first-token message (P -> D and P -> router) and
decode output batches (D -> router). Versioned; every field is validated when read.

Logprob payloads carry only the columns asked for. Each item's `meta` word packs a
message flag in the low 8 bits and `num_logprobs` (top-N) in the next 16:
`meta = flag | num_logprobs << 8`. Senders reject flag > 255 or num_logprobs > 65535;
receivers unpack and read exactly that many top columns per token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import msgpack

VERSION = 1
MAX_MESSAGE_BYTES = 64 << 20
MAX_LOGPROBS = 20
MAX_CHOICES = 16  # n (engine.sampling.sampling_params.MAX_N)
MAX_PROMPT_TOKENS = 1 << 20  # prompt logprobs in one message; the router checks the prompt's own length

# Upper bounds (seconds) of NodeStatus.kv_seconds_buckets: a prefill node counts each KV transfer
# in the first bucket whose bound holds its time, the last bucket (one more) being +Inf.
KV_TRANSFER_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                       1.0, 2.5, 5.0, 10.0)

MAX_DURATION_S = 86400.0  # a node's reported queue or compute time (a TTFT part) beyond this is malformed

FLAG_LOGPROBS = 1  # the item carries logprob columns
FLAG_FINISHED = 2  # terminal: finished with `finish_reason`
FLAG_ERROR = 4  # terminal: failed with `error`


class MessageError(ValueError):
    """A message that is malformed, oversized, of another version, or out of range."""


def pack_meta(flag: int, num_logprobs: int) -> int:
    if not 0 <= flag <= 255:
        raise MessageError(f"message flag {flag} does not fit in 8 bits")
    if not 0 <= num_logprobs <= 65535:
        raise MessageError(f"num_logprobs {num_logprobs} does not fit in 16 bits")
    return flag | num_logprobs << 8


def unpack_meta(meta: int) -> tuple[int, int]:
    if not isinstance(meta, int) or not 0 <= meta < 1 << 24:
        raise MessageError(f"bad meta word {meta!r}")
    return meta & 0xFF, meta >> 8


@dataclass
class TokenLogprobs:
    """Logprob columns for n tokens: n logprobs, n ranks, n x num_top ids and values."""

    logprob: list[float]
    rank: list[int]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]

    def flat(self) -> list:
        return [self.logprob, self.rank, [i for row in self.top_ids for i in row],
                [v for row in self.top_logprobs for v in row]]

    @classmethod
    def read(cls, cols: Any, n: int, num_top: int, vocab: int) -> TokenLogprobs:
        if not isinstance(cols, list) or len(cols) != 4:
            raise MessageError("logprob columns must be a list of 4 columns")
        lp, rank, ids, vals = cols
        _expect_list(lp, n, float, "logprob")
        _expect_list(rank, n, int, "rank")
        _expect_list(ids, n * num_top, int, "top ids")
        _expect_list(vals, n * num_top, float, "top logprobs")
        if any(v > 0.0 for v in lp) or any(v > 0.0 for v in vals):  # NaN passes, as it compares false
            raise MessageError("logprobs must be <= 0")
        if not _within(rank, 1, vocab + 1) or not _within(ids, 0, vocab):
            raise MessageError("rank or top id out of range")
        if not num_top:
            return cls(lp, rank, _no_top(n), _no_top(n))
        rows = lambda x: [x[j * num_top : (j + 1) * num_top] for j in range(n)]  # noqa: E731
        return cls(lp, rank, rows(ids), rows(vals))


def token_logprobs(entries: list[Any]) -> TokenLogprobs:
    """Columns of engine `TokenLogprob`s (token_id, logprob, rank, top [(id, logprob)])."""
    return TokenLogprobs([e.logprob for e in entries], [e.rank for e in entries],
                         [[i for i, _ in e.top] for e in entries], [[v for _, v in e.top] for e in entries])


_VALUE_TYPES = {int: frozenset({int}), float: frozenset({int, float})}  # exact types: no bool, no subclass


def _expect_list(x: Any, n: int, kind: type, name: str) -> None:
    if not isinstance(x, list) or len(x) != n:
        raise MessageError(f"{name}: expected a list of {n}")
    if not _VALUE_TYPES[kind].issuperset(map(type, x)):
        raise MessageError(f"{name}: expected {kind.__name__} values")


def _within(xs: list[int], low: int, high: int) -> bool:
    """Every value of `xs` (ints) in [low, high)."""
    return not xs or (min(xs) >= low and max(xs) < high)


def _dumps(obj: dict) -> bytes:
    data = msgpack.packb(obj, use_bin_type=True)
    if len(data) > MAX_MESSAGE_BYTES:
        raise MessageError(f"message of {len(data)} bytes is over {MAX_MESSAGE_BYTES}")
    return data


def _loads(data: bytes, kind: str) -> dict:
    if not isinstance(data, bytes) or len(data) > MAX_MESSAGE_BYTES:
        raise MessageError("message missing or oversized")
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True, max_bin_len=MAX_MESSAGE_BYTES)
    except Exception as e:  # msgpack raises several types for bad bytes
        raise MessageError(f"undecodable {kind} message: {e}") from None
    if not isinstance(obj, dict) or obj.get("v") != VERSION or obj.get("kind") != kind:
        raise MessageError(f"expected a version {VERSION} {kind!r} message")
    return obj


def pack_durations(queue_s: float | None, compute_s: float | None) -> dict[str, float]:
    """A first token's queue and compute time on its node (TTFT parts: durations on the node's own
    clock, never readings of it); none when not measured."""
    if queue_s is None or compute_s is None:
        return {}
    return {"tq": float(queue_s), "tc": float(compute_s)}


def read_durations(o: dict, what: str) -> tuple[float | None, float | None]:
    """The `pack_durations` fields: both or neither, each a finite number of seconds in 0..MAX_DURATION_S."""
    if "tq" not in o and "tc" not in o:
        return None, None
    out = []
    for key in ("tq", "tc"):
        v = o.get(key)
        if not isinstance(v, float | int) or isinstance(v, bool) or not 0.0 <= v <= MAX_DURATION_S:  # NaN fails too
            raise MessageError(f"{what}: {key!r} must be seconds in 0..{MAX_DURATION_S:g}")
        out.append(float(v))
    return out[0], out[1]


def _field(obj: dict, key: str, kind: type | tuple, what: str) -> Any:
    v = obj.get(key)
    if not isinstance(v, kind) or isinstance(v, bool) and kind is not bool:
        raise MessageError(f"{what}: field {key!r} missing or of the wrong type")
    return v


@dataclass
class FirstToken:
    """P's first token for a request, with its logprobs and the MTP drafts for D."""

    request_id: str
    token: int
    num_logprobs: int | None  # None: no logprobs asked
    logprobs: TokenLogprobs | None
    drafts: list[int] = field(default_factory=list)
    draft_probs: bytes = b""  # fp32 [k, vocab] little-endian, only for sampled requests
    finished: str | None = None  # the first token already ended the request
    num_prompt_logprobs: int | None = None  # prompt_logprobs asked: top-N
    prompt_logprobs: TokenLogprobs | None = None  # one per prompt token after the first; ids are the router's to check
    cached_tokens: int = 0  # prompt tokens P served from its prefix cache
    queue_s: float | None = None  # the prefill node's queue and compute time for it (router/ttft.py), when measured
    compute_s: float | None = None

    def pack(self) -> bytes:
        has = self.num_logprobs is not None
        flag = (FLAG_LOGPROBS if has else 0) | (FLAG_FINISHED if self.finished else 0)
        return _dumps({
            "v": VERSION, "kind": "first_token", "rid": self.request_id, "tok": self.token,
            "meta": pack_meta(flag, self.num_logprobs or 0),
            "lp": self.logprobs.flat() if has and self.logprobs else None,
            "drafts": self.drafts, "dprobs": self.draft_probs, "fin": self.finished,
            **pack_prompt_logprobs(self.num_prompt_logprobs, self.prompt_logprobs),
            **({"cached": self.cached_tokens} if self.cached_tokens else {}),
            **pack_durations(self.queue_s, self.compute_s),
        })

    @classmethod
    def unpack(cls, data: bytes, vocab: int, max_drafts: int) -> FirstToken:
        o = _loads(data, "first_token")
        rid = _field(o, "rid", str, "first_token")
        tok = _field(o, "tok", int, "first_token")
        flag, n = unpack_meta(_field(o, "meta", int, "first_token"))
        if not rid or not 0 <= tok < vocab or n > MAX_LOGPROBS:
            raise MessageError("first_token: request id, token or num_logprobs out of range")
        lps = TokenLogprobs.read(o.get("lp"), 1, n, vocab) if flag & FLAG_LOGPROBS else None
        drafts = o.get("drafts")
        if not isinstance(drafts, list) or len(drafts) > max_drafts:
            raise MessageError("first_token: drafts must be a list of at most k ids")
        _expect_list(drafts, len(drafts), int, "drafts")
        if any(not 0 <= d < vocab for d in drafts):
            raise MessageError("first_token: draft id out of range")
        dprobs = o.get("dprobs", b"")
        if not isinstance(dprobs, bytes) or len(dprobs) not in (0, 4 * vocab * len(drafts)):
            raise MessageError("first_token: draft probabilities of the wrong size")
        fin = o.get("fin")
        if fin is not None and fin not in ("stop", "length"):
            raise MessageError("first_token: bad finish reason")
        num_plp, plp = read_prompt_logprobs(o, vocab)
        queue_s, compute_s = read_durations(o, "first_token")
        return cls(rid, tok, n if flag & FLAG_LOGPROBS else None, lps, drafts, dprobs, fin, num_plp, plp,
                   read_cached(o, "first_token"), queue_s, compute_s)


def read_cached(o: dict, what: str) -> int:
    """A message's count of prompt tokens served from the prefix cache (0 when left out)."""
    cached = o.get("cached", 0)
    if type(cached) is not int or not 0 <= cached < MAX_PROMPT_TOKENS:
        raise MessageError(f"{what}: bad cached token count")
    return cached


def pack_prompt_logprobs(num_top: int | None, lps: TokenLogprobs | None) -> dict[str, Any]:
    """The prompt-logprob fields of a message (none unless asked)."""
    if num_top is None or lps is None:
        return {}
    if not 0 <= num_top <= MAX_LOGPROBS:
        raise MessageError(f"prompt num_logprobs {num_top} out of range")
    return {"plp": lps.flat(), "plp_n": len(lps.logprob), "plp_top": num_top}


def read_prompt_logprobs(o: dict, vocab: int) -> tuple[int | None, TokenLogprobs | None]:
    if "plp" not in o:
        return None, None
    n, top = o.get("plp_n"), o.get("plp_top")
    if type(n) is not int or type(top) is not int or not 0 <= n < MAX_PROMPT_TOKENS or not 0 <= top <= MAX_LOGPROBS:
        raise MessageError("prompt logprobs: bad count or top-N")
    return top, TokenLogprobs.read(o.get("plp"), n, top, vocab)


@dataclass
class OutputItem:
    """New tokens of one request from a decode step; terminal when `finish_reason` or `error`."""

    request_id: str
    tokens: list[int]
    num_logprobs: int | None = None
    logprobs: TokenLogprobs | None = None
    finish_reason: str | None = None
    error: str | None = None
    steps: int = 0
    accepted: int = 0
    index: int = 0  # the choice of an n > 1 request these tokens belong to
    num_prompt_logprobs: int | None = None  # colocated: the first item carries the prompt's logprobs
    prompt_logprobs: TokenLogprobs | None = None
    cached_tokens: int = 0  # a colocated node's terminal item: prompt tokens served from its prefix cache
    malformed: bool = False  # made by the receiver for an item it refused (never on the wire)
    queue_s: float | None = None  # colocated: the first item carries its queue and compute time (router/ttft.py)
    compute_s: float | None = None

    def to_obj(self) -> dict:
        """The item's map. Fields at their default (None, 0, no prompt logprobs) are left out: readers
        take a missing one as its default, so most items of a step are three or four keys."""
        has = self.num_logprobs is not None
        flag = (FLAG_LOGPROBS if has else 0) | (FLAG_FINISHED if self.finish_reason else 0) | (
            FLAG_ERROR if self.error else 0)
        o = {"rid": self.request_id, "toks": self.tokens, "meta": pack_meta(flag, self.num_logprobs or 0)}
        if has and self.logprobs:
            o["lp"] = self.logprobs.flat()
        if (self.finish_reason is not None or self.error is not None or self.steps or self.accepted or self.index
                or self.num_prompt_logprobs is not None or self.cached_tokens or self.queue_s is not None):
            self._rare_fields(o)  # a terminal (stats), a choice of n > 1, a colocated first token
        return o

    def _rare_fields(self, o: dict) -> None:
        for key, value in (("fin", self.finish_reason), ("err", self.error)):
            if value is not None:
                o[key] = value
        for key, number in (("steps", self.steps), ("acc", self.accepted), ("idx", self.index),
                            ("cached", self.cached_tokens)):
            if number:
                o[key] = number
        if self.num_prompt_logprobs is not None:
            o.update(pack_prompt_logprobs(self.num_prompt_logprobs, self.prompt_logprobs))
        o.update(pack_durations(self.queue_s, self.compute_s))

    @classmethod
    def from_obj(cls, o: Any, vocab: int) -> OutputItem:
        if not isinstance(o, dict):
            raise MessageError("output item must be a map")
        rid = _field(o, "rid", str, "output")
        toks = o.get("toks")
        if not isinstance(toks, list):
            raise MessageError("output: tokens must be a list")
        _expect_list(toks, len(toks), int, "output tokens")
        if not _within(toks, 0, vocab):
            raise MessageError("output: token id out of range")
        flag, n = unpack_meta(_field(o, "meta", int, "output"))
        if n > MAX_LOGPROBS:
            raise MessageError("output: num_logprobs over 20")
        lps = TokenLogprobs.read(o.get("lp"), len(toks), n, vocab) if flag & FLAG_LOGPROBS else None
        fin, err = o.get("fin"), o.get("err")
        if fin is not None and fin not in ("stop", "length", "abort"):
            raise MessageError("output: bad finish reason")
        if err is not None and not isinstance(err, str):
            raise MessageError("output: error must be a string")
        steps, acc, idx = o.get("steps", 0), o.get("acc", 0), o.get("idx", 0)
        if not isinstance(steps, int) or not isinstance(acc, int) or steps < 0 or acc < 0:
            raise MessageError("output: bad stats")
        if type(idx) is not int or not 0 <= idx < MAX_CHOICES:
            raise MessageError(f"output: choice index must be in 0..{MAX_CHOICES - 1}")
        num_plp, plp = read_prompt_logprobs(o, vocab)
        queue_s, compute_s = read_durations(o, "output")
        return cls(rid, toks, n if flag & FLAG_LOGPROBS else None, lps, fin, err, steps, acc, idx, num_plp, plp,
                   read_cached(o, "output"), queue_s=queue_s, compute_s=compute_s)


def pack_outputs(items: list[OutputItem]) -> bytes:
    return _dumps({"v": VERSION, "kind": "outputs", "items": [i.to_obj() for i in items]})


def unpack_outputs(data: bytes, vocab: int) -> list[OutputItem]:
    """Every item of an output batch; MessageError when any is malformed."""
    return [OutputItem.from_obj(i, vocab) for i in _output_objs(data)]


def read_outputs(data: bytes, vocab: int) -> list[OutputItem]:
    """An output batch as a receiver takes it: a malformed item that names its request (a string
    `rid`) becomes that request's error item (`malformed`, `error` saying why), so the batch's other
    requests go on; MessageError when the batch itself, or an item without a readable request id,
    is malformed (then nothing in it can be trusted). A step's plain items (most of them) are
    checked a column at a time over the batch (`_read_plain`), the others one by one."""
    objs = _output_objs(data)
    plain = [type(o) is dict and _PLAIN_KEYS.issuperset(o) and type(o.get("rid")) is str
             and type(o.get("toks")) is list and type(o.get("meta")) is int and o["meta"] in (0, FLAG_LOGPROBS)
             and (o["meta"] == 0 or type(o.get("lp")) is list) for o in objs]
    read = _read_plain([o for o, p in zip(objs, plain, strict=True) if p], vocab) if any(plain) else []
    if read is None:  # some plain item is out of range: each is read alone, to fail alone
        plain, read = [False] * len(objs), []
    ready = iter(read)
    return [next(ready) if p else _read_item(o, vocab) for o, p in zip(objs, plain, strict=True)]


def _read_item(obj: Any, vocab: int) -> OutputItem:
    try:
        return OutputItem.from_obj(obj, vocab)
    except MessageError as e:
        rid = obj.get("rid") if isinstance(obj, dict) else None
        if not isinstance(rid, str) or not rid:
            raise
        return OutputItem(rid, [], error=f"malformed output item: {e}", malformed=True)


_PLAIN_KEYS = frozenset({"rid", "toks", "meta", "lp"})


def _read_plain(objs: list[dict], vocab: int) -> list[OutputItem] | None:
    """Plain items (a request id, tokens, and at most the sampled tokens' logprobs and ranks: meta
    0 or FLAG_LOGPROBS with no top-N), checked a column at a time over all of them rather than a
    field at a time per item; None when any check fails."""
    toks = [o["toks"] for o in objs]
    flat = list(chain.from_iterable(toks))
    if not _VALUE_TYPES[int].issuperset(map(type, flat)) or not _within(flat, 0, vocab):
        return None
    cols = [o["lp"] if o["meta"] else None for o in objs]
    lps = [c for c in cols if c is not None]
    if lps and not _plain_logprobs(lps, [len(t) for t, c in zip(toks, cols, strict=True) if c is not None], vocab):
        return None
    return [OutputItem(o["rid"], t) if c is None else OutputItem(o["rid"], t, 0, TokenLogprobs(
            c[0], c[1], _no_top(len(t)), _no_top(len(t)))) for o, t, c in zip(objs, toks, cols, strict=True)]


def _no_top(n: int) -> list:
    """n empty top-N rows: one list n times (rows are read, never written)."""
    return [[]] * n


def _plain_logprobs(cols: list, lengths: list[int], vocab: int) -> bool:
    """Each item's columns [logprobs, ranks, [], []], one logprob <= 0 and one rank in 1..vocab per
    token, checked over every item at once."""
    if not all(type(c) is list and len(c) == 4 and type(c[0]) is list and type(c[1]) is list and c[2] == []
               and c[3] == [] and len(c[0]) == n == len(c[1]) for c, n in zip(cols, lengths, strict=True)):
        return False
    lp = list(chain.from_iterable(c[0] for c in cols))
    rank = list(chain.from_iterable(c[1] for c in cols))
    return (_VALUE_TYPES[float].issuperset(map(type, lp)) and _VALUE_TYPES[int].issuperset(map(type, rank))
            and not (lp and max(lp) > 0.0) and _within(rank, 1, vocab + 1))


def _output_objs(data: bytes) -> list:
    items = _loads(data, "outputs").get("items")
    if not isinstance(items, list):
        raise MessageError("outputs: items must be a list")
    return items
