from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]

class ActorRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ACTOR_ROLE_UNSPECIFIED: _ClassVar[ActorRole]
    ACTOR_ROLE_PREFILL: _ClassVar[ActorRole]
    ACTOR_ROLE_DECODE: _ClassVar[ActorRole]
    ACTOR_ROLE_COLOCATED: _ClassVar[ActorRole]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
ACTOR_ROLE_UNSPECIFIED: ActorRole
ACTOR_ROLE_PREFILL: ActorRole
ACTOR_ROLE_DECODE: ActorRole
ACTOR_ROLE_COLOCATED: ActorRole

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt", "token_ids", "sampling", "user")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt: str
    token_ids: TokenIds
    sampling: SamplingParams
    user: str
    def __init__(self, request_id: _Optional[str] = ..., prompt: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., user: _Optional[str] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "repetition_penalty", "frequency_penalty", "presence_penalty", "seed", "stop", "ignore_eos", "min_p", "min_tokens", "stop_token_ids", "logit_bias", "include_stop_str_in_output", "skip_special_tokens", "logprobs", "prompt_logprobs", "n", "best_of", "structured")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    BEST_OF_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    ignore_eos: bool
    min_p: float
    min_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    logit_bias: _containers.ScalarMap[int, float]
    include_stop_str_in_output: bool
    skip_special_tokens: bool
    logprobs: int
    prompt_logprobs: int
    n: int
    best_of: int
    structured: StructuredOutput
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., ignore_eos: _Optional[bool] = ..., min_p: _Optional[float] = ..., min_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., include_stop_str_in_output: _Optional[bool] = ..., skip_special_tokens: _Optional[bool] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., n: _Optional[int] = ..., best_of: _Optional[int] = ..., structured: _Optional[_Union[StructuredOutput, _Mapping]] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "choice", "grammar")
    class JsonObject(_message.Message):
        __slots__ = ()
        def __init__(self) -> None: ...
    class Choice(_message.Message):
        __slots__ = ("options",)
        OPTIONS_FIELD_NUMBER: _ClassVar[int]
        options: _containers.RepeatedScalarFieldContainer[str]
        def __init__(self, options: _Optional[_Iterable[str]] = ...) -> None: ...
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: StructuredOutput.JsonObject
    regex: str
    choice: StructuredOutput.Choice
    grammar: str
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[_Union[StructuredOutput.JsonObject, _Mapping]] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[StructuredOutput.Choice, _Mapping]] = ..., grammar: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "finish_reason", "usage", "timing", "index", "logprobs", "prompt_logprobs", "stop_str", "stop_token_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STOP_STR_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: FinishReason
    usage: Usage
    timing: Timing
    index: int
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    stop_str: str
    stop_token_id: int
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., timing: _Optional[_Union[Timing, _Mapping]] = ..., index: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., stop_str: _Optional[str] = ..., stop_token_id: _Optional[int] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_prompt_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ...) -> None: ...

class Timing(_message.Message):
    __slots__ = ("queue_s", "prefill_s", "kv_transfer_s", "decode_queue_s", "ttft_s", "e2e_s", "timeline")
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    E2E_S_FIELD_NUMBER: _ClassVar[int]
    TIMELINE_FIELD_NUMBER: _ClassVar[int]
    queue_s: float
    prefill_s: float
    kv_transfer_s: float
    decode_queue_s: float
    ttft_s: float
    e2e_s: float
    timeline: Timeline
    def __init__(self, queue_s: _Optional[float] = ..., prefill_s: _Optional[float] = ..., kv_transfer_s: _Optional[float] = ..., decode_queue_s: _Optional[float] = ..., ttft_s: _Optional[float] = ..., e2e_s: _Optional[float] = ..., timeline: _Optional[_Union[Timeline, _Mapping]] = ...) -> None: ...

