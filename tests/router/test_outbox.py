"""A request's outbox: steps that come while a token message still waits join it (the first
message, the time to first token, stays alone; a terminal never takes tokens), in order; plain
logprobs kept beside a message go into it as they would have been added; and the ITL histogram
moves by n in one step as it would by n observes."""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry, Counter, Histogram

from protos import node_pb2
from protos import pdserve_pb2 as pb
from protos.messages import TokenLogprobs
from router.metrics import LATENCY_BUCKETS, TokenTally, observe_n
from router.request import RequestState, is_terminal
from router.validate import Prepared
from tests.router.conftest import TINY


def state(max_tokens: int = 100, stop: tuple[str, ...] = ()) -> RequestState:
    prep = Prepared("r", [256, 97], node_pb2.Sampling(max_tokens=max_tokens), stop, None, 60.0)
    return RequestState(prep, TINY.tokenizer)


def lps(toks: list[int]) -> TokenLogprobs:
    return TokenLogprobs([-0.5] * len(toks), [1] * len(toks), [[t] for t in toks], [[-0.5]] * len(toks))


async def test_steps_behind_an_unread_message_join_it_in_order():
    st = state()
    st.add_tokens([ord("a")], lps([ord("a")]))  # the first token: its own message
    st.add_tokens([ord("b"), ord("c")], lps([ord("b"), ord("c")]))
    st.add_tokens([ord("d")], lps([ord("d")]))
    assert st.out.qsize() == 2
    first, joined = await st.out.get(), await st.out.get()
    assert list(first.token_ids) == [ord("a")] and first.text == "a" and list(first.prompt_token_ids) == [256, 97]
    assert list(joined.token_ids) == [ord(c) for c in "bcd"] and joined.text == "bcd"
    assert [lp.token_id for lp in joined.logprobs] == [ord(c) for c in "bcd"] and not joined.prompt_token_ids
    st.add_tokens([ord("e")], None)  # the last one was taken: a new message
    st.finish("length")
    msgs = [await st.out.get(), await st.out.get()]
    assert list(msgs[0].token_ids) == [ord("e")] and is_terminal(msgs[1]) and not msgs[1].token_ids
    assert st.out.empty() and st.tokens == [ord(c) for c in "abcde"]


async def test_a_waiting_reader_gets_each_message_and_max_tokens_cuts_a_batch():
    st = state(max_tokens=4)
    reader = asyncio.ensure_future(st.out.get())
    await asyncio.sleep(0)
    st.add_tokens([ord("x")], None)
    assert list((await reader).token_ids) == [ord("x")]
    assert st.add_tokens([ord("y"), ord("z"), ord("w"), ord("v")], None)  # complete: 4 tokens
    assert list((await st.out.get()).token_ids) == [ord("y"), ord("z"), ord("w")]


async def test_a_stop_string_inside_a_batch_cuts_it_at_the_token_that_ends_it():
    st = state(stop=("cd",))
    st.add_tokens([ord("a")], None)
    assert st.add_tokens([ord(c) for c in "bcde"], None) and st.text.stopped
    await st.out.get()
    msg = await st.out.get()
    assert list(msg.token_ids) == [ord(c) for c in "bcd"] and msg.text == "b"


BATCHES = [  # (tokens, logprobs, ranks, top-N alternatives or not)
    ([97], [-0.1], [1], False), ([98, 99], [-1e300, float("-inf")], [2, 3], False), ([100], [-1e-46], [1], False),
    ([101, 102], [-0.123456789, -2.0], [1, 4], True), ([103], [-3.5e38], [7], False), ([104, 105], [0.0, -0.5], [1, 1], False),
]


def batch_logprobs(values: list[float], ranks: list[int], top: bool) -> TokenLogprobs:
    return TokenLogprobs(values, ranks, [[5, 6] if top else [] for _ in values], [[-1.0, -2.0] if top else [] for _ in values])


def expected(tokens: list[int], values: list[float], ranks: list[int], top: bool) -> list[pb.TokenLogprob]:
    return [pb.TokenLogprob(token_id=t, logprob=v, rank=r, top_ids=[5, 6] if top else [],
                            top_logprobs=[-1.0, -2.0] if top else []) for t, v, r in zip(tokens, values, ranks, strict=True)]


