"""Paged KV-cache transfer from prefill to decode actors.

Wire format (msgpack header + raw bytes), codecs (``none``, ``fp8`` per
block, ``fp8_tensor`` baseline) and transports (``grpc``, ``torch``,
``ray``, in-process ``fake``) behind one sender/receiver interface; see
``kv_transfer.base`` for the methods by side. No ray import here.
"""

from kv_transfer.base import (
    FailedSide,
    KVReceiver,
    KVSender,
    ReceiverStats,
    SendHandle,
    TransferError,
    TransferResult,
    TransferStatus,
)
from kv_transfer.codec import CODECS, Codec, CodecError, get_codec
from kv_transfer.factory import TRANSPORTS, make_receiver, make_sender
from kv_transfer.fake import FakeHub
from kv_transfer.handoff import handoff_from_result, make_handoff
from kv_transfer.layout import HandshakeError, KVLayout, check_compatible
from kv_transfer.pool import BlockAllocator, LockedAllocator, SimpleBlockPool
from kv_transfer.wire import DEFAULT_CHUNK_BYTES, WIRE_VERSION, ChunkHeader, WireError

__all__ = [
    "BlockAllocator",
    "CODECS",
    "ChunkHeader",
    "Codec",
    "CodecError",
    "DEFAULT_CHUNK_BYTES",
    "FailedSide",
    "FakeHub",
    "HandshakeError",
    "KVLayout",
    "KVReceiver",
    "KVSender",
    "LockedAllocator",
    "ReceiverStats",
    "SendHandle",
    "SimpleBlockPool",
    "TRANSPORTS",
    "TransferError",
    "TransferResult",
    "TransferStatus",
    "WIRE_VERSION",
    "WireError",
    "check_compatible",
    "get_codec",
    "handoff_from_result",
    "make_handoff",
    "make_receiver",
    "make_sender",
]
