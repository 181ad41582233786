"""Fuzzing the msgpack node messages (protos/messages.py) as a receiver reads them: random
bytes, random msgpack values, and valid messages with fields dropped or replaced. Every input
ends in a MessageError or a message that keeps every rule a receiver relies on (ids inside the
vocabulary, at most k drafts, draft probabilities of the exact size, logprob columns of the
announced width) and packs back to what was read; nothing else escapes."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from protos import messages
from protos.messages import (
    MAX_DURATION_S,
    MAX_LOGPROBS,
    FirstToken,
    MessageError,
    OutputItem,
    TokenLogprobs,
    pack_outputs,
    unpack_outputs,
)
from tests.fuzz import VALUES, fuzz_settings, mutated, packb

VOCAB, K = 320, 3
LPS = TokenLogprobs([-0.5], [1], [[4, 5]], [[-0.5, -1.0]])
FIRST = FirstToken("router/r/1", 7, 2, LPS, [1, 2, 3], b"\0" * (4 * VOCAB * 3), None, queue_s=0.002,
                   compute_s=0.0125)
OUTPUT = OutputItem("router/r/1", [1, 2], 1, TokenLogprobs([-0.1, -0.2], [1, 2], [[1], [2]], [[-0.1], [-0.2]]),
                    "length", steps=2, accepted=1, queue_s=0.0, compute_s=3)


def first_obj() -> dict:
    import msgpack

    obj: dict = msgpack.unpackb(FIRST.pack(), raw=False)
    return obj


def check_first(msg: FirstToken) -> None:
    assert msg.request_id and 0 <= msg.token < VOCAB
    assert len(msg.drafts) <= K and all(0 <= d < VOCAB for d in msg.drafts)
    assert len(msg.draft_probs) in (0, 4 * VOCAB * len(msg.drafts))
    assert msg.finished in (None, "stop", "length")
    check_durations(msg.queue_s, msg.compute_s)
    if msg.num_logprobs is not None:
        assert 0 <= msg.num_logprobs <= MAX_LOGPROBS and msg.logprobs is not None
        check_logprobs(msg.logprobs, 1, msg.num_logprobs)


def check_durations(queue_s: float | None, compute_s: float | None) -> None:
    """A node's TTFT parts: both or neither, finite seconds within bounds (router/ttft.py trusts that)."""
    assert (queue_s is None) == (compute_s is None)
    assert queue_s is None or all(type(s) is float and 0 <= s <= MAX_DURATION_S for s in (queue_s, compute_s))


def check_logprobs(lp: TokenLogprobs, n: int, width: int) -> None:
    assert len(lp.logprob) == len(lp.rank) == len(lp.top_ids) == len(lp.top_logprobs) == n
    assert all(len(row) == width for row in lp.top_ids + lp.top_logprobs)
    assert all(1 <= r <= VOCAB for r in lp.rank) and all(0 <= i < VOCAB for row in lp.top_ids for i in row)


def check_output(item: OutputItem) -> None:
    assert all(0 <= t < VOCAB for t in item.tokens)
    assert item.finish_reason in (None, "stop", "length", "abort")
    assert item.error is None or isinstance(item.error, str)
    assert item.steps >= 0 and item.accepted >= 0
    check_durations(item.queue_s, item.compute_s)
    if item.num_logprobs is not None:
        assert item.logprobs is not None
        check_logprobs(item.logprobs, len(item.tokens), item.num_logprobs)


def read_first(data: bytes) -> None:
    try:
        msg = FirstToken.unpack(data, VOCAB, max_drafts=K)
    except MessageError:
        return
    check_first(msg)
    assert FirstToken.unpack(msg.pack(), VOCAB, max_drafts=K).pack() == msg.pack()  # bytes: NaN != NaN


def read_outputs(data: bytes) -> None:
    try:  # the router's reader: a bad item that names its request becomes that request's error
        lenient = messages.read_outputs(data, VOCAB)
    except MessageError:
        lenient = None
    for item in lenient or []:
        check_output(item)
        assert not item.malformed or (item.request_id and item.error and not item.tokens)
    try:
        items = unpack_outputs(data, VOCAB)
    except MessageError:
        assert lenient is None or any(i.malformed for i in lenient)
        return
    assert lenient == items
    for item in items:
        check_output(item)
    assert pack_outputs(unpack_outputs(pack_outputs(items), VOCAB)) == pack_outputs(items)


def test_the_valid_messages_read_back() -> None:
    assert FirstToken.unpack(FIRST.pack(), VOCAB, K) == FIRST
    assert unpack_outputs(pack_outputs([OUTPUT]), VOCAB) == [OUTPUT]


@fuzz_settings(300)
@given(st.binary(max_size=512))
def test_random_bytes(data: bytes) -> None:
    read_first(data)
    read_outputs(data)


@fuzz_settings(300)
@given(VALUES)
def test_any_msgpack_value(value: object) -> None:
    read_first(packb(value))
    read_outputs(packb(value))


IDS = st.integers(-2, 2) | st.integers(VOCAB - 2, VOCAB + 2) | st.integers(0, VOCAB)  # edges first
NUM_LOGPROBS = st.integers(0, 3) | st.just(MAX_LOGPROBS) | st.integers(0, MAX_LOGPROBS + 2)
RIDS = st.sampled_from(["r", "router/r/1"]) | st.text(max_size=4)
FLOATS = st.sampled_from([0.0, -0.0, -1.5, 1e-9, float("nan"), float("-inf"), float("inf")]) | st.floats()


