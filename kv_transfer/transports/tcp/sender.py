"""TcpSender: the prefill side of the tcp transport.

Each send() piece takes a connection to its destination (an idle one, or a
new one that passes the hello), writes its chunks as frames, then END, and
reads the receiver's ACK; the connection goes back to the idle list only
when the exchange completed (receiver errors included), so it is always in
step. Under codec ``none`` on a contiguous CPU cache a chunk is sent straight
from the cache's cells: ``sendmsg`` of memoryviews of its runs of cells, the
checksum taken over the same views first, no gathered copy. Other chunks
(fp8, a device cache) are encoded by the shared pipeline into pooled buffers
(fp8 on a CPU cache: the compiled kernel reads the cache rows directly) and
the buffer is sent as it is, without framing copies. An encode error mid-piece
sends ABORT, so the receiver frees what the piece reserved.
"""

from __future__ import annotations

import functools
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from kv_transfer.chunker import ChunkJob, EncodedChunk, chunk_header, piece_plans
from kv_transfer.interface import FailedSide, KVPiece, TransferError, TransferStatus
from proto.internal_auth import InternalTLS
from kv_transfer.layout import HandshakeError, check_compatible
from kv_transfer.sender import BaseSender
from kv_transfer.transports.tcp.protocol import (
    FRAME,
    KIND_ABORT,
    KIND_CHUNK,
    KIND_END,
    MAX_ERROR_BYTES,
    NONCE_BYTES,
    blocking,
    client_context,
    hello_key,
    hello_proof,
    recv_ack,
    recv_exact,
    recv_small,
    send_buffers,
    send_small,
    set_timeout,
    split_endpoint,
    tune,
)
from kv_transfer.transports.tcp.rows import cache_bytes, checksum_of, views
from kv_transfer.wire import WireError, pack_header

MAX_IDLE = 8  # idle connections kept per destination
CONNECT_TIMEOUT_S = 10.0


@dataclass(slots=True)
class _Frame:
    """One chunk as the socket sends it: header bytes, then the payload's buffers in order."""

    header_bytes: bytes
    buffers: list
    nbytes: int
    release: Callable[[], None] = field(default=lambda: None)


