from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVCacheEventKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_CACHE_EVENT_KIND_UNSPECIFIED: _ClassVar[KVCacheEventKind]
    KV_CACHE_EVENT_KIND_STORED: _ClassVar[KVCacheEventKind]
    KV_CACHE_EVENT_KIND_REMOVED: _ClassVar[KVCacheEventKind]

class KVCacheTier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_CACHE_TIER_UNSPECIFIED: _ClassVar[KVCacheTier]
    KV_CACHE_TIER_HOST: _ClassVar[KVCacheTier]
    KV_CACHE_TIER_DISK: _ClassVar[KVCacheTier]
KV_CACHE_EVENT_KIND_UNSPECIFIED: KVCacheEventKind
KV_CACHE_EVENT_KIND_STORED: KVCacheEventKind
KV_CACHE_EVENT_KIND_REMOVED: KVCacheEventKind
KV_CACHE_TIER_UNSPECIFIED: KVCacheTier
KV_CACHE_TIER_HOST: KVCacheTier
KV_CACHE_TIER_DISK: KVCacheTier

class KVCacheEvent(_message.Message):
    __slots__ = ("kind", "block_hashes", "tier")
    KIND_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    kind: KVCacheEventKind
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    tier: KVCacheTier
    def __init__(self, kind: _Optional[_Union[KVCacheEventKind, str]] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., tier: _Optional[_Union[KVCacheTier, str]] = ...) -> None: ...

class KVCacheEventBatch(_message.Message):
    __slots__ = ("seq", "events")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    seq: int
    events: _containers.RepeatedCompositeFieldContainer[KVCacheEvent]
    def __init__(self, seq: _Optional[int] = ..., events: _Optional[_Iterable[_Union[KVCacheEvent, _Mapping]]] = ...) -> None: ...

class KVCacheTierHashes(_message.Message):
    __slots__ = ("tier", "block_hashes")
    TIER_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    tier: KVCacheTier
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, tier: _Optional[_Union[KVCacheTier, str]] = ..., block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class KVCacheSnapshot(_message.Message):
    __slots__ = ("block_hashes", "tiers")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    tiers: _containers.RepeatedCompositeFieldContainer[KVCacheTierHashes]
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., tiers: _Optional[_Iterable[_Union[KVCacheTierHashes, _Mapping]]] = ...) -> None: ...

class KVEventsRequest(_message.Message):
    __slots__ = ("epoch", "acked_seq", "snapshot")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ACKED_SEQ_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    epoch: str
    acked_seq: int
    snapshot: bool
    def __init__(self, epoch: _Optional[str] = ..., acked_seq: _Optional[int] = ..., snapshot: _Optional[bool] = ...) -> None: ...

class KVEventsResponse(_message.Message):
    __slots__ = ("epoch", "last_seq", "batches", "snapshot")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQ_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    epoch: str
    last_seq: int
    batches: _containers.RepeatedCompositeFieldContainer[KVCacheEventBatch]
    snapshot: KVCacheSnapshot
    def __init__(self, epoch: _Optional[str] = ..., last_seq: _Optional[int] = ..., batches: _Optional[_Iterable[_Union[KVCacheEventBatch, _Mapping]]] = ..., snapshot: _Optional[_Union[KVCacheSnapshot, _Mapping]] = ...) -> None: ...
