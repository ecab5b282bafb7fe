"""Paged KV-cache transfer from prefill to decode actors.

Wire format (msgpack header + raw bytes), codecs (``none``, ``fp8`` per
block, ``int8`` per token, ``fp8_tensor`` baseline) and transports (``grpc``, ``tcp``, ``torch``,
``ray``, ``nixl``, in-process ``fake``) behind one sender/receiver interface; see
``kv_transfer.interface`` for the methods by side. No ray import here.

    interface.py       KVSender / KVReceiver ABCs, status enums, results, BlockAllocator
    layout.py          the cache layout both ends agree on, the handshake check
    wire.py            chunk header, frames, checksums (the handoff travels in the header)
    codec.py           none / fp8 / int8 / fp8_tensor; codec_compiled.py: fused fp8 kernels
    buffers.py         pooled scratch and payload buffers; chunker.py: chunk plans, encode pipeline
    sender.py          BaseSender: what every transport's sender shares
    receiver.py        BaseReceiver: reserve, write, complete, free
    settings.py        TransferSettings, make_sender / make_receiver
    resharded.py       between tensor-parallel degrees: one transfer per head copy; head_view.py: a cache's
                       KV heads as views (a quantized cache's values and scales)
    transports/        grpc.py, tcp/, ray.py, fake.py, torch/, nixl/
"""

from kv_transfer.codec import CODECS, Codec, CodecError, get_codec, wire_bytes_per_kv_byte
from kv_transfer.codec_compiled import release_gil_in_compiled_kernels
from kv_transfer.interface import (
    BlockAllocator,
    FailedSide,
    KVPiece,
    KVReceiver,
    KVSender,
    ReceiverStats,
    SendHandle,
    TransferError,
    TransferResult,
    TransferStatus,
)
from kv_transfer.layout import HandshakeError, KVLayout, check_compatible
from kv_transfer.settings import TransferSettings, layout_of, make_receiver, make_sender
from kv_transfer.transports import TRANSPORTS
from kv_transfer.transports.fake import FakeHub, SimpleBlockPool
from kv_transfer.wire import DEFAULT_CHUNK_BYTES, TOKEN_KEY, WIRE_VERSION, ChunkHeader, WireError

__all__ = [
    "BlockAllocator",
    "CODECS",
    "wire_bytes_per_kv_byte",
    "ChunkHeader",
    "Codec",
    "CodecError",
    "DEFAULT_CHUNK_BYTES",
    "FailedSide",
    "FakeHub",
    "HandshakeError",
    "KVLayout",
    "KVPiece",
    "KVReceiver",
    "KVSender",
    "ReceiverStats",
    "SendHandle",
    "SimpleBlockPool",
    "TOKEN_KEY",
    "TRANSPORTS",
    "TransferError",
    "TransferResult",
    "TransferSettings",
    "TransferStatus",
    "WIRE_VERSION",
    "WireError",
    "check_compatible",
    "get_codec",
    "layout_of",
    "make_receiver",
    "make_sender",
    "release_gil_in_compiled_kernels",
]
