"""gRPC transport: a client-streaming KV service on each decode actor.

Service ``pdserve.v1.KVTransferService`` (documented in
proto/pdserve/v1/kv_transfer.proto) with raw-bytes handlers — a protobuf
``bytes`` field would cost a copy and half the throughput:
    Handshake  unary:  msgpack layout description -> msgpack layout description
    PushKV     client stream of frames (u32 len | msgpack header | payload)
               -> msgpack {"nbytes": int}
The cluster token travels in metadata ``x-pdserve-token``; a wrong token is
answered UNAUTHENTICATED and counted. HTTP/2 flow control paces the stream,
the call's timeout is the transfer deadline.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent import futures

import grpc
import msgpack

from kv_transfer.base import FailedSide, TransferError, TransferStatus
from kv_transfer.chunker import EncodedChunk
from kv_transfer.layout import HandshakeError
from kv_transfer.receiver import CoreReceiver
from kv_transfer.sender_core import BaseSender
from kv_transfer.wire import MAX_HEADER_BYTES, MAX_PAYLOAD_BYTES, WireError, pack_frame, split_frame

SERVICE = "pdserve.v1.KVTransferService"
TOKEN_KEY = "x-pdserve-token"
MAX_MESSAGE_BYTES = MAX_PAYLOAD_BYTES + MAX_HEADER_BYTES + 16
_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
]
_RECEIVER_CODES = {
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.DATA_LOSS,
    grpc.StatusCode.ABORTED,
}


def _unpack_small(data: bytes) -> dict:
    if len(data) > MAX_HEADER_BYTES:
        raise WireError("handshake message too large")
    value = msgpack.unpackb(data, raw=False, max_str_len=4096, max_bin_len=0, max_array_len=0, max_map_len=64)
    if not isinstance(value, dict):
        raise WireError("handshake message is not a map")
    return value


class GrpcReceiver(CoreReceiver):
    """Serves KVTransferService on ``host:port`` (port 0 = pick one)."""

    def __init__(self, layout, kv_cache, allocator, *, host: str = "127.0.0.1", port: int = 0, max_streams: int = 32, **kwargs):
        super().__init__(layout, kv_cache, allocator, **kwargs)
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_streams, thread_name_prefix="kv-grpc"), options=_OPTIONS)
        handlers = {
            "Handshake": grpc.unary_unary_rpc_method_handler(self._handshake),
            "PushKV": grpc.stream_unary_rpc_method_handler(self._push),
        }
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        bound = self._server.add_insecure_port(f"{host}:{port}")
        if bound == 0:
            raise OSError(f"cannot bind KV gRPC service to {host}:{port}")
        self._endpoint = f"{host}:{bound}"
        self._server.start()

    def _authorized(self, context) -> bool:
        token = dict(context.invocation_metadata()).get(TOKEN_KEY)
        return self.core.check_token(token)

    def _handshake(self, request: bytes, context) -> bytes:
        if not self._authorized(context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "receiver rejected the cluster token")
        try:
            self.core.check_handshake(_unpack_small(request))
        except (HandshakeError, WireError, ValueError) as exc:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        return msgpack.packb(self.core.describe())

    def _push(self, frames: Iterator[bytes], context) -> bytes:
        if not self._authorized(context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "receiver rejected the cluster token")
        transfer_id, nbytes, last_index, num_chunks = "", 0, -1, 0
        code, error = None, ""
        try:
            for frame in frames:
                header, payload = split_frame(frame)
                transfer_id, last_index, num_chunks = header.transfer_id, header.chunk_index, header.num_chunks
                self.core.accept(header, payload)
                nbytes += len(frame)
            if last_index != num_chunks - 1:
                code, error = grpc.StatusCode.ABORTED, f"stream ended after chunk {last_index} of {num_chunks}"
        except TransferError as exc:
            code, error = grpc.StatusCode.FAILED_PRECONDITION, str(exc)
        except WireError as exc:
            code, error = grpc.StatusCode.DATA_LOSS, str(exc)
        except Exception as exc:  # client went away: the iterator raises
            code, error = grpc.StatusCode.ABORTED, f"sender disconnected mid-transfer ({type(exc).__name__})"
        if code is not None:
            if transfer_id:
                self.core.fail(transfer_id, error)
            context.abort(code, error)
        return msgpack.packb({"nbytes": nbytes})

    def close(self) -> None:
        self._server.stop(grace=0.5).wait()
        super().close()


class GrpcSender(BaseSender):
    """Streams chunks to ``dest`` = "host:port" of a GrpcReceiver."""

    def __init__(self, layout, **kwargs) -> None:
        super().__init__(layout, **kwargs)
        self._channels: dict[str, grpc.Channel] = {}
        self._channels_lock = threading.Lock()

    def _channel(self, dest: str) -> grpc.Channel:
        with self._channels_lock:
            channel = self._channels.get(dest)
            if channel is None:
                channel = self._channels[dest] = grpc.insecure_channel(dest, options=_OPTIONS)
            return channel

    def _metadata(self):
        return ((TOKEN_KEY, self.token),)

    def _remote_handshake(self, dest: str, local: dict) -> dict:
        call = self._channel(dest).unary_unary(f"/{SERVICE}/Handshake")
        try:
            reply = call(msgpack.packb(local), timeout=10, metadata=self._metadata())
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                raise HandshakeError(exc.details()) from None
            raise self._error(exc) from None
        return _unpack_small(reply)

    def _ship(self, dest: str, chunks: Iterator[EncodedChunk], deadline_at: float) -> int:
        counted, encode_error = [0], []

        def frames() -> Iterator[bytes]:
            try:
                for chunk in chunks:
                    frame = pack_frame(chunk.header_bytes, chunk.payload.cpu().numpy())
                    chunk.release()
                    counted[0] += len(frame)
                    yield frame
            except Exception as exc:  # end the stream early: the receiver frees what it reserved
                encode_error.append(exc)

        call = self._channel(dest).stream_unary(f"/{SERVICE}/PushKV")
        try:
            call(frames(), timeout=max(0.001, deadline_at - time.monotonic()), metadata=self._metadata())
        except grpc.RpcError as exc:
            if encode_error:
                raise encode_error[0] from None
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                self.forget(dest)  # the receiver may come back with another layout
            raise self._error(exc) from None
        if encode_error:
            raise encode_error[0]
        return counted[0]

    def _error(self, exc: grpc.RpcError) -> TransferError:
        code, details = exc.code(), exc.details() or ""
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return TransferError(f"deadline exceeded: {details}", FailedSide.TRANSPORT, TransferStatus.EXPIRED)
        side = FailedSide.RECEIVER if code in _RECEIVER_CODES else FailedSide.TRANSPORT
        return TransferError(f"{code.name}: {details}", side)

    def close(self) -> None:
        super().close()
        with self._channels_lock:
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()
