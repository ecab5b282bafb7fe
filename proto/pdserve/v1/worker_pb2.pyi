from proto.pdserve.v1 import generation_pb2 as _generation_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PREFILL_STATUS_UNSPECIFIED: _ClassVar[PrefillStatus]
    PREFILL_STATUS_SENT: _ClassVar[PrefillStatus]
    PREFILL_STATUS_FINISHED: _ClassVar[PrefillStatus]
    PREFILL_STATUS_FAILED: _ClassVar[PrefillStatus]
    PREFILL_STATUS_ABORTED: _ClassVar[PrefillStatus]

class TransferSide(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSFER_SIDE_UNSPECIFIED: _ClassVar[TransferSide]
    TRANSFER_SIDE_SENDER: _ClassVar[TransferSide]
    TRANSFER_SIDE_RECEIVER: _ClassVar[TransferSide]
    TRANSFER_SIDE_TRANSPORT: _ClassVar[TransferSide]
PREFILL_STATUS_UNSPECIFIED: PrefillStatus
PREFILL_STATUS_SENT: PrefillStatus
PREFILL_STATUS_FINISHED: PrefillStatus
PREFILL_STATUS_FAILED: PrefillStatus
PREFILL_STATUS_ABORTED: PrefillStatus
TRANSFER_SIDE_UNSPECIFIED: TransferSide
TRANSFER_SIDE_SENDER: TransferSide
TRANSFER_SIDE_RECEIVER: TransferSide
TRANSFER_SIDE_TRANSPORT: TransferSide

class DecodeRequest(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: DecodeJob
    def __init__(self, job: _Optional[_Union[DecodeJob, _Mapping]] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[DecodeEvent]
    def __init__(self, events: _Optional[_Iterable[_Union[DecodeEvent, _Mapping]]] = ...) -> None: ...

class PrefillJob(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "params", "kv_endpoint", "transfer_id", "transfer_deadline_s", "skip_blocks")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    KV_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    SKIP_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: _generation_pb2.SamplingParams
    kv_endpoint: str
    transfer_id: str
    transfer_deadline_s: float
    skip_blocks: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[_generation_pb2.SamplingParams, _Mapping]] = ..., kv_endpoint: _Optional[str] = ..., transfer_id: _Optional[str] = ..., transfer_deadline_s: _Optional[float] = ..., skip_blocks: _Optional[int] = ...) -> None: ...

class PrefillResult(_message.Message):
    __slots__ = ("request_id", "transfer_id", "status", "num_prompt_tokens", "num_cached_tokens", "error", "failed_side", "retryable", "queue_s", "prefill_s", "transfer_s", "kv_bytes", "wire_bytes", "first_tokens", "prompt_logprobs", "stages", "num_skipped_blocks")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    FAILED_SIDE_FIELD_NUMBER: _ClassVar[int]
    RETRYABLE_FIELD_NUMBER: _ClassVar[int]
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    WIRE_BYTES_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_SKIPPED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    transfer_id: str
    status: PrefillStatus
    num_prompt_tokens: int
    num_cached_tokens: int
    error: str
    failed_side: TransferSide
    retryable: bool
    queue_s: float
    prefill_s: float
    transfer_s: float
    kv_bytes: int
    wire_bytes: int
    first_tokens: _containers.RepeatedCompositeFieldContainer[DecodeEvent]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_generation_pb2.TokenLogprob]
    stages: ActorStages
    num_skipped_blocks: int
    def __init__(self, request_id: _Optional[str] = ..., transfer_id: _Optional[str] = ..., status: _Optional[_Union[PrefillStatus, str]] = ..., num_prompt_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., error: _Optional[str] = ..., failed_side: _Optional[_Union[TransferSide, str]] = ..., retryable: _Optional[bool] = ..., queue_s: _Optional[float] = ..., prefill_s: _Optional[float] = ..., transfer_s: _Optional[float] = ..., kv_bytes: _Optional[int] = ..., wire_bytes: _Optional[int] = ..., first_tokens: _Optional[_Iterable[_Union[DecodeEvent, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_generation_pb2.TokenLogprob, _Mapping]]] = ..., stages: _Optional[_Union[ActorStages, _Mapping]] = ..., num_skipped_blocks: _Optional[int] = ...) -> None: ...

