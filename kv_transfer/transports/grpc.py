"""gRPC transport: a client-streaming KV service on each decode actor.

Service ``pdserve.v1.KVTransferService`` (documented in
proto/pdserve/v1/kv_transfer.proto) with raw-bytes handlers — a protobuf
``bytes`` field would cost a copy and half the throughput:
    Handshake  unary:  msgpack layout description -> msgpack layout description
    PushKV     client stream of frames (u32 len | msgpack header | payload),
               closed by an END frame (u32 0) -> msgpack {"nbytes": int}
The internal secret travels in metadata ``x-pdserve-token`` (``TOKEN_KEY``); an interceptor
checks it before a message is read (``proto.internal_auth``), a wrong one is answered
UNAUTHENTICATED and counted. Bounds: a Handshake body of ``MAX_HANDSHAKE_BYTES``, a PushKV
frame of the receiver's ``max_payload`` and a header (at most ``MAX_MESSAGE_BYTES``, the wire's largest
frame), ``max_calls`` calls at once (more get
RESOURCE_EXHAUSTED; ``max_streams`` of them run, the rest wait unread), each call at most
``CALL_DEADLINES`` times the longest transfer deadline (then it is cancelled). With ``tls`` (an
``InternalTLS``) the service and the senders speak mutual TLS only. HTTP/2 flow control paces
the stream, the call's timeout is the transfer deadline.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent import futures
from concurrent.futures import Future

import grpc
import msgpack

from kv_transfer.chunker import EncodedChunk
from proto.internal_auth import InternalTLS, TokenGate, TokenInterceptor, add_port, open_channel
from kv_transfer.interface import FailedSide, TransferError, TransferStatus
from kv_transfer.layout import HandshakeError
from kv_transfer.receiver import BaseReceiver
from kv_transfer.sender import BaseSender
from kv_transfer.wire import (
    MAX_HEADER_BYTES,
    MAX_PAYLOAD_BYTES,
    TOKEN_KEY,
    WireError,
    pack_frame,
    split_frame,
    unpack_small,
)

SERVICE = "pdserve.v1.KVTransferService"
# Control frames have header length 0. A stream's last frame is END (a killed
# client's stream also just ends, so only END proves completeness); ABORT +
# transfer id says "the sender gave up, free the blocks".
END_FRAME = b"\x00\x00\x00\x00"
ABORT_PREFIX = END_FRAME
MAX_DECODES_PER_STREAM = 2  # chunks of one stream queued for decode (bounds memory)
MAX_MESSAGE_BYTES = MAX_PAYLOAD_BYTES + MAX_HEADER_BYTES + 16
MAX_HANDSHAKE_BYTES = 4096  # a layout description is ~200 bytes
MAX_CALLS = 64  # concurrent calls per receiver (a transfer uses up to num_streams of them)
CALL_DEADLINES = 2  # a PushKV call lasts at most this many times the receiver's max_deadline_s
_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # every transfer is a new stream; a 4 MiB initial window (not 64 KiB, grown by BDP probes)
    # lets its first chunks go at once: +10 % for fp8 on the 10 Gbit/s link, <= 4 MiB per stream
    ("grpc.http2.lookahead_bytes", 4 << 20),
]
_RECEIVER_CODES = {
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.DATA_LOSS,
    grpc.StatusCode.ABORTED,
}


class GrpcReceiver(BaseReceiver):
    """Serves KVTransferService on ``host:port`` (port 0 = pick one)."""

    def __init__(self, layout, kv_cache, allocator, *, host: str = "127.0.0.1", port: int = 0, max_streams: int = 32,
                 max_calls: int = MAX_CALLS, decode_threads: int = 2, tls: InternalTLS | None = None, **kwargs):
        self._calls: dict[object, float] = {}  # open PushKV calls' contexts -> when the reaper cancels each
        super().__init__(layout, kv_cache, allocator, **kwargs)
        self._decoders = futures.ThreadPoolExecutor(max_workers=decode_threads, thread_name_prefix="kv-decode")
        gate = TokenGate(TOKEN_KEY, self.token, message="receiver rejected the cluster token ({reason})",
                         on_reject=self._count_auth_failure)
        max_frame = MAX_MESSAGE_BYTES - MAX_PAYLOAD_BYTES + self.max_payload   # no frame it would refuse is read
        options = [(key, max_frame if key == "grpc.max_receive_message_length" else value) for key, value in _OPTIONS]
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_streams, thread_name_prefix="kv-grpc"),
                                   interceptors=[TokenInterceptor(gate)], options=options,
                                   maximum_concurrent_rpcs=max_calls)
        handlers = {
            "Handshake": grpc.unary_unary_rpc_method_handler(self._handshake),
            "PushKV": grpc.stream_unary_rpc_method_handler(self._push),
        }
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        bound = add_port(self._server, f"{host}:{port}", tls)
        if bound == 0:
            raise OSError(f"cannot bind KV gRPC service to {host}:{port}")
        self._endpoint = f"{host}:{bound}"
        self._server.start()

    def _count_auth_failure(self, method: str, reason: str) -> None:
        with self._cond:
            self._stats.auth_failures += 1

    def _handshake(self, request: bytes, context) -> bytes:
        if len(request) > MAX_HANDSHAKE_BYTES:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"Handshake of {len(request)} bytes is over the limit of {MAX_HANDSHAKE_BYTES}")
        try:
            self.check_handshake(unpack_small(request))
        except (HandshakeError, WireError, ValueError) as exc:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        return msgpack.packb(self.describe())

    def _push(self, frames: Iterator[bytes], context) -> bytes:
        # A call carries one transfer, which ends within max_deadline_s of its first chunk: a call still open after
        # CALL_DEADLINES of them (a silent peer that set no deadline of its own) is cancelled by the reaper, freeing
        # its thread (the reaper's, not a timer thread per call).
        with self._cond:
            self._calls[context] = time.monotonic() + CALL_DEADLINES * self.max_deadline_s
        try:
            return self._receive(frames, context)
        finally:
            with self._cond:
                self._calls.pop(context, None)

    def _reap_transport(self, now: float) -> None:
        with self._cond:
            expired = [context for context, cancel_at in self._calls.items() if cancel_at < now]
            for context in expired:
                del self._calls[context]           # cancelled once
        for context in expired:
            context.cancel()

    def _receive(self, frames: Iterator[bytes], context) -> bytes:
        transfer_id, nbytes = "", 0
        code, error = None, ""
        pending: deque[Future] = deque()
        ended = False
        try:
            for frame in frames:
                if frame == END_FRAME:
                    ended = True
                    break
                if frame[:4] == ABORT_PREFIX:
                    transfer_id = bytes(frame[4:260]).decode(errors="replace")
                    code, error = grpc.StatusCode.ABORTED, "sender aborted mid-transfer"
                    break
                header, payload = split_frame(frame)
                transfer_id = header.transfer_id
                # decode on the pool while this thread reads the next frame off the wire
                pending.append(self._decoders.submit(self.accept, header, payload))
                nbytes += len(frame)
                while len(pending) > MAX_DECODES_PER_STREAM or (pending and pending[0].done()):
                    pending.popleft().result()
            while pending:
                pending.popleft().result()
            if code is None and not ended:  # a dead client's stream just ends
                code, error = grpc.StatusCode.ABORTED, "sender disconnected mid-transfer"
        except TransferError as exc:
            code, error = grpc.StatusCode.FAILED_PRECONDITION, str(exc)
        except WireError as exc:
            code, error = grpc.StatusCode.DATA_LOSS, str(exc)
        except Exception as exc:  # client went away: the iterator raises
            code, error = grpc.StatusCode.ABORTED, f"sender disconnected mid-transfer ({type(exc).__name__})"
        for future in pending:  # let queued decodes finish before failing the transfer
            future.exception()
        if code is not None:
            if transfer_id:  # (a stream that carried no chunk yet knows no transfer: the deadline reaps it)
                self.fail(transfer_id, error)
            context.abort(code, error)
        return msgpack.packb({"nbytes": nbytes})

    def close(self) -> None:
        self._server.stop(grace=0.5).wait()
        self._decoders.shutdown(wait=True)
        super().close()


class GrpcSender(BaseSender):
    """Streams chunks to ``dest`` = "host:port" of a GrpcReceiver (mutual TLS with ``tls``).

    A transfer is striped over ``num_streams`` PushKV calls, each on its own
    TCP connection: one gRPC connection tops out near 1 GB/s here, two come
    close to the raw socket. Streams take the next ready frame (work
    stealing); the receiver completes a transfer by coverage, not by stream.
    """

    def __init__(self, layout, *, num_streams: int = 2, tls: InternalTLS | None = None, **kwargs) -> None:
        super().__init__(layout, **kwargs)
        self.num_streams = max(1, num_streams)
        self.tls = tls
        self._streams = futures.ThreadPoolExecutor(max_workers=self._pool._max_workers * (self.num_streams - 1) or 1,
                                                   thread_name_prefix="kv-grpc-stream")
        self._channels: dict[str, list[grpc.Channel]] = {}
        self._channels_lock = threading.Lock()

    def _channel(self, dest: str, index: int = 0) -> grpc.Channel:
        with self._channels_lock:
            channels = self._channels.get(dest)
            if channels is None:
                # a local subchannel pool per channel = a TCP connection per channel
                channels = self._channels[dest] = [
                    open_channel(dest, self.tls, _OPTIONS + [("grpc.use_local_subchannel_pool", 1)])
                    for _ in range(self.num_streams)
                ]
            return channels[index]

    def forget(self, dest: str) -> None:
        super().forget(dest)
        with self._channels_lock:
            channels = self._channels.pop(dest, [])
        for channel in channels:
            channel.close()

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
        return unpack_small(reply)

    def _prepare(self, chunk: EncodedChunk) -> bytes:
        frame = pack_frame(chunk.header_bytes, chunk.payload.cpu().numpy())  # on the encode thread
        chunk.release()
        return frame

    def _ship(self, dest: str, frames: Iterator[bytes], deadline_at: float, transfer_id: str,
              sizes: list[int] | None = None) -> int:
        lock, counted, encode_error, failures = threading.Lock(), [0], [], []

        def take() -> Iterator[bytes]:
            while True:
                with lock:  # the shared frame iterator is not thread-safe
                    if encode_error:
                        return
                    try:
                        frame = next(frames)
                    except StopIteration:
                        frame = END_FRAME
                    except Exception as exc:  # tell the receiver to free what it reserved
                        encode_error.append(exc)
                        frame = ABORT_PREFIX + transfer_id.encode()
                    counted[0] += len(frame)
                yield frame
                if frame == END_FRAME:
                    return

        def stream(index: int) -> None:
            call = self._channel(dest, index).stream_unary(f"/{SERVICE}/PushKV")
            try:
                call(take(), timeout=max(0.001, deadline_at - time.monotonic()), metadata=self._metadata())
            except grpc.RpcError as exc:
                failures.append(exc)

        # small transfers ride one stream: a second costs more than it brings
        num_streams = min(self.num_streams, max(1, len(sizes or ()) // 4))
        extra = [self._streams.submit(stream, i) for i in range(1, num_streams)]
        stream(0)
        for future in extra:
            future.result()
        if encode_error:
            raise encode_error[0]
        if failures:
            exc = failures[0]
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                self.forget(dest)  # gone, or back with another layout: no handshake, no channels kept
            raise self._error(exc)
        return counted[0]

    def _error(self, exc: grpc.RpcError) -> TransferError:
        code, details = exc.code(), exc.details() or ""
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return TransferError(f"deadline exceeded: {details}", FailedSide.TRANSPORT, TransferStatus.EXPIRED)
        side = FailedSide.RECEIVER if code in _RECEIVER_CODES else FailedSide.TRANSPORT
        return TransferError(f"{code.name}: {details}", side)

    def close(self) -> None:
        super().close()
        self._streams.shutdown(wait=True)
        with self._channels_lock:
            for channels in self._channels.values():
                for channel in channels:
                    channel.close()
            self._channels.clear()
