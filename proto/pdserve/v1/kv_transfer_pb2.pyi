from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVLayoutDescription(_message.Message):
    __slots__ = ("model_fingerprint", "num_layers", "num_kv_heads", "block_size", "head_dim", "dtype", "codec", "cache_dtype")
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    model_fingerprint: str
    num_layers: int
    num_kv_heads: int
    block_size: int
    head_dim: int
    dtype: str
    codec: str
    cache_dtype: str
    def __init__(self, model_fingerprint: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., block_size: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ..., codec: _Optional[str] = ..., cache_dtype: _Optional[str] = ...) -> None: ...

class HandshakeRequest(_message.Message):
    __slots__ = ("layout",)
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    layout: KVLayoutDescription
    def __init__(self, layout: _Optional[_Union[KVLayoutDescription, _Mapping]] = ...) -> None: ...

class HandshakeResponse(_message.Message):
    __slots__ = ("layout",)
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    layout: KVLayoutDescription
    def __init__(self, layout: _Optional[_Union[KVLayoutDescription, _Mapping]] = ...) -> None: ...

class ChunkHeader(_message.Message):
    __slots__ = ("version", "request_id", "transfer_id", "model_fingerprint", "num_layers", "layer_start", "layer_end", "num_blocks", "block_start", "block_end", "block_size", "num_kv_heads", "head_dim", "dtype", "codec", "scale_layout", "chunk_index", "num_chunks", "payload_len", "checksum", "deadline_ms", "num_tokens", "first_token_id", "handoff", "kv_head_start")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_START_FIELD_NUMBER: _ClassVar[int]
    BLOCK_END_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    SCALE_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    CHUNK_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_LEN_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_FIELD_NUMBER: _ClassVar[int]
    KV_HEAD_START_FIELD_NUMBER: _ClassVar[int]
    version: int
    request_id: str
    transfer_id: str
    model_fingerprint: str
    num_layers: int
    layer_start: int
    layer_end: int
    num_blocks: int
    block_start: int
    block_end: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    codec: str
    scale_layout: str
    chunk_index: int
    num_chunks: int
    payload_len: int
    checksum: int
    deadline_ms: int
    num_tokens: int
    first_token_id: int
    handoff: bytes
    kv_head_start: int
    def __init__(self, version: _Optional[int] = ..., request_id: _Optional[str] = ..., transfer_id: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., num_layers: _Optional[int] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., num_blocks: _Optional[int] = ..., block_start: _Optional[int] = ..., block_end: _Optional[int] = ..., block_size: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ..., codec: _Optional[str] = ..., scale_layout: _Optional[str] = ..., chunk_index: _Optional[int] = ..., num_chunks: _Optional[int] = ..., payload_len: _Optional[int] = ..., checksum: _Optional[int] = ..., deadline_ms: _Optional[int] = ..., num_tokens: _Optional[int] = ..., first_token_id: _Optional[int] = ..., handoff: _Optional[bytes] = ..., kv_head_start: _Optional[int] = ...) -> None: ...

class PushKVRequest(_message.Message):
    __slots__ = ("header", "payload")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    header: ChunkHeader
    payload: bytes
    def __init__(self, header: _Optional[_Union[ChunkHeader, _Mapping]] = ..., payload: _Optional[bytes] = ...) -> None: ...

class PushKVResponse(_message.Message):
    __slots__ = ("nbytes",)
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    nbytes: int
    def __init__(self, nbytes: _Optional[int] = ...) -> None: ...
