"""Grammars of structured output (issue 28): a `StructuredSpec` compiled into token masks.

The only module that imports xgrammar. Receives a spec (engine/grammar/structured.py) and the model's
tokenizer; hands on `Matcher`s, one per constrained request, that follow its output token by
token and fill the packed bitmask of the tokens allowed next: ceil(V / 32) int32 words per
row, bit j of word w allowing token 32 * w + j (xgrammar's layout, which kernels/token_mask.py
applies to the logits on the device).

JSON schemas and json_object compile with `any_whitespace=False` (one space after ':' and
',', none elsewhere): with free whitespace a small model may emit spaces or newlines forever
and never close the object. A choice is an EBNF alternation of its options as literal strings
(vLLM's guided_choice: the output is exactly one of them, as plain text). A structural tag's
JSON schemas compile the same way: each becomes that grammar before xgrammar reads the tag.

A matcher's grammar state is a pure function of (spec, tokens it accepted), so that is all that
travels between nodes (prefill -> decode, a migration): the receiver compiles the spec and
replays the tokens (`GrammarCompiler.matcher`). Host work only, never a tensor on the device.
"""

from __future__ import annotations

import json
import os
import threading
from collections import OrderedDict
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

import settings
from engine.grammar.structured import StructuredSpec
from engine.model.tiny import BYTE_VOCAB, ByteTokenizer

if TYPE_CHECKING:
    import xgrammar as xgr
else:
    class _OnFirstUse:
        """xgrammar, imported when first touched: it pulls in pydantic and transformers, which an
        engine without structured requests (`pdserve generate`) never loads."""

        def __getattr__(self, name: str) -> Any:
            import xgrammar

            return getattr(xgrammar, name)

    xgr = _OnFirstUse()

MAX_CACHED = 64  # compiled grammars kept (least recently used dropped first)
_JSON_OBJECT = '{"type": "object"}'


def mask_words(vocab_size: int) -> int:
    """int32 words of one row of a token bitmask."""
    return -(-vocab_size // 32)


def tokenizer_info(tokenizer: Any, vocab_size: int, stop_ids: Iterable[int] | None = None) -> xgr.TokenizerInfo:
    """xgrammar's view of our tokenizer: each id's text, `vocab_size` the model's (it may exceed
    the tokenizer's: ids without text are never allowed), stop ids the EOS set. A byte-level BPE
    Tokenizer (engine/model/tokenizer.py) gives its encoded tokens ('Ġ' for a space), its special tokens
    no text; tiny's ByteTokenizer gives ids 0..255 as the raw bytes."""
    stop = list(tokenizer.eos_token_ids if stop_ids is None else stop_ids)
    if isinstance(tokenizer, ByteTokenizer):
        raw = [bytes([i]) if i < BYTE_VOCAB else b"" for i in range(vocab_size)]
        return xgr.TokenizerInfo(raw, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=stop)
    encoded = [""] * vocab_size
    for text, i in tokenizer.backend.get_vocab(with_added_tokens=True).items():
        if i < vocab_size:
            encoded[i] = text
    for i, added in tokenizer.backend.get_added_tokens_decoder().items():
        if added.special and i < vocab_size:
            encoded[i] = ""  # a control token is never text a grammar may match
    return xgr.TokenizerInfo(encoded, xgr.VocabType.BYTE_LEVEL, vocab_size=vocab_size, stop_token_ids=stop)


# xgrammar 0.2.8 writes a string with minLength/maxLength as repeats of this class, which lets
# raw control characters (U+0000-U+001F) into the string: invalid JSON (RFC 8259 section 7) that
# json.loads and pydantic refuse. Its unbounded strings use the second class; so do we, everywhere.
_BOUNDED_STRING_CHAR = r'[^\"\\\r\n]'
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\\r\n]'