class Timeline(_message.Message):
    __slots__ = ("intake_s", "router_queue_s", "dispatch_s", "prefill_queue_s", "prefill_compute_s", "sampling_s", "kv_encode_s", "kv_send_s", "kv_receive_s", "adopt_s", "first_event_s", "transit_s", "unaccounted_s", "kv_chunks", "kv_chunk_s", "kv_send_total_s", "kv_receive_total_s")
    INTAKE_S_FIELD_NUMBER: _ClassVar[int]
    ROUTER_QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    DISPATCH_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_S_FIELD_NUMBER: _ClassVar[int]
    KV_ENCODE_S_FIELD_NUMBER: _ClassVar[int]
    KV_SEND_S_FIELD_NUMBER: _ClassVar[int]
    KV_RECEIVE_S_FIELD_NUMBER: _ClassVar[int]
    ADOPT_S_FIELD_NUMBER: _ClassVar[int]
    FIRST_EVENT_S_FIELD_NUMBER: _ClassVar[int]
    TRANSIT_S_FIELD_NUMBER: _ClassVar[int]
    UNACCOUNTED_S_FIELD_NUMBER: _ClassVar[int]
    KV_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    KV_CHUNK_S_FIELD_NUMBER: _ClassVar[int]
    KV_SEND_TOTAL_S_FIELD_NUMBER: _ClassVar[int]
    KV_RECEIVE_TOTAL_S_FIELD_NUMBER: _ClassVar[int]
    intake_s: float
    router_queue_s: float
    dispatch_s: float
    prefill_queue_s: float
    prefill_compute_s: float
    sampling_s: float
    kv_encode_s: float
    kv_send_s: float
    kv_receive_s: float
    adopt_s: float
    first_event_s: float
    transit_s: float
    unaccounted_s: float
    kv_chunks: int
    kv_chunk_s: _containers.RepeatedScalarFieldContainer[float]
    kv_send_total_s: float
    kv_receive_total_s: float
    def __init__(self, intake_s: _Optional[float] = ..., router_queue_s: _Optional[float] = ..., dispatch_s: _Optional[float] = ..., prefill_queue_s: _Optional[float] = ..., prefill_compute_s: _Optional[float] = ..., sampling_s: _Optional[float] = ..., kv_encode_s: _Optional[float] = ..., kv_send_s: _Optional[float] = ..., kv_receive_s: _Optional[float] = ..., adopt_s: _Optional[float] = ..., first_event_s: _Optional[float] = ..., transit_s: _Optional[float] = ..., unaccounted_s: _Optional[float] = ..., kv_chunks: _Optional[int] = ..., kv_chunk_s: _Optional[_Iterable[float]] = ..., kv_send_total_s: _Optional[float] = ..., kv_receive_total_s: _Optional[float] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ActorStats(_message.Message):
    __slots__ = ("actor_id", "role", "kv_blocks_total", "kv_blocks_used", "queued_requests", "running_requests", "kv_tiers")
    ACTOR_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    QUEUED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    KV_TIERS_FIELD_NUMBER: _ClassVar[int]
    actor_id: str
    role: ActorRole
    kv_blocks_total: int
    kv_blocks_used: int
    queued_requests: int
    running_requests: int
    kv_tiers: _containers.RepeatedCompositeFieldContainer[KVTierStats]
    def __init__(self, actor_id: _Optional[str] = ..., role: _Optional[_Union[ActorRole, str]] = ..., kv_blocks_total: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., queued_requests: _Optional[int] = ..., running_requests: _Optional[int] = ..., kv_tiers: _Optional[_Iterable[_Union[KVTierStats, _Mapping]]] = ...) -> None: ...

class KVTierStats(_message.Message):
    __slots__ = ("kind", "enabled", "num_blocks", "num_bytes", "capacity_bytes", "hit_rate", "offload_bytes", "onboard_bytes", "onboard_bytes_per_s", "num_dropped_offloads", "num_corrupt_blocks")
    KIND_FIELD_NUMBER: _ClassVar[int]
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    OFFLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    ONBOARD_BYTES_FIELD_NUMBER: _ClassVar[int]
    ONBOARD_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    NUM_DROPPED_OFFLOADS_FIELD_NUMBER: _ClassVar[int]
    NUM_CORRUPT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    kind: str
    enabled: bool
    num_blocks: int
    num_bytes: int
    capacity_bytes: int
    hit_rate: float
    offload_bytes: int
    onboard_bytes: int
    onboard_bytes_per_s: float
    num_dropped_offloads: int
    num_corrupt_blocks: int
    def __init__(self, kind: _Optional[str] = ..., enabled: _Optional[bool] = ..., num_blocks: _Optional[int] = ..., num_bytes: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., hit_rate: _Optional[float] = ..., offload_bytes: _Optional[int] = ..., onboard_bytes: _Optional[int] = ..., onboard_bytes_per_s: _Optional[float] = ..., num_dropped_offloads: _Optional[int] = ..., num_corrupt_blocks: _Optional[int] = ...) -> None: ...

class ClusterStats(_message.Message):
    __slots__ = ("num_prefill_actors", "num_decode_actors", "num_colocated_actors", "kv_blocks_total", "kv_blocks_used", "queued_requests", "running_requests")
    NUM_PREFILL_ACTORS_FIELD_NUMBER: _ClassVar[int]
    NUM_DECODE_ACTORS_FIELD_NUMBER: _ClassVar[int]
    NUM_COLOCATED_ACTORS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    QUEUED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    num_prefill_actors: int
    num_decode_actors: int
    num_colocated_actors: int
    kv_blocks_total: int
    kv_blocks_used: int
    queued_requests: int
    running_requests: int
    def __init__(self, num_prefill_actors: _Optional[int] = ..., num_decode_actors: _Optional[int] = ..., num_colocated_actors: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., queued_requests: _Optional[int] = ..., running_requests: _Optional[int] = ...) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("actors", "totals", "router_in_flight_requests")
    ACTORS_FIELD_NUMBER: _ClassVar[int]
    TOTALS_FIELD_NUMBER: _ClassVar[int]
    ROUTER_IN_FLIGHT_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    actors: _containers.RepeatedCompositeFieldContainer[ActorStats]
    totals: ClusterStats
    router_in_flight_requests: int
    def __init__(self, actors: _Optional[_Iterable[_Union[ActorStats, _Mapping]]] = ..., totals: _Optional[_Union[ClusterStats, _Mapping]] = ..., router_in_flight_requests: _Optional[int] = ...) -> None: ...
