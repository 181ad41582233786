"""The prompt's side of an OpenAI response: completions' `echo` (the prompt's text before each
choice's, and with `logprobs` the prompt tokens' entries first, the first token's null, as
OpenAI's legacy completions give them) and vLLM's `prompt_logprobs` ([null, {"<id>": {"logprob",
"rank", "decoded_token"}}, ...]: the prompt token's own entry and the top-N).

Receives the first GenerateResponse of a request, which carries the prompt's token ids and, when
asked, their logprobs (computed on the prefill node, or by the colocated engine); hands
router/openai_protocol.py's `Format` plain lists. Holds no request state besides that.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from protos import pdserve_pb2 as pb

Entry = tuple[int, float | None, list[tuple[int, float]] | None]  # (token id, logprob, top) per token


@dataclass
class PromptInfo:
    token_ids: list[int]
    logprobs: list[pb.TokenLogprob]  # one per prompt token after the first (when asked)
    sent: str | None = None  # the prompt as the client sent it (None: token ids)
    decode: Callable[[list[int]], str] = field(default=lambda ids: "", repr=False)

    @classmethod
    def of(cls, msg: pb.GenerateResponse, text: str | None, decode: Callable[[list[int]], str]) -> PromptInfo:
        """From a request's first message; `text` is the prompt as the client sent it (None: ids)."""
        return cls(list(msg.prompt_token_ids), list(msg.prompt_logprobs), text, decode)

    @cached_property
    def text(self) -> str:
        """What `echo` puts before each choice's text. Decoded from the ids only when read: the first
        chunk is built before its token goes out, and most requests never echo."""
        return self.decode(self.token_ids) if self.sent is None else self.sent

    def echo_entries(self, num_top: int) -> list[Entry]:
        """Completions' logprob entries for the prompt: the first token has none."""
        if not self.token_ids:
            return []
        out: list[Entry] = [(self.token_ids[0], None, None)]
        for lp in self.logprobs:
            out.append((lp.token_id, lp.logprob, list(zip(lp.top_ids[:num_top], lp.top_logprobs[:num_top],
                                                          strict=True))))
        return out

    def vllm_logprobs(self, num_top: int, token: Callable[[int], str]) -> list[dict[str, Any] | None]:
        """vLLM's `prompt_logprobs`: None for the first token, then the token's own entry and the top-N."""
        out: list[dict[str, Any] | None] = [None] if self.token_ids else []
        for lp in self.logprobs:
            entry = {str(lp.token_id): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": token(lp.token_id)}}
            for r, (i, v) in enumerate(zip(lp.top_ids[:num_top], lp.top_logprobs[:num_top], strict=True)):
                entry.setdefault(str(i), {"logprob": v, "rank": r + 1, "decoded_token": token(i)})
            out.append(entry)
        return out