def json_grammar(schema: str, strict_mode: bool = True) -> xgr.Grammar:
    """The grammar of `schema` as xgrammar converts it (no free whitespace), with no raw control
    characters inside strings."""
    g = xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=strict_mode)
    text = str(g)
    fixed = text.replace(_BOUNDED_STRING_CHAR, _JSON_STRING_CHAR)
    return g if fixed == text else xgr.Grammar.from_ebnf(fixed)


def structural_tag_grammar(value: str) -> xgr.Grammar:
    """The grammar of a structural tag (JSON text), each JSON schema in it compiled as
    `json_grammar` does (no free whitespace, no raw control characters in strings)."""
    return xgr.Grammar.from_structural_tag(json.dumps(_schemas_as_grammars(json.loads(value))))


def _schemas_as_grammars(node: Any) -> Any:
    if isinstance(node, list):
        return [_schemas_as_grammars(x) for x in node]
    if not isinstance(node, dict):
        return node
    if node.get("type") == "json_schema" and "json_schema" in node and node.get("style", "json") == "json":
        return {"type": "grammar", "grammar": str(json_grammar(json.dumps(node["json_schema"])))}
    return {k: _schemas_as_grammars(v) for k, v in node.items()}


def choice_grammar(options: list[str]) -> str:
    """EBNF: exactly one of `options` (each a JSON-escaped string literal)."""
    return "root ::= " + " | ".join(json.dumps(o, ensure_ascii=False) for o in options)


class Matcher:
    """One request's place in its grammar: accept tokens, fill the next token's mask, roll back."""

    def __init__(self, compiled: xgr.CompiledGrammar, stop: list[int], never: frozenset[int]) -> None:
        self._m = xgr.GrammarMatcher(compiled)
        self._stop, self._never = stop, never  # `never`: control tokens, refused without xgrammar's warning

    @property
    def is_terminated(self) -> bool:
        """A stop token was accepted: only stop tokens may follow."""
        return bool(self._m.is_terminated())

    def accept(self, token: int) -> bool:
        """Advance over `token`; False (state unchanged) when the grammar does not allow it."""
        return token not in self._never and not self.is_terminated and bool(self._m.accept_token(int(token)))

    def fill_mask(self, bitmask: torch.Tensor, index: int) -> None:
        """Row `index` of `bitmask` ([N, W] int32, host) := the tokens allowed next."""
        if self.is_terminated:
            stop_only(bitmask[index], self._stop)
        else:
            self._m.fill_next_token_bitmask(bitmask, index)

    def rollback(self, n: int) -> None:
        """Undo the last `n` accepted tokens."""
        if n:
            self._m.rollback(n)


class MaskFiller:
    """Fills many matchers' next-token masks in one call to xgrammar's batch matcher, outside the
    GIL (one filler per loop thread; it is not shared). `settings.MASK_THREADS` sets its threads:
    1 by default, because on a GPU host more threads contend with the loop thread that launches
    the steps (BENCHMARKS.md, structured outputs); 0 fills one matcher at a time on this thread."""

    def __init__(self, max_threads: int | None = None) -> None:
        n = settings.MASK_THREADS if max_threads is None else max_threads
        n = min(n, os.cpu_count() or 1)  # 0: one matcher at a time, on this thread
        self._batch = xgr.BatchGrammarMatcher(max_threads=n) if n > 0 else None

    def fill(self, matchers: list[Matcher], bitmask: torch.Tensor, rows: list[int]) -> None:
        """Row rows[i] of `bitmask` := what matchers[i] allows next (stop ids alone once terminated)."""
        plain: list[xgr.GrammarMatcher] = []
        at: list[int] = []
        for m, row in zip(matchers, rows, strict=True):
            if m.is_terminated:
                stop_only(bitmask[row], m._stop)
            else:
                plain.append(m._m)
                at.append(row)
        if len(plain) > 1 and self._batch is not None:
            self._batch.batch_fill_next_token_bitmask(plain, bitmask, at)
            return
        for xm, row in zip(plain, at, strict=True):
            xm.fill_next_token_bitmask(bitmask, row)


