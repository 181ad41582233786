from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Sampling(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed", "max_tokens", "logprobs", "stop_token_ids", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "n", "prompt_logprobs", "resumed_tokens", "structured")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RESUMED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    max_tokens: int
    logprobs: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    n: int
    prompt_logprobs: int
    resumed_tokens: int
    structured: str
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., max_tokens: _Optional[int] = ..., logprobs: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., n: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., resumed_tokens: _Optional[int] = ..., structured: _Optional[str] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("request_id", "prompt_len", "sampling", "prompt_token_ids_packed")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LEN_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_PACKED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_len: int
    sampling: Sampling
    prompt_token_ids_packed: bytes
    def __init__(self, request_id: _Optional[str] = ..., prompt_len: _Optional[int] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ..., prompt_token_ids_packed: _Optional[bytes] = ...) -> None: ...

class ReserveReply(_message.Message):
    __slots__ = ("admitted", "reason", "descriptor_msgpack")
    ADMITTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTOR_MSGPACK_FIELD_NUMBER: _ClassVar[int]
    admitted: bool
    reason: str
    descriptor_msgpack: bytes
    def __init__(self, admitted: _Optional[bool] = ..., reason: _Optional[str] = ..., descriptor_msgpack: _Optional[bytes] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids_packed", "sampling", "descriptor_msgpack", "decode_address")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_PACKED_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTOR_MSGPACK_FIELD_NUMBER: _ClassVar[int]
    DECODE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids_packed: bytes
    sampling: Sampling
    descriptor_msgpack: bytes
    decode_address: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids_packed: _Optional[bytes] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ..., descriptor_msgpack: _Optional[bytes] = ..., decode_address: _Optional[str] = ...) -> None: ...

class PrefillStreamRequest(_message.Message):
    __slots__ = ("prefill", "cancel")
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    prefill: PrefillRequest
    cancel: AbortRequest
    def __init__(self, prefill: _Optional[_Union[PrefillRequest, _Mapping]] = ..., cancel: _Optional[_Union[AbortRequest, _Mapping]] = ...) -> None: ...

class PrefillStreamReply(_message.Message):
    __slots__ = ("request_id", "code", "details", "first_token_msgpack")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_MSGPACK_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    code: int
    details: str
    first_token_msgpack: bytes
    def __init__(self, request_id: _Optional[str] = ..., code: _Optional[int] = ..., details: _Optional[str] = ..., first_token_msgpack: _Optional[bytes] = ...) -> None: ...

class AttachRequest(_message.Message):
    __slots__ = ("request_id", "descriptor_msgpack", "decode_address")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTOR_MSGPACK_FIELD_NUMBER: _ClassVar[int]
    DECODE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    descriptor_msgpack: bytes
    decode_address: str
    def __init__(self, request_id: _Optional[str] = ..., descriptor_msgpack: _Optional[bytes] = ..., decode_address: _Optional[str] = ...) -> None: ...

class Payload(_message.Message):
    __slots__ = ("msgpack",)
    MSGPACK_FIELD_NUMBER: _ClassVar[int]
    msgpack: bytes
    def __init__(self, msgpack: _Optional[bytes] = ...) -> None: ...

class Ack(_message.Message):
    __slots__ = ("ok", "reason")
    OK_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    reason: str
    def __init__(self, ok: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id", "reason")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    reason: str
    def __init__(self, request_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class OutputsRequest(_message.Message):
    __slots__ = ("subscriber",)
    SUBSCRIBER_FIELD_NUMBER: _ClassVar[int]
    subscriber: str
    def __init__(self, subscriber: _Optional[str] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PrimeRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class NodeStatus(_message.Message):
    __slots__ = ("node_id", "kind", "healthy", "free_blocks", "total_blocks", "running", "queued_tokens", "num_speculative_tokens", "prefill_tokens", "prefill_seconds", "kv_bytes", "kv_seconds", "draft_tokens", "accepted_per_pos", "prefix_requests", "prefix_hit_requests", "prefix_query_tokens", "prefix_hit_tokens", "cached_blocks", "evicted_blocks", "kv_skipped_bytes", "shared_blocks", "takes_attach", "kv_seconds_buckets", "cold_shape_steps", "graph_shapes_pending", "spec_decode_steps")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    QUEUED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PER_POS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_QUERY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    EVICTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_SKIPPED_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHARED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TAKES_ATTACH_FIELD_NUMBER: _ClassVar[int]
    KV_SECONDS_BUCKETS_FIELD_NUMBER: _ClassVar[int]
    COLD_SHAPE_STEPS_FIELD_NUMBER: _ClassVar[int]
    GRAPH_SHAPES_PENDING_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_STEPS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    kind: str
    healthy: bool
    free_blocks: int
    total_blocks: int
    running: int
    queued_tokens: int
    num_speculative_tokens: int
    prefill_tokens: int
    prefill_seconds: float
    kv_bytes: int
    kv_seconds: float
    draft_tokens: _containers.RepeatedScalarFieldContainer[int]
    accepted_per_pos: _containers.RepeatedScalarFieldContainer[int]
    prefix_requests: int
    prefix_hit_requests: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    cached_blocks: int
    evicted_blocks: int
    kv_skipped_bytes: int
    shared_blocks: int
    takes_attach: bool
    kv_seconds_buckets: _containers.RepeatedScalarFieldContainer[int]
    cold_shape_steps: int
    graph_shapes_pending: int
    spec_decode_steps: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, node_id: _Optional[str] = ..., kind: _Optional[str] = ..., healthy: _Optional[bool] = ..., free_blocks: _Optional[int] = ..., total_blocks: _Optional[int] = ..., running: _Optional[int] = ..., queued_tokens: _Optional[int] = ..., num_speculative_tokens: _Optional[int] = ..., prefill_tokens: _Optional[int] = ..., prefill_seconds: _Optional[float] = ..., kv_bytes: _Optional[int] = ..., kv_seconds: _Optional[float] = ..., draft_tokens: _Optional[_Iterable[int]] = ..., accepted_per_pos: _Optional[_Iterable[int]] = ..., prefix_requests: _Optional[int] = ..., prefix_hit_requests: _Optional[int] = ..., prefix_query_tokens: _Optional[int] = ..., prefix_hit_tokens: _Optional[int] = ..., cached_blocks: _Optional[int] = ..., evicted_blocks: _Optional[int] = ..., kv_skipped_bytes: _Optional[int] = ..., shared_blocks: _Optional[int] = ..., takes_attach: _Optional[bool] = ..., kv_seconds_buckets: _Optional[_Iterable[int]] = ..., cold_shape_steps: _Optional[int] = ..., graph_shapes_pending: _Optional[int] = ..., spec_decode_steps: _Optional[_Iterable[int]] = ...) -> None: ...