async def test_plain_logprobs_go_into_a_message_taken_as_they_would_have_been_added():
    st = state()
    for i, (toks, values, ranks, top) in enumerate(BATCHES):
        st.add_tokens(toks, batch_logprobs(values, ranks, top))
        if i in (0, 4):  # the first message; then a message with plain, top-N and plain batches in it
            msg = await st.out.get()
            want = [lp for b in (BATCHES[:1] if i == 0 else BATCHES[1:5]) for lp in expected(*b)]
            assert list(msg.logprobs) == want
    st.add_tokens([106, 107, 108], batch_logprobs([-0.25, -0.75], [1, 2], False))  # zip's pairing: 2 logprobs
    msg = await st.out.get()
    assert list(msg.logprobs) == expected(*BATCHES[5]) + expected([106, 107], [-0.25, -0.75], [1, 2], False)


def test_observe_n_is_n_observes():
    one, many = (Histogram("x", "x", buckets=LATENCY_BUCKETS, registry=CollectorRegistry()) for _ in range(2))
    for value in (0.0, 0.001, 0.0010001, 0.03, 5.0, 640.0, 900.0):
        for _ in range(3):
            one.observe(value)
        observe_n(many, value, 3)
    count = lambda h: [b.get() for b in h._buckets]  # noqa: E731
    assert count(one) == count(many) and abs(one._sum.get() - many._sum.get()) < 1e-9


def test_a_token_tally_read_out_is_its_observes():
    registry = CollectorRegistry()
    one, many = (Histogram(f"x{i}", "x", buckets=LATENCY_BUCKETS, registry=registry) for i in range(2))
    counted, tallied = (Counter(f"c{i}", "c", registry=registry) for i in range(2))
    tally = TokenTally(tallied, many)
    for n, gap in ((4, None), (1, None), (3, 0.0), (2, 0.001), (4, 0.0010001), (1, 5.0), (2, 900.0)):
        counted.inc(n)
        for _ in range(n if gap is not None else 0):
            one.observe(gap)
        tally.add(n, gap)
        if n == 4:
            tally.flush()  # read out between adds too
    tally.flush()
    count = lambda h: [b.get() for b in h._buckets]  # noqa: E731
    assert count(one) == count(many) and abs(one._sum.get() - many._sum.get()) < 1e-9
    assert counted._value.get() == tallied._value.get() == 17


async def test_choices_of_an_n_request_never_share_a_message_and_the_first_carries_prompt_logprobs():
    prep = Prepared("r", [256, 97], node_pb2.Sampling(max_tokens=100, n=2), (), None, 60.0)
    st = RequestState(prep, TINY.tokenizer)
    st.set_prompt_logprobs(lps([97]))
    st.add_tokens([ord("a")], None, 0)  # the first message: the prompt and its logprobs
    st.add_tokens([ord("b")], None, 1)
    st.add_tokens([ord("c")], None, 1)  # joins choice 1's waiting message
    st.add_tokens([ord("d")], None, 0)  # choice 1's is the tail: a new message
    st.add_tokens([ord("e")], None, 0)
    st.finish_choice(1, "length")
    st.add_tokens([ord("f")], None, 0)  # never joins a message that ends a choice
    msgs = [await st.out.get() for _ in range(st.out.qsize())]
    assert [(m.index, list(m.token_ids)) for m in msgs] == [
        (0, [ord("a")]), (1, [ord("b"), ord("c")]), (0, [ord("d"), ord("e")]), (1, []), (0, [ord("f")])]
    assert [lp.token_id for lp in msgs[0].prompt_logprobs] == [97] and list(msgs[0].prompt_token_ids) == [256, 97]
    assert not any(m.prompt_logprobs or m.prompt_token_ids for m in msgs[1:]) and msgs[3].finish_reason == "length"
    assert st.choices[0].tokens == [ord(c) for c in "adef"] and st.choices[1].tokens == [ord(c) for c in "bc"]
