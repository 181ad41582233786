"""Tokenizer: text <-> token ids, and chat messages -> prompt text.

Receives a Hugging Face checkpoint directory (`tokenizer.json`, `tokenizer_config.json`,
optional `chat_template.jinja` / `generation_config.json`) or a GGUF file's tokenizer
metadata (byte-level BPE, `tokenizer.ggml.model == "gpt2"`). Hands the router and the
engine token ids, text, the chat-templated prompt and the special ids (BOS, the EOS set).
Never touches tensors, devices or the network.

Chat templates are rendered with jinja2 the way transformers does (sandboxed environment,
trim_blocks + lstrip_blocks, `raise_exception`, `tojson`, `strftime_now`), so prompts match
what the model was trained on. Templates emit BOS themselves where they need it: encode a
rendered prompt with `add_special_tokens=False` (the default). jinja2 is imported where a template
is compiled: a node never renders one, and a router compiles its template before it serves
(`prepare_chat_template`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from engine.model.gguf_meta import gguf_eos_token_ids, read_field

if TYPE_CHECKING:
    import jinja2

# llama.cpp token types (tokenizer.ggml.token_type)
CONTROL_TOKEN = 3
USER_DEFINED_TOKEN = 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class PreTokenizerSpec:
    """How a byte-level BPE vocabulary splits text before merging (llama.cpp's `pre`)."""

    split: str | None = None  # regex before ByteLevel; None: ByteLevel's own GPT-2 regex
    digits: bool = False  # every digit alone first (llama.cpp's "\\p{N}" expression)
    ignore_merges: bool = False  # whole words found in the vocab skip the merges (llama 3)


# `tokenizer.ggml.pre` -> split rules, as in llama.cpp's llama-vocab.cpp. "smollm" (like
# starcoder) splits digits one by one, then applies the GPT-2 regex; this also matches
# SmolLM2's own tokenizer.json (Digits(individual_digits) + ByteLevel).
GGUF_PRE_TOKENIZERS = {
    "default": PreTokenizerSpec(),
    "gpt-2": PreTokenizerSpec(),
    "gpt2": PreTokenizerSpec(),
    "smollm": PreTokenizerSpec(digits=True),
    "starcoder": PreTokenizerSpec(digits=True),
    "refact": PreTokenizerSpec(digits=True),
    "codeshell": PreTokenizerSpec(digits=True),
    "llama-bpe": PreTokenizerSpec(split=_LLAMA3_SPLIT, ignore_merges=True),
    "llama3": PreTokenizerSpec(split=_LLAMA3_SPLIT, ignore_merges=True),
    "qwen2": PreTokenizerSpec(split=_QWEN2_SPLIT),
    "deepseek-r1-qwen": PreTokenizerSpec(split=_QWEN2_SPLIT),
}


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the chat template and the special ids."""

    def __init__(
        self,
        backend: HFTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: tuple[int, ...],
        chat_template: str | None = None,
    ) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids
        self.chat_template = chat_template
        self._compiled: jinja2.Template | None = None

    # -- constructors ------------------------------------------------------------

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """From `tokenizer.json` (+ `tokenizer_config.json`, `generation_config.json`)."""
        root = Path(path)
        backend = HFTokenizer.from_file(str(root / "tokenizer.json"))
        config = _read_json(root / "tokenizer_config.json")
        bos = _special_token_id(backend, config.get("bos_token"))
        eos = _special_token_id(backend, config.get("eos_token"))
        generation_eos = _as_id_list(
            _read_json(root / "generation_config.json").get("eos_token_id")
        )
        eos_ids = tuple(dict.fromkeys(([] if eos is None else [eos]) + generation_eos))
        return cls(
            backend,
            bos_token_id=bos,
            eos_token_ids=eos_ids,
            chat_template=_read_hf_chat_template(root, config),
        )

    @classmethod
    def from_gguf_metadata(cls, reader: Any) -> Tokenizer:
        """From a GGUF file's `tokenizer.ggml.*` metadata (engine/model/gguf_file.py; byte-level BPE only)."""
        kind = read_field(reader, "tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(
                f"GGUF tokenizer model {kind!r} is not supported yet; pdserve reads byte-level BPE ('gpt2')"
            )
        pre = read_field(reader, "tokenizer.ggml.pre", "default")
        if pre not in GGUF_PRE_TOKENIZERS:
            raise ValueError(
                f"GGUF pre-tokenizer {pre!r} is not supported yet; known: {', '.join(GGUF_PRE_TOKENIZERS)}"
            )
        bos = read_field(reader, "tokenizer.ggml.bos_token_id")
        add_bos = bool(read_field(reader, "tokenizer.ggml.add_bos_token", False))
        backend = byte_level_bpe(
            tokens=read_field(reader, "tokenizer.ggml.tokens"),
            merges=read_field(reader, "tokenizer.ggml.merges"),
            token_types=read_field(reader, "tokenizer.ggml.token_type") or [],
            spec=GGUF_PRE_TOKENIZERS[pre],
            bos_token_id=bos if add_bos else None,
        )
        return cls(
            backend,
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=gguf_eos_token_ids(reader),
            chat_template=read_field(reader, "tokenizer.chat_template"),
        )

    # -- ids <-> text ------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`. An unfinished UTF-8 sequence at the end decodes to U+FFFD, so an
        incremental detokenizer holds back text ending in it until the next token."""
        return str(self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    # -- chat --------------------------------------------------------------------

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """Render `messages` ([{"role": ..., "content": ...}], with `tool_calls` / `tool_call_id`
        where a conversation has them) and `tools` (OpenAI's tool objects, for templates with a
        tools section) into the prompt text."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template; send a plain prompt instead")
        return self.prepare_chat_template().render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            **self._template_tokens(),
        )

    def prepare_chat_template(self) -> jinja2.Template:
        """The chat template compiled (once); a router calls it before serving, so its first chat
        request renders at once. Only with a chat template (`has_chat_template`)."""
        if self._compiled is None:
            assert self.chat_template is not None
            self._compiled = compile_chat_template(self.chat_template)
        return self._compiled

    def _template_tokens(self) -> dict[str, str]:
        """`bos_token` / `eos_token` strings, which many templates print."""
        eos = self.eos_token_ids[0] if self.eos_token_ids else None
        named = {"bos_token": self.bos_token_id, "eos_token": eos}
        tokens = {k: None if i is None else self.id_to_token(i) for k, i in named.items()}
        return {k: t for k, t in tokens.items() if t is not None}


