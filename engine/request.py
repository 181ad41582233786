"""Host-side request records: what the schedulers track per request (integers and lists)."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.sampling.sampling_params import SamplingParams


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]

    def to_json(self) -> dict:
        return {"token_id": self.token_id, "logprob": self.logprob, "rank": self.rank,
                "top": [[i, lp] for i, lp in self.top]}


@dataclass
class LogprobColumns:
    """The logprobs of a run of tokens, by column: what a step's read point hands on (a few lists per
    request and step, no object per token; the wire's shape: protos.messages.TokenLogprobs)."""

    logprob: list[float]
    rank: list[int]
    top_ids: list[list[int]]  # one row per token; empty (no rows) when no top entries were asked
    top_logprobs: list[list[float]]

    def entries(self, tokens: list[int]) -> list[TokenLogprob]:
        """One TokenLogprob per token (`tokens`: the tokens these columns are of)."""
        ids = self.top_ids or [[] for _ in tokens]
        vals = self.top_logprobs or [[] for _ in tokens]
        return [TokenLogprob(t, lp, r, list(zip(i, v, strict=True)))
                for t, lp, r, i, v in zip(tokens, self.logprob, self.rank, ids, vals, strict=True)]


@dataclass
class Request:
    request_id: str
    prompt: list[int]  # empty on a decode node, which only knows `num_prompt_tokens`
    params: SamplingParams
    seed: int
    stop_ids: tuple[int, ...]
    max_tokens: int
    num_prompt_tokens: int = -1
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # prefix-cache keys of its full prompt blocks
    num_prefilled: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (the usage's cached_tokens)
    slot: int | None = None
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    steps: int = 0
    accepted_tokens: int = 0
    # n > 1 (engine/sched/fork.py): choice `index` of the request `group` (its first choice's id; "" for
    # that first choice itself, which holds the others in `children` and forks them after its prefill)
    index: int = 0
    group: str = ""
    children: list[Request] = field(default_factory=list)
    forked: bool = False  # the children have their own copy of the prompt's KV
    prompt_logprobs: list[TokenLogprob] | None = None  # prompt_logprobs asked: one per prompt token after the first

    def __post_init__(self) -> None:
        if self.num_prompt_tokens < 0:
            self.num_prompt_tokens = len(self.prompt)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def group_id(self) -> str:
        """The id outputs carry (with `index`): the request's, for every choice."""
        return self.group or self.request_id

    @property
    def mean_accepted_per_step(self) -> float:
        return (len(self.output_ids) - 1) / self.steps if self.steps else 0.0


@dataclass
class RequestOutput:
    """What one step added to one request."""

    request_id: str  # the request's id (`Request.group_id`), whichever choice this is
    new_token_ids: list[int]
    new_logprobs: LogprobColumns | None  # when the request asked for logprobs and the step emitted tokens
    finish_reason: str | None
    index: int = 0  # the choice (n > 1)
    prompt_logprobs: list[TokenLogprob] | None = None  # with a request's first token, when asked


@dataclass
class PrefillChunk:
    """One request's slice [start, end) of its prompt for this step."""

    prompt: list[int]
    start: int
    end: int
    block_ids: list[int]
    params: SamplingParams
    seed: int

    @property
    def logprobs(self) -> int | None:
        return self.params.logprobs

    @property
    def is_last(self) -> bool:
        return self.end == len(self.prompt)
