"""Incremental detokenization and stop strings: output token ids -> text deltas.

Receives a request's output tokens one at a time; hands back the text that is safe to show:
never a piece of a UTF-8 character split across tokens (text ending in U+FFFD is held
until the next token completes it), never a possible beginning of a stop string (held until
it is ruled out), never anything from a stop string on. `finish()` releases what is held.

The concatenated deltas equal `tokenizer.decode(all_ids)` (cut before the first stop
string), which is what the single-process `pdserve generate` prints.

A tokenizer backed by the Rust `tokenizers` library (`.backend`) decodes in native code
(`tokenizers.decoders.DecodeStream`: the same two-offset scheme, one call per message); any
other tokenizer, and a stream whose native decoder raised, decodes here in Python.
"""

from __future__ import annotations

from typing import Any

import tokenizers
from tokenizers.decoders import DecodeStream

REPLACEMENT = "\ufffd"


class Detokenizer:
    """vLLM's two-offset scheme: decode a short window twice (with and without the newest
    tokens) so tokenizers whose pieces depend on their left neighbour decode correctly."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # window start
        self.read = 0  # tokens before this are in the released text
        backend = getattr(tokenizer, "backend", None)
        self._backend = backend if isinstance(backend, tokenizers.Tokenizer) else None
        self._native = DecodeStream(skip_special_tokens=True) if self._backend is not None else None

    def add(self, token: int) -> str:
        self.ids.append(token)
        return self._step(token)

    def add_many(self, tokens: list[int]) -> str:
        """`add` for several tokens at once (two decodes, not two per token): the same text in all."""
        self.ids += tokens
        return self._step(tokens)

    def flush(self) -> str:
        return self._delta(final=True)

    def _step(self, new: int | list[int]) -> str:
        """The native decoder's delta; it keeps the same window as `_delta` (its start moves to the
        last release when it releases text), so `_delta` can take over at any point: at `flush`
        (what it still holds at the end) and when it raises (its text no longer starts with the
        window's, which the Python scheme does not require)."""
        if self._native is None or self._backend is None:
            return self._delta(final=False)
        try:
            piece = self._native.step(self._backend, new)
        except Exception:  # noqa: BLE001 - any native failure: Python decodes the rest of this stream
            self._native = None
            return self._delta(final=False)
        if piece is None:
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return str(piece)

    def _delta(self, final: bool) -> str:
        if self.tokenizer is None or self.read == len(self.ids):
            return ""
        before = self.tokenizer.decode(self.ids[self.prefix : self.read], skip_special_tokens=True)
        now = self.tokenizer.decode(self.ids[self.prefix :], skip_special_tokens=True)
        if len(now) <= len(before) or (now.endswith(REPLACEMENT) and not final):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return now[len(before) :]


class TextStream:
    """Detokenizer + stop strings for one request."""

    def __init__(self, tokenizer: Any, stop: tuple[str, ...] = ()) -> None:
        self.detok = Detokenizer(tokenizer)
        self.stop = stop
        self.text = ""  # with stop strings: all text known so far (cut at a stop string once one is found)
        self.sent = 0  # characters released
        self.stopped = False

    def add(self, token: int) -> str:
        """Text released by `token` ('' while held); sets `stopped` when a stop string ends here."""
        assert not self.stopped, "no tokens after a stop string"
        return self._append(self.detok.add(token), final=False)

    def add_many(self, tokens: list[int]) -> str:
        """Text released by `tokens`, with no stop strings (else `add` them one by one: the stop
        string may end before the last of them)."""
        assert not self.stop, "add_many is for requests without stop strings"
        return self._append(self.detok.add_many(tokens), final=False)

    def finish(self) -> str:
        """What is still held, at the end of the request."""
        if self.stopped:
            return ""
        return self._append(self.detok.flush(), final=True)

    def _append(self, piece: str, final: bool) -> str:
        if not self.stop:  # nothing to hold back or cut: every piece goes out whole, and no text is
            self.sent += len(piece)  # kept (appending to it copied the whole stream's text per message)
            return piece
        start = max(0, len(self.text) - max((len(s) for s in self.stop), default=0) + 1)
        self.text += piece
        cut = min((i for i in (self.text.find(s, start) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.text, self.stopped = self.text[:cut], True
            final = True
        end = len(self.text) if final else len(self.text) - self._held_suffix()
        end = max(end, self.sent)
        delta, self.sent = self.text[self.sent : end], end
        return delta

    def _held_suffix(self) -> int:
        """Length of the longest unreleased tail of `text` that some stop string starts with."""
        tail = self.text[self.sent :]
        for n in range(min(len(tail), max((len(s) for s in self.stop), default=1) - 1), 0, -1):
            if any(s.startswith(tail[-n:]) for s in self.stop):
                return n
        return 0


class TokenPieces:
    """Each token id's own text (`decode([id])`, special tokens kept), remembered: logprob entries
    name every token, and a vocabulary is small. Quacks as the tokenizer for that one call."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._pieces: dict[int, str] = {}

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        if len(ids) != 1 or skip_special_tokens:
            return str(self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))
        piece = self._pieces.get(ids[0])
        if piece is None:
            piece = self._pieces[ids[0]] = str(self.tokenizer.decode(ids, skip_special_tokens=False))
        return piece