def compile_chat_template(template: str) -> jinja2.Template:
    """Compile a chat template in the environment transformers renders them in."""
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


# -- building a byte-level BPE from a vocabulary ------------------------------------


def byte_level_bpe(
    tokens: list[str],
    merges: list[str],
    token_types: list[int],
    spec: PreTokenizerSpec,
    bos_token_id: int | None = None,
) -> HFTokenizer:
    """A GPT-2-style byte-level BPE tokenizer from llama.cpp's vocabulary arrays.

    Tokens are spelled in GPT-2's byte alphabet (as in the GGUF); control tokens become
    special added tokens and user-defined ones plain added tokens, so both stay whole.
    `bos_token_id` set: `encode(add_special_tokens=True)` prepends it.
    """
    vocab = {token: i for i, token in enumerate(tokens)}
    pairs = [_merge_pair(m) for m in merges]
    model = models.BPE(vocab=vocab, merges=pairs, ignore_merges=spec.ignore_merges)
    backend = HFTokenizer(model)
    backend.pre_tokenizer = _pre_tokenizer(spec)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = _post_processor(tokens, bos_token_id)
    _add_special_tokens(backend, tokens, token_types)
    return backend


def _merge_pair(merge: str) -> tuple[str, str]:
    """ "Ġ t" -> ("Ġ", "t"): byte-level tokens never contain a space (it is spelled Ġ)."""
    left, right = merge.split(" ", 1)
    return left, right


def _pre_tokenizer(spec: PreTokenizerSpec) -> pre_tokenizers.PreTokenizer:
    steps: list[pre_tokenizers.PreTokenizer] = []
    if spec.digits:
        steps.append(pre_tokenizers.Digits(individual_digits=True))
    if spec.split is not None:
        steps.append(pre_tokenizers.Split(Regex(spec.split), behavior="isolated"))
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=spec.split is None))
    return pre_tokenizers.Sequence(steps)


def _post_processor(tokens: list[str], bos_token_id: int | None) -> processors.PostProcessor:
    if bos_token_id is None:
        return processors.ByteLevel(trim_offsets=False)
    bos = tokens[bos_token_id]
    return processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_token_id)]
    )


def _add_special_tokens(backend: HFTokenizer, tokens: list[str], token_types: list[int]) -> None:
    control = [t for t, kind in zip(tokens, token_types, strict=False) if kind == CONTROL_TOKEN]
    user = [t for t, kind in zip(tokens, token_types, strict=False) if kind == USER_DEFINED_TOKEN]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])


# -- reading HF tokenizer files -------------------------------------------------------


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _read_hf_chat_template(root: Path, config: dict[str, Any]) -> str | None:
    """`chat_template.jinja` (newer), `chat_template.json`, or tokenizer_config's field,
    which older files store as a list of {"name", "template"} (we take "default")."""
    jinja_file = root / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    template = _read_json(root / "chat_template.json").get("chat_template") or config.get(
        "chat_template"
    )
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _special_token_id(backend: HFTokenizer, token: Any) -> int | None:
    """tokenizer_config.json names special tokens as a string or {"content": ...}."""
    if isinstance(token, dict):
        token = token.get("content")
    return None if not isinstance(token, str) else backend.token_to_id(token)


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]
