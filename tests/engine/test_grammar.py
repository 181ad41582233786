"""Grammar-constrained decoding (issue 28): the tokenizer's view in xgrammar, the compiler and
its errors, the mask on the logits against a per-token reference, and through the engine:
greedy output that matches its regex / choice / JSON schema, MTP (k = 3) giving exactly the
k = 0 tokens (alone and beside unconstrained requests), seeded sampling, and a request inserted
with tokens already emitted (a decode node's first token)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from engine.grammar import GrammarCompiler, mask_words, tokenizer_info
from engine.structured import StructuredSpec
from engine.tiny import EOS_ID, ByteTokenizer, tiny_config
from kernels.token_mask import mask_logits

VOCAB = tiny_config().vocab_size


def bits_of(bitmask: torch.Tensor, vocab: int) -> list[list[int]]:
    """The allowed token ids of each row, one token at a time (the reference unpacking)."""
    return [[t for t in range(vocab) if (int(row[t // 32]) >> (t % 32)) & 1] for row in bitmask]


def test_mask_logits_equals_reference_on_random_bitmasks():
    g = torch.Generator().manual_seed(0)
    vocab = 77  # not a multiple of 32
    logits = torch.randn(5, vocab, generator=g)
    bitmask = torch.randint(-(2**31), 2**31, (5, mask_words(vocab)), generator=g, dtype=torch.int64).to(torch.int32)
    got = mask_logits(logits, bitmask)
    for r, ok in enumerate(bits_of(bitmask, vocab)):
        want = [x if t in ok else float("-inf") for t, x in enumerate(logits[r].tolist())]
        assert got[r].tolist() == want
    assert mask_logits(logits[None], bitmask[None]).shape == (1, 5, vocab)  # any leading dims


def tiny_compiler() -> GrammarCompiler:
    return GrammarCompiler(ByteTokenizer(), VOCAB)


def test_tiny_tokenizer_info_is_bytes_and_eos():
    info = tokenizer_info(ByteTokenizer(), VOCAB)
    assert info.vocab_size == VOCAB and info.stop_token_ids == [EOS_ID]
    assert info.decoded_vocab[65] == b"A"


def test_smollm2_tokenizer_info_reads_byte_level_tokens(smollm2_gguf):
    from engine.gguf_loader import arch_config_from_gguf, open_gguf
    from engine.tokenizer import Tokenizer

    reader = open_gguf(smollm2_gguf)
    tok, vocab = Tokenizer.from_gguf_metadata(reader), arch_config_from_gguf(reader).vocab_size
    compiler = GrammarCompiler(tok, vocab + 64)  # a model's vocabulary may exceed the tokenizer's
    m = compiler.matcher(StructuredSpec.json_schema({"type": "object", "properties": {"a": {"type": "integer"}},
                                                     "required": ["a"]}))
    for t in tok.encode('{"a": 12}'):
        assert m.accept(t)
    mask = torch.zeros(1, compiler.words, dtype=torch.int32)
    m.fill_mask(mask, 0)
    assert bits_of(mask, vocab + 64) == [list(tok.eos_token_ids)]  # the object is closed: only EOS


def test_choice_is_exactly_one_option_and_terminates_on_eos():
    m = tiny_compiler().matcher(StructuredSpec.choice(['say "yes"', "no"]))
    mask = torch.zeros(2, mask_words(VOCAB), dtype=torch.int32)
    m.fill_mask(mask, 0)
    assert bits_of(mask[:1], VOCAB) == [[ord("n"), ord("s")]]
    for t in b"no":
        assert m.accept(t)
    assert not m.accept(ord("x"))
    assert m.accept(EOS_ID) and m.is_terminated
    m.fill_mask(mask, 1)
    assert bits_of(mask[1:], VOCAB) == [[EOS_ID]]  # terminated: stop tokens only
    m.rollback(2)
    assert not m.is_terminated and m.accept(ord("o"))


@pytest.mark.parametrize("spec", [StructuredSpec("regex", "(ab"), StructuredSpec("grammar", "root ::= missing"),
                                  StructuredSpec("json_schema", '{"type": "no-such-type"}')])
def test_compile_errors_name_the_kind(spec):
    with pytest.raises(ValueError, match=f"structured output {spec.kind} does not compile"):
        tiny_compiler().compile(spec)


def test_compiler_cache_is_bounded_and_keyed_by_spec():
    c = GrammarCompiler(ByteTokenizer(), VOCAB, max_cached=2)
    a = c.compile(StructuredSpec("regex", "a+"))
    assert c.compile(StructuredSpec("regex", "a+")) is a
    c.compile(StructuredSpec("regex", "b+"))
    c.compile(StructuredSpec("regex", "c+"))
    assert len(c._cache) == 2 and c.compile(StructuredSpec("regex", "a+")) is not a


def test_matcher_rejects_replayed_tokens_outside_the_grammar():
    with pytest.raises(ValueError, match="does not match the structured output regex"):
        tiny_compiler().matcher(StructuredSpec("regex", "[0-9]+"), b"12a")