class ActorStages(_message.Message):
    __slots__ = ("queue_s", "compute_s", "sampling_s", "kv_encode_s", "kv_send_s", "kv_receive_s", "adopt_s", "first_event_s", "kv_chunks", "kv_chunk_s", "kv_send_total_s", "kv_receive_total_s")
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_S_FIELD_NUMBER: _ClassVar[int]
    KV_ENCODE_S_FIELD_NUMBER: _ClassVar[int]
    KV_SEND_S_FIELD_NUMBER: _ClassVar[int]
    KV_RECEIVE_S_FIELD_NUMBER: _ClassVar[int]
    ADOPT_S_FIELD_NUMBER: _ClassVar[int]
    FIRST_EVENT_S_FIELD_NUMBER: _ClassVar[int]
    KV_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    KV_CHUNK_S_FIELD_NUMBER: _ClassVar[int]
    KV_SEND_TOTAL_S_FIELD_NUMBER: _ClassVar[int]
    KV_RECEIVE_TOTAL_S_FIELD_NUMBER: _ClassVar[int]
    queue_s: float
    compute_s: float
    sampling_s: float
    kv_encode_s: float
    kv_send_s: float
    kv_receive_s: float
    adopt_s: float
    first_event_s: float
    kv_chunks: int
    kv_chunk_s: _containers.RepeatedScalarFieldContainer[float]
    kv_send_total_s: float
    kv_receive_total_s: float
    def __init__(self, queue_s: _Optional[float] = ..., compute_s: _Optional[float] = ..., sampling_s: _Optional[float] = ..., kv_encode_s: _Optional[float] = ..., kv_send_s: _Optional[float] = ..., kv_receive_s: _Optional[float] = ..., adopt_s: _Optional[float] = ..., first_event_s: _Optional[float] = ..., kv_chunks: _Optional[int] = ..., kv_chunk_s: _Optional[_Iterable[float]] = ..., kv_send_total_s: _Optional[float] = ..., kv_receive_total_s: _Optional[float] = ...) -> None: ...

class Handoff(_message.Message):
    __slots__ = ("first_tokens", "num_skipped_blocks")
    FIRST_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SKIPPED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    first_tokens: _containers.RepeatedCompositeFieldContainer[DecodeEvent]
    num_skipped_blocks: int
    def __init__(self, first_tokens: _Optional[_Iterable[_Union[DecodeEvent, _Mapping]]] = ..., num_skipped_blocks: _Optional[int] = ...) -> None: ...

class DecodeJob(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "params", "transfer_id", "kv_timeout_s", "resume_output_ids", "resume_text_chars", "num_cached_blocks", "prompt_kv_lossy")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    KV_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    RESUME_OUTPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    RESUME_TEXT_CHARS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_KV_LOSSY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: _generation_pb2.SamplingParams
    transfer_id: str
    kv_timeout_s: float
    resume_output_ids: _containers.RepeatedScalarFieldContainer[int]
    resume_text_chars: int
    num_cached_blocks: int
    prompt_kv_lossy: bool
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[_generation_pb2.SamplingParams, _Mapping]] = ..., transfer_id: _Optional[str] = ..., kv_timeout_s: _Optional[float] = ..., resume_output_ids: _Optional[_Iterable[int]] = ..., resume_text_chars: _Optional[int] = ..., num_cached_blocks: _Optional[int] = ..., prompt_kv_lossy: _Optional[bool] = ...) -> None: ...

class PrefixQuery(_message.Message):
    __slots__ = ("block_hashes",)
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class PrefixHits(_message.Message):
    __slots__ = ("num_cached_blocks",)
    NUM_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    num_cached_blocks: int
    def __init__(self, num_cached_blocks: _Optional[int] = ...) -> None: ...

class DecodeError(_message.Message):
    __slots__ = ("code", "message", "retryable")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RETRYABLE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    retryable: bool
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., retryable: _Optional[bool] = ...) -> None: ...

class DecodeEvent(_message.Message):
    __slots__ = ("token_ids", "text", "finish_reason", "error", "decode_queue_s", "num_cached_tokens", "index", "logprobs", "stop_str", "stop_token_id", "prompt_logprobs", "stages", "num_spec_proposed_tokens", "num_spec_accepted_tokens")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    DECODE_QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STOP_STR_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_SPEC_PROPOSED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SPEC_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: _generation_pb2.FinishReason
    error: DecodeError
    decode_queue_s: float
    num_cached_tokens: int
    index: int
    logprobs: _containers.RepeatedCompositeFieldContainer[_generation_pb2.TokenLogprob]
    stop_str: str
    stop_token_id: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_generation_pb2.TokenLogprob]
    stages: ActorStages
    num_spec_proposed_tokens: int
    num_spec_accepted_tokens: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[_generation_pb2.FinishReason, str]] = ..., error: _Optional[_Union[DecodeError, _Mapping]] = ..., decode_queue_s: _Optional[float] = ..., num_cached_tokens: _Optional[int] = ..., index: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[_generation_pb2.TokenLogprob, _Mapping]]] = ..., stop_str: _Optional[str] = ..., stop_token_id: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_generation_pb2.TokenLogprob, _Mapping]]] = ..., stages: _Optional[_Union[ActorStages, _Mapping]] = ..., num_spec_proposed_tokens: _Optional[int] = ..., num_spec_accepted_tokens: _Optional[int] = ...) -> None: ...
