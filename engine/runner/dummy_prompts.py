"""Dummy prompts for capturing prefill graphs off the request path (engine/runner/warmup.py and
`PrefillGraphs.capture_deferred`).

A dummy chunk's prompt is token id 0 and it has no block ids, so the inputs pad its block table
with the trash block (engine/cache/kv_cache.py): the step it makes writes KV nowhere that matters and
changes no request's state. `chunks_for_key` finds chunks whose step has a given graph key.
"""

from __future__ import annotations

from engine.request import PrefillChunk
from engine.runner.prefill_step import PrefillKey
from engine.sampling.sampling_params import SamplingParams


def dummy_chunks(tokens: int, rows: int, params: SamplingParams, logprobs: int | None) -> list[PrefillChunk]:
    """`rows` whole prompts of `tokens` tokens in all (token id 0), every block the trash block
    (no block ids: the inputs pad a row's table with it), sampled with `params` and `logprobs`."""
    p = SamplingParams(temperature=params.temperature, top_k=params.top_k, max_tokens=1, logprobs=logprobs)
    share = [tokens // rows + (1 if r < tokens % rows else 0) for r in range(rows)]
    return [PrefillChunk([0] * n, 0, n, [], p, 0) for n in share]


def chunks_for_key(key: PrefillKey, token_buckets: list[int], row_buckets: list[int],
                   max_model_len: int) -> list[PrefillChunk] | None:
    """Dummy chunks whose step has `key`'s buckets (tokens, rows, longest chunk), sampling flags,
    logprobs and freshness; None when no such step fits `max_model_len`. The first chunk is the
    longest, the others share the rest of the fewest tokens the bucket allows."""
    params = SamplingParams(temperature=0.0 if key.all_greedy else 1.0, top_k=20 if key.needs_filter else 0,
                            max_tokens=1, logprobs=None if key.top_logprobs is None else 0)
    past = 0 if key.fresh else 1  # a token before each chunk: its key is not fresh
    tokens = _counts_in_bucket(key.tokens, token_buckets)
    for rows in _counts_in_bucket(key.rows, row_buckets):
        for longest in _counts_in_bucket(key.max_q, token_buckets):
            low = max(tokens[-1], longest + rows - 1)  # the others have >= 1 token, <= longest each
            if longest + past > max_model_len or low > min(tokens[0], longest * rows):
                continue
            lengths = _split(low, rows, longest)
            return [PrefillChunk([0] * (past + n), past, past + n, [], params, 0)
                    for n in lengths]
    return None


def _counts_in_bucket(bucket: int, buckets: list[int]) -> list[int]:
    """The counts whose bucket is `bucket`, largest first (the one before it + 1 .. bucket)."""
    i = buckets.index(bucket)
    low = buckets[i - 1] + 1 if i > 0 else 1
    return list(range(bucket, low - 1, -1))


def _split(total: int, rows: int, longest: int) -> list[int]:
    """`rows` lengths summing to `total`: the first `longest`, the others sharing the rest (each
    1..longest: the caller checked that they can)."""
    rest, others = total - longest, rows - 1
    return [longest, *[rest // others + (1 if i < rest % others else 0) for i in range(others)]] if others else [longest]

