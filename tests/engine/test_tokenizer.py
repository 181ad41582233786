"""Tokenizer: SmolLM2's byte-level BPE built from GGUF metadata (round trips, special
tokens, digits, chat template, agreement with transformers' own GGUF conversion), the same
tokenizer read back from HF files, and the errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jinja2
import pytest

from engine.model import gguf_meta
from engine.model.paths import resolve_model
from engine.model.tokenizer import Tokenizer

pytestmark = pytest.mark.smollm2

SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
TEXTS = [
    "Hello, world!",
    "  leading spaces,\ttabs\tand trailing   \n\nnew lines\r\n",
    "ünïcödé — Café, naïve; 日本語のテキスト; emoji 🙂👍🏽",
    "numbers 12345 and 3.14159, year 2024, 1e-9",
    "code: def f(x):\n    return x ** 2  # comment\n",
    "Don't stop; it's they're we've I'm you'll he'd",
]


@pytest.fixture(scope="module")
def gguf_path() -> str:
    try:
        return resolve_model("smollm2")
    except ModuleNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def tok(gguf_path: str) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(gguf_meta.open_gguf(gguf_path))


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_round_trip(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert ids and all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_special_ids_and_vocab(tok: Tokenizer) -> None:
    assert tok.vocab_size == 49152
    assert tok.bos_token_id == 1
    assert tok.eos_token_ids == (2,)
    assert [tok.id_to_token(i) for i in (0, 1, 2)] == [
        "<|endoftext|>",
        "<|im_start|>",
        "<|im_end|>",
    ]
    assert tok.token_to_id("<|im_end|>") == 2


def test_special_tokens_encode_whole_and_decode_optionally(tok: Tokenizer) -> None:
    assert tok.encode("<|im_start|>") == [1]
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2 and ids.count(1) == 1
    assert tok.decode(ids) == "user\nhi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"


def test_no_bos_added_for_smollm2(tok: Tokenizer) -> None:
    # tokenizer.ggml.add_bos_token is false: the chat template writes <|im_start|> itself.
    assert tok.encode("hi", add_special_tokens=True) == tok.encode("hi")


def test_digits_are_split_one_by_one(tok: Tokenizer) -> None:
    # llama.cpp's "smollm" pre-tokenizer (and SmolLM2's tokenizer.json): \p{N} alone first.
    ids = tok.encode("12345")
    assert [tok.decode([i]) for i in ids] == ["1", "2", "3", "4", "5"]


def test_chat_template_renders_the_documented_format(tok: Tokenizer) -> None:
    assert tok.has_chat_template
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    assert tok.apply_chat_template(messages) == (
        f"<|im_start|>system\n{SYSTEM}<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
    ]
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"
    )


def test_ids_agree_with_transformers_gguf_conversion(tok: Tokenizer, gguf_path: str) -> None:
    mapping = pytest.importorskip("transformers.integrations.gguf.gguf_tokenizer_mapping")
    arch, tokenizer_dict, _ = mapping.get_gguf_tokenizer(gguf_path)
    theirs, _ = mapping.convert_gguf_tokenizer(arch, tokenizer_dict)
    prompt = tok.apply_chat_template([{"role": "user", "content": TEXTS[2]}])
    for text in [*TEXTS, prompt]:
        assert tok.encode(text) == theirs.encode(text, add_special_tokens=False).ids, text


def test_from_hf_dir_reads_tokenizer_files(tok: Tokenizer, tmp_path: Path) -> None:
    tok.backend.save(str(tmp_path / "tokenizer.json"))
    config: dict[str, Any] = {
        "bos_token": {"content": "<|im_start|>", "special": True},
        "eos_token": "<|im_end|>",
        "chat_template": tok.chat_template,
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    hf = Tokenizer.from_hf_dir(tmp_path)
    assert (hf.bos_token_id, hf.eos_token_ids, hf.vocab_size) == (1, (2, 0), 49152)
    messages = [{"role": "user", "content": TEXTS[3]}]
    assert hf.apply_chat_template(messages) == tok.apply_chat_template(messages)
    for text in TEXTS:
        assert hf.encode(text) == tok.encode(text)

    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    assert Tokenizer.from_hf_dir(tmp_path).apply_chat_template(messages) == TEXTS[3]


def test_missing_chat_template_is_a_clear_error(tok: Tokenizer) -> None:
    plain = Tokenizer(tok.backend, bos_token_id=None, eos_token_ids=(2,), chat_template=None)
    assert not plain.has_chat_template
    with pytest.raises(ValueError, match="no chat template"):
        plain.apply_chat_template([{"role": "user", "content": "hi"}])


def test_template_raise_exception_surfaces(tok: Tokenizer) -> None:
    strict = Tokenizer(
        tok.backend,
        bos_token_id=1,
        eos_token_ids=(2,),
        chat_template="{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}ok",
    )
    assert strict.apply_chat_template([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(jinja2.TemplateError, match="user first"):
        strict.apply_chat_template([{"role": "assistant", "content": "x"}])
