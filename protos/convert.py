"""Conversions between node-control protos and engine types, validating every field.

A `Sampling`'s `structured` is a StructuredSpec's wire string (engine/grammar/structured.py): parsed and
checked here (ValueError, the node's INVALID_ARGUMENT), compiled later by the engine.

Prompts travel between the router and the nodes as packed token ids (`pack_token_ids`: little-endian
int32, 4 bytes each), not as repeated protobuf ints: a prompt of thousands of ids then costs one copy
at each end instead of one Python int per id, and is range-checked in one vectorized pass.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from engine.grammar.structured import StructuredSpec
from engine.sampling.sampling_params import MAX_LOGPROBS, SamplingParams
from protos import node_pb2

MAX_REQUEST_ID = 256
TOKEN_ID = np.dtype("<i4")  # a packed token id on the wire


def pack_token_ids(ids: Sequence[int]) -> bytes:
    """`ids` as a `*_packed` field carries them (little-endian int32)."""
    return np.asarray(ids, dtype=TOKEN_ID).tobytes()


def unpack_token_ids(data: bytes, vocab: int, what: str = "prompt_token_ids_packed") -> list[int]:
    """The ids of a `*_packed` field read from the network; ValueError unless it is whole int32s,
    each inside the vocabulary (0..vocab-1). Empty data gives no ids (the caller decides if it may)."""
    if len(data) % TOKEN_ID.itemsize:
        raise ValueError(f"{what} must be little-endian int32 ids; {len(data)} bytes is not a multiple of 4")
    ids = np.frombuffer(data, dtype=TOKEN_ID)
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise ValueError(f"{what} has token ids outside the vocabulary (0..{vocab - 1})")
    return ids.tolist()  # type: ignore[no-any-return]


def check_request_id(rid: str) -> str:
    if not rid or len(rid) > MAX_REQUEST_ID:
        raise ValueError(f"request_id must be 1..{MAX_REQUEST_ID} characters")
    return rid


def sampling_from_proto(s: node_pb2.Sampling, vocab: int) -> tuple[SamplingParams, int, tuple[int, ...]]:
    """(params, seed, stop token ids) from a node Sampling message; ValueError when invalid."""
    if s.logprobs < -1 or s.logprobs > MAX_LOGPROBS:
        raise ValueError(f"logprobs must be -1 (none) or 0..{MAX_LOGPROBS}, got {s.logprobs}")
    stops = tuple(s.stop_token_ids)
    if any(not 0 <= t < vocab for t in stops):
        raise ValueError("stop_token_ids outside the vocabulary")
    if s.prompt_logprobs < -1:
        raise ValueError(f"prompt_logprobs must be -1 (none) or 0..{MAX_LOGPROBS}, got {s.prompt_logprobs}")
    bias = tuple(sorted(s.logit_bias.items()))
    if any(not 0 <= t < vocab for t, _ in bias):
        raise ValueError("logit_bias token ids outside the vocabulary")
    params = SamplingParams(  # ranges: SamplingParams checks them (ValueError)
        temperature=s.temperature, top_k=s.top_k, top_p=s.top_p if s.top_p > 0 else 1.0,
        seed=s.seed, max_tokens=s.max_tokens, logprobs=None if s.logprobs < 0 else s.logprobs,
        ignore_eos=True, stop_token_ids=stops, presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty, repetition_penalty=s.repetition_penalty or 1.0, logit_bias=bias,
        n=s.n or 1, prompt_logprobs=None if s.prompt_logprobs < 0 else s.prompt_logprobs,
        resumed_tokens=s.resumed_tokens, structured=StructuredSpec.from_wire(s.structured),
    )
    return params, s.seed, stops


def sampling_to_proto(params: SamplingParams, seed: int, stop_ids: tuple[int, ...]) -> node_pb2.Sampling:
    return node_pb2.Sampling(
        temperature=params.temperature, top_p=params.top_p, top_k=params.top_k, seed=seed,
        max_tokens=params.max_tokens, logprobs=-1 if params.logprobs is None else params.logprobs,
        stop_token_ids=list(stop_ids), presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty, repetition_penalty=params.repetition_penalty,
        logit_bias=dict(params.logit_bias), n=params.n,
        prompt_logprobs=-1 if params.prompt_logprobs is None else params.prompt_logprobs,
        resumed_tokens=params.resumed_tokens, structured=params.structured.to_wire() if params.structured else "",
    )
