"""The stream's SSE frames written as text (`Format.frame`) against the same chunk as a dict
encoded (`sse(Format.chunk(...))`): byte for byte, over the chunks a stream sends, and with the
plain logprobs an event stream keeps out of its messages (router/request.py's Outbox)."""

from __future__ import annotations

import itertools
import json

import pytest

from engine.model.tiny import ByteTokenizer
from protos import pdserve_pb2 as pb
from router.detokenize import TokenPieces
from router.openai_protocol import Format, sse
from tests.router.test_outbox import BATCHES, batch_logprobs, state


def message(text: str, ids: list[int], index: int = 0, reason: str = "", top: int = 0,
            logprob: float = -0.25) -> pb.GenerateResponse:
    msg = pb.GenerateResponse(request_id="r", index=index, text=text, finish_reason=reason)
    msg.token_ids.extend(ids)
    for i, t in enumerate(ids):
        msg.logprobs.add(token_id=t, logprob=logprob - i, rank=i + 1, top_ids=[t, 65][:top],
                         top_logprobs=[logprob, -3.5][:top])
    return msg


MESSAGES = [message("héllo \"wörld\"\n🙂", list(b"abc")), message("", []), message("x", [120], reason="length"),
            message("y", [121, 122], index=1, reason="stop"), message("z", [122], top=2),
            message("</s>", [256], logprob=float("-inf")), message("\u2028\x00", [0, 1], top=1)]


@pytest.mark.parametrize(("chat", "logprobs"), [(False, None), (False, 0), (False, 2), (True, None), (True, 0)])
def test_frames_are_the_chunks_encoded(chat: bool, logprobs: int | None) -> None:
    pieces = TokenPieces(ByteTokenizer())
    written, encoded = (Format(chat, "m\u00e9", pieces, logprobs, id="abc", created=7, n=2) for _ in range(2))
    for first, msg in itertools.product((True, False), MESSAGES):
        assert written.frame(msg, first) == sse(encoded.chunk(msg, first))
    assert written.text_offset == encoded.text_offset


@pytest.mark.parametrize("obj", [{"a": [1, -0.1, float("nan"), float("-inf"), None, True]},
                                 {"t": "h\u00e9llo \"w\"\n\U0001f642\u2028\x00", "k": {}, "l": [], "n": {"x": [{}]}}])
def test_sse_is_compact_json(obj: dict) -> None:
    assert sse(obj) == f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


@pytest.mark.parametrize(("chat", "logprobs"), [(False, None), (False, 0), (False, 2), (True, None), (True, 0)])
async def test_frames_of_plain_logprobs_kept_out_are_the_whole_messages_chunks(chat: bool, logprobs: int | None) -> None:
    pieces = TokenPieces(ByteTokenizer())
    written, encoded = (Format(chat, "m", pieces, logprobs, id="abc", created=7) for _ in range(2))
    kept, whole = state(), state()
    kept.out.keeps_plain = True
    taken = []
    for i, (toks, values, ranks, top) in enumerate([*BATCHES, *BATCHES]):
        for st in (kept, whole):
            st.add_tokens(toks, batch_logprobs(values, ranks, top))
        if i % 3 != 1:  # messages of one batch and of several
            msg, plain = await kept.out.get(), kept.out.taken_plain
            taken.append(plain is not None and not msg.logprobs)
            assert written.frame(msg, i == 0, plain) == sse(encoded.chunk(await whole.out.get(), i == 0))
    assert written.text_offset == encoded.text_offset
    assert sum(taken) >= 4  # messages whose logprobs were all kept out


def test_a_prompt_of_token_ids_is_decoded_only_when_echoed() -> None:
    """The first chunk is built on the way to the first token's write: a prompt sent as token ids is
    decoded for `echo` alone, not for every request."""
    pieces = TokenPieces(ByteTokenizer())
    decoded: list[int] = []
    real = pieces.decode
    pieces.decode = lambda ids, **kw: decoded.append(len(ids)) or real(ids, **kw)  # type: ignore[method-assign]
    first = message("x", [120])
    first.prompt_token_ids.extend(b"prompt")
    plain, echo = Format(False, "m", pieces, None), Format(False, "m", pieces, None, echo=True)
    assert json.loads(plain.frame(first, first=True)[6:])["choices"][0]["text"] == "x"
    assert decoded == []
    assert json.loads(echo.frame(first, first=True)[6:])["choices"][0]["text"] == "promptx"
    assert decoded == [6]