def stop_only(row: torch.Tensor, stop_ids: list[int]) -> None:
    """A bitmask row allowing `stop_ids` alone."""
    words: dict[int, int] = {}
    for t in stop_ids:
        words[t // 32] = words.get(t // 32, 0) | 1 << (t % 32)
    row.zero_()
    for w, bits in words.items():
        row[w] = bits - (1 << 32) if bits >= 1 << 31 else bits  # the int32 of those bits


class GrammarCompiler:
    """Specs -> compiled grammars for one tokenizer, with a bounded LRU cache keyed by spec. The
    xgrammar tokenizer view is built on first use (a vocabulary pass, and xgrammar's first compile
    over a 49k vocabulary took ~0.5-1 s on a loaded 2-core host; later ones take ms). Any thread
    may compile: nodes compile a request's spec on the thread that receives it (`precompile`),
    so the loop that inserts it finds it cached."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: Iterable[int] | None = None,
                 max_cached: int = MAX_CACHED) -> None:
        self.tokenizer, self.vocab_size, self.max_cached = tokenizer, vocab_size, max_cached
        self.stop_ids = None if stop_ids is None else tuple(stop_ids)
        self._xgr: xgr.GrammarCompiler | None = None
        self._stop: list[int] = []
        self._never: frozenset[int] = frozenset()
        self._cache: OrderedDict[StructuredSpec, xgr.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()  # the cache and the lazy xgrammar compiler; compiling runs unlocked

    @property
    def words(self) -> int:
        return mask_words(self.vocab_size)

    def compile(self, spec: StructuredSpec) -> xgr.CompiledGrammar:
        """The compiled grammar of `spec`; ValueError naming its kind when it does not compile."""
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                return hit
        compiled = self._compile(spec)
        with self._lock:
            self._cache[spec] = compiled
            while len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
        return compiled

    def precompile(self, spec: StructuredSpec | None) -> None:
        """Compile `spec` into the cache now (any thread); an error is left to whoever compiles it next."""
        if spec is not None:
            try:
                self.compile(spec)
            except ValueError:
                pass

    def matcher(self, spec: StructuredSpec, tokens: Iterable[int] = ()) -> Matcher:
        """A matcher of `spec` that has accepted `tokens` (ValueError when one is not allowed)."""
        compiled = self.compile(spec)
        m = Matcher(compiled, self._stop, self._never)
        for i, t in enumerate(tokens):
            if not m.accept(t):
                raise ValueError(f"token {t} (output position {i}) does not match the structured output {spec.kind}")
        return m

    def _compile(self, spec: StructuredSpec) -> xgr.CompiledGrammar:
        if self.tokenizer is None:
            raise ValueError("structured output needs the model's tokenizer, and this model has none")
        xc = self._compiler()
        try:
            if spec.kind == "json_schema":
                return xc.compile_grammar(json_grammar(spec.value))
            if spec.kind == "json_object":
                return xc.compile_grammar(json_grammar(_JSON_OBJECT, strict_mode=False))
            if spec.kind == "regex":
                return xc.compile_regex(spec.value)
            if spec.kind == "structural_tag":
                return xc.compile_grammar(structural_tag_grammar(spec.value))
            text = choice_grammar(spec.choices) if spec.kind == "choice" else spec.value
            return xc.compile_grammar(text)
        except Exception as e:  # xgrammar raises RuntimeError, ValueError or its own errors
            raise ValueError(f"structured output {spec.kind} does not compile: {e}") from None

    def _compiler(self) -> xgr.GrammarCompiler:
        with self._lock:
            return self._compiler_locked()

    def _compiler_locked(self) -> xgr.GrammarCompiler:
        if self._xgr is None:
            info = tokenizer_info(self.tokenizer, self.vocab_size, self.stop_ids)
            self._xgr = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
            self._stop = list(info.stop_token_ids)
            self._never = frozenset(info.special_token_ids) - set(self._stop)
        return self._xgr