@st.composite
def logprob_columns(draw: st.DrawFn, n: int, width: int) -> list:
    """Four columns near the announced shape (a length off by one now and then)."""
    def size(k: int) -> int:
        return max(0, k + draw(st.sampled_from([0, 0, 0, 0, 0, -1, 1])))
    a, b, c, d = size(n), size(n), size(n * width), size(n * width)
    return [draw(st.lists(FLOATS, min_size=a, max_size=a)),
            draw(st.lists(IDS | st.integers(0, VOCAB + 1), min_size=b, max_size=b)),
            draw(st.lists(IDS, min_size=c, max_size=c)),
            draw(st.lists(FLOATS, min_size=d, max_size=d))]


@st.composite
def typed_first(draw: st.DrawFn) -> dict:
    """A first-token map of the right shape with values at and past every bound."""
    flag, n = draw(st.integers(0, 7)), draw(NUM_LOGPROBS)
    drafts = draw(st.lists(IDS, max_size=K + 1))
    nprobs = draw(st.sampled_from([0, 4 * VOCAB * len(drafts), 4 * VOCAB * len(drafts) + 4]))
    return {"v": 1, "kind": "first_token", "rid": draw(RIDS), "tok": draw(IDS),
            "meta": flag | n << 8, "lp": draw(logprob_columns(1, n)), "drafts": drafts,
            "dprobs": b"\0" * nprobs, "fin": draw(st.sampled_from([None, None, "stop", "length", "abort", ""]))}


@st.composite
def typed_output(draw: st.DrawFn) -> dict:
    toks = draw(st.lists(IDS, max_size=4))
    flag, n = draw(st.integers(0, 7)), draw(NUM_LOGPROBS)
    return {"rid": draw(RIDS), "toks": toks, "meta": flag | n << 8,
            "lp": draw(logprob_columns(len(toks), n)), "fin": draw(st.sampled_from([None, "stop", "length", "abort", "x"])),
            "err": draw(st.none() | st.text(max_size=4) | st.integers(-(2**63), 2**63)),
            "steps": draw(st.integers(-1, 3)), "acc": draw(st.integers(-1, 3))}


@fuzz_settings(400)
@given(typed_first())
def test_first_token_at_the_bounds(obj: dict) -> None:
    read_first(packb(obj))


@fuzz_settings(300)
@given(st.lists(typed_output(), max_size=3))
def test_output_batches_at_the_bounds(items: list[dict]) -> None:
    read_outputs(packb({"v": 1, "kind": "outputs", "items": items}))


@fuzz_settings(400)
@given(mutated(first_obj()))
def test_first_token_with_fields_dropped_or_replaced(obj: dict) -> None:
    read_first(packb(obj))


@fuzz_settings(400)
@given(st.lists(mutated(OUTPUT.to_obj()), min_size=1, max_size=3), mutated({"v": 1, "kind": "outputs", "items": []}))
def test_output_batches_with_fields_dropped_or_replaced(items: list[dict], envelope: dict) -> None:
    read_outputs(packb({"v": 1, "kind": "outputs", "items": items}))
    read_outputs(packb({**envelope, "items": items} if "items" in envelope else envelope))


@st.composite
def plain_output(draw: st.DrawFn) -> dict:
    """A plain step's item (what `read_outputs` checks a column at a time over the batch), at and
    past its bounds: meta 0 or 1 (and near misses), logprob columns of the right shape or not."""
    toks = draw(st.lists(IDS | st.booleans(), max_size=4))
    meta = draw(st.sampled_from([0, 0, 1, 1, 1, True, 2, 1 | 1 << 8]))
    item: dict = {"rid": draw(RIDS), "toks": toks, "meta": meta}
    if meta and draw(st.integers(0, 5)):
        lp = st.lists(st.sampled_from([0.0, -0.0, -1.5, 1e-9, float("-inf"), float("inf"), 0, -1, True]),
                      min_size=len(toks), max_size=len(toks))
        rank = st.lists(st.integers(-1, 2) | st.integers(VOCAB - 1, VOCAB + 2) | st.floats(),
                        min_size=len(toks), max_size=len(toks))
        cols = [draw(lp), draw(rank), [], []]
        item["lp"] = draw(st.sampled_from([cols, cols, cols, cols[:3], [cols[0], cols[1], [1], []], cols[0]]))
    return item


@fuzz_settings(400)
@given(st.lists(plain_output() | plain_output() | typed_output(), min_size=1, max_size=5))
def test_plain_step_batches_read_as_item_by_item(items: list[dict]) -> None:
    read_outputs(packb({"v": 1, "kind": "outputs", "items": items}))


def test_a_plain_batch_reads_as_its_items() -> None:
    items = [OutputItem("r/1", [1, 2], 0, TokenLogprobs([-0.5, 0.0], [1, VOCAB], [[], []], [[], []])),
             OutputItem("r/2", [VOCAB - 1])]
    assert messages.read_outputs(pack_outputs(items), VOCAB) == items == unpack_outputs(pack_outputs(items), VOCAB)
    bad = [OutputItem("r/1", [1]), OutputItem("r/2", [VOCAB])]  # one token outside the vocabulary
    got = messages.read_outputs(pack_outputs(bad), VOCAB)
    assert got[0] == bad[0] and got[1].malformed and "out of range" in (got[1].error or "")
    mixed = [OutputItem("r/3", [3], finish_reason="length", steps=1), *items, OUTPUT]  # plain ones among others
    assert messages.read_outputs(pack_outputs(mixed), VOCAB) == mixed