class TcpSender(BaseSender):
    def __init__(self, layout, *, tls: InternalTLS | None = None, connect_timeout_s: float = CONNECT_TIMEOUT_S,
                 **kwargs) -> None:
        super().__init__(layout, **kwargs)
        self.tls, self.connect_timeout_s = tls, connect_timeout_s
        self._context = client_context(tls) if tls is not None else None
        self._key = hello_key(self.token)
        self._idle: dict[str, list[socket.socket]] = {}
        self._idle_lock = threading.Lock()

    # --- connections -----------------------------------------------------------
    def _connect(self, dest: str, deadline_at: float | None = None) -> tuple[socket.socket, dict]:
        """A new connection that passed the hello: -> (socket, the receiver's layout)."""
        try:
            host, port = split_endpoint(dest)
        except ValueError as exc:
            raise TransferError(str(exc), FailedSide.SENDER) from None
        try:
            timeout = self.connect_timeout_s if deadline_at is None else min(self.connect_timeout_s,
                                                                                _left(deadline_at))
            sock = socket.create_connection((host, port), timeout=timeout)
        except TimeoutError:
            if deadline_at is not None and deadline_at - time.monotonic() < 0.01:
                raise TransferError(f"no connection to the tcp KV receiver at {dest} before the deadline",
                                    FailedSide.TRANSPORT, TransferStatus.EXPIRED) from None
            raise TransferError(f"connecting to the tcp KV receiver at {dest} timed out after "
                                f"{self.connect_timeout_s:g} s", FailedSide.TRANSPORT) from None
        except OSError as exc:
            raise TransferError(f"cannot connect to the tcp KV receiver at {dest}: {exc}", FailedSide.TRANSPORT) \
                from None
        try:
            tune(sock)
            if self._context is not None:
                sock = self._context.wrap_socket(sock, server_hostname=self.tls.server_name or host)
            nonce = bytes(recv_exact(sock, NONCE_BYTES))
            send_small(sock, {"proof": hello_proof(self._key, nonce), "layout": self.describe()})
            reply = recv_small(sock)
            blocking(sock)
        except (OSError, ConnectionError, WireError) as exc:
            sock.close()
            raise TransferError(f"tcp KV hello with {dest} failed: {exc}", FailedSide.TRANSPORT) from None
        if not reply.get("ok"):
            sock.close()
            error = str(reply.get("error"))
            raise HandshakeError(error) if "mismatch" in error else TransferError(error, FailedSide.RECEIVER)
        layout = reply.get("layout") or {}
        try:
            check_compatible(self.describe(), layout)
        except HandshakeError:
            sock.close()
            raise
        return sock, layout

    def _checkout(self, dest: str, deadline_at: float) -> socket.socket:
        with self._idle_lock:
            idle = self._idle.get(dest, [])
            while idle:
                sock = idle.pop()
                if _alive(sock):
                    return sock
                sock.close()
        return self._connect(dest, deadline_at)[0]

    def _checkin(self, dest: str, sock: socket.socket) -> None:
        with self._idle_lock:
            idle = self._idle.setdefault(dest, [])
            if len(idle) < MAX_IDLE:
                idle.append(sock)
                return
        sock.close()

    def forget(self, dest: str) -> None:
        super().forget(dest)
        with self._idle_lock:
            idle = self._idle.pop(dest, [])
        for sock in idle:
            sock.close()

    def _remote_handshake(self, dest: str, local: dict) -> dict:
        sock, layout = self._connect(dest)
        self._checkin(dest, sock)
        return layout

    # --- chunks --------------------------------------------------------------------
    def _jobs(self, piece: KVPiece, deadline_at: float) -> list[ChunkJob]:
        """Codec none (or a quantized cache's stored cells) on a contiguous CPU cache: chunks straight from the
        rows; otherwise the encode pipeline."""
        addressed = cache_bytes(piece.kv_cache)
        if not self.codec.as_stored or addressed is None:
            return super()._jobs(piece, deadline_at)
        rows, cells = addressed
        cell_bytes = cells.nbytes
        plans = piece_plans(piece, cell_bytes, self.chunk_bytes)
        layout, codec = self.layout, self.codec

        def frame(chunk_index: int, plan) -> _Frame:
            buffers = views(rows, cells.ranges((plan.layer_start, plan.layer_end),
                                               piece.block_ids[plan.block_start : plan.block_end]))
            nbytes = sum(len(buffer) for buffer in buffers)
            header = chunk_header(piece, layout, codec, plan, chunk_index, len(plans), nbytes, checksum_of(buffers),
                                  deadline_at)
            return _Frame(pack_header(header), buffers, nbytes)

        def nbytes(plan) -> int:
            return (plan.layer_end - plan.layer_start) * (plan.block_end - plan.block_start) * cell_bytes

        return [ChunkJob(functools.partial(frame, index, plan), nbytes(plan)) for index, plan in enumerate(plans)]

    def _prepare(self, chunk: EncodedChunk | _Frame) -> _Frame:
        if isinstance(chunk, _Frame):
            return chunk
        payload = chunk.payload if chunk.payload.device.type == "cpu" else chunk.payload.cpu()
        return _Frame(chunk.header_bytes, [payload.numpy()], payload.numel(), chunk.release)

    def _ship(self, dest: str, frames: Iterator[_Frame], deadline_at: float, transfer_id: str = "",
              sizes: list[int] | None = None) -> int:
        sock = self._checkout(dest, deadline_at)
        in_step, wire_bytes, encode_error = False, 0, None
        try:
            while True:
                try:
                    frame = next(frames)
                except StopIteration:
                    break
                except Exception as exc:  # encode failed: tell the receiver to free what the piece reserved
                    encode_error = exc
                    break
                set_timeout(sock, _left(deadline_at))
                prefix = FRAME.pack(KIND_CHUNK, len(frame.header_bytes), frame.nbytes)
                wire_bytes += send_buffers(sock, [prefix, frame.header_bytes, *frame.buffers])
                frame.release()
            if encode_error is None:
                ending = FRAME.pack(KIND_END, 0, 0)
            else:
                reason = f"{type(encode_error).__name__}: {encode_error}".encode()[:MAX_ERROR_BYTES]
                ending = FRAME.pack(KIND_ABORT, len(reason), 0) + reason
            set_timeout(sock, _left(deadline_at))
            send_buffers(sock, [ending])
            error = recv_ack(sock)
            in_step = True
        except TimeoutError:
            raise TransferError(f"deadline passed on the tcp connection to {dest}", FailedSide.TRANSPORT,
                                TransferStatus.EXPIRED) from None
        except (OSError, ConnectionError, WireError) as exc:
            self.forget(dest)  # gone, or back with another layout: reconnect (and hello) next time
            raise TransferError(f"tcp connection to {dest} broke: {exc}", FailedSide.TRANSPORT) from None
        finally:
            if in_step:
                self._checkin(dest, sock)
            else:
                sock.close()
        if encode_error is not None:
            raise encode_error
        if error:
            raise TransferError(error, FailedSide.RECEIVER)
        return wire_bytes

    def close(self) -> None:
        super().close()
        with self._idle_lock:
            idle, self._idle = [sock for socks in self._idle.values() for sock in socks], {}
        for sock in idle:
            sock.close()


def _left(deadline_at: float) -> float:
    remaining = deadline_at - time.monotonic()
    if remaining <= 0:
        raise TimeoutError("the transfer deadline passed")
    return remaining


def _alive(sock: socket.socket) -> bool:
    """An idle connection is readable only when the receiver closed it (it never speaks unasked)."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return False
    return not readable
