"""TcpReceiver: the decode side of the tcp transport.

Listens on ``host:port`` (127.0.0.1 and a free port by default) and serves each
connection on its own thread (at most ``max_connections``; more are closed at
once). A connection first passes the hello (proof of the internal secret for a
fresh nonce, then the layout check; one deadline, ``HELLO_TIMEOUT_S``, bounds the
whole hello, and hellos have slots of their own, ``MAX_HELLOS``, apart from the
authenticated connections'), then carries send() pieces one after another:

    CHUNK ... CHUNK END -> ACK        (or ... ABORT -> ACK: the sender gave up)

A chunk under codec ``none`` into a contiguous CPU cache is received straight
into its destination cells (scattered reads into the reserved blocks), then
checksummed there; the blocks are handed over only when every cell of the
transfer arrived with a matching checksum, and a mismatch fails the transfer
and frees them. Other chunks (fp8, a device cache) are received into a pooled
staging buffer and decoded from it into the cache on a small pool, while the
connection reads the next one. After a refused chunk the connection reads and
drops the rest of the piece, so its ACK carries the error and the connection
stays in step. A connection that breaks mid-piece (sender killed, deadline on
the wire) fails the piece's transfers; every failure frees their blocks.
Reads and writes block in the kernel (SO_RCVTIMEO / SO_SNDTIMEO bound them by
the transfer's deadline): a chunk arrives in one MSG_WAITALL read. A sender
that gave up after its chunks were already in this socket may still see its
transfer DONE here; the decode worker parks such a transfer and frees it.
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from kv_transfer.buffers import payload_pool
from kv_transfer.codec import get_codec, pin_transfer_thread
from kv_transfer.interface import TransferError
from proto.internal_auth import InternalTLS
from kv_transfer.layout import HandshakeError
from kv_transfer.receiver import BaseReceiver
from kv_transfer.transports.tcp.protocol import (
    FRAME,
    HELLO_TIMEOUT_S,
    KIND_ABORT,
    KIND_CHUNK,
    KIND_END,
    MAX_ERROR_BYTES,
    blocking,
    hello_key,
    hello_proof,
    new_nonce,
    recv_buffers,
    recv_exact,
    recv_small,
    send_ack,
    send_small,
    server_context,
    set_timeout,
    tune,
)
from kv_transfer.transports.hello_slots import MAX_HELLOS, HelloSlots
from kv_transfer.transports.tcp.rows import cache_bytes, checksum_of, views
from kv_transfer.wire import MAX_HEADER_BYTES, WireError, unpack_header

log = logging.getLogger(__name__)
MAX_CONNECTIONS = 256  # a sender keeps at most one connection per send() in flight (max_workers, 4 by default)
MAX_PENDING_DECODES = 2  # staged chunks of one connection waiting for decode (bounds memory)
DRAIN_BYTES = 1 << 20


class _Piece:
    """What one connection knows of the piece it is reading: the transfers it touched, its first error."""

    def __init__(self) -> None:
        self.transfer_ids: set[str] = set()
        self.error = ""
        self.deadline: float | None = None  # time.monotonic() the wire must deliver by; None between pieces
        self.decodes: deque[Future] = deque()


class TcpReceiver(BaseReceiver):
    def __init__(self, layout, kv_cache, allocator, *, host: str = "127.0.0.1", port: int = 0,
                 max_connections: int = MAX_CONNECTIONS, decode_threads: int = 2,
                 tls: InternalTLS | None = None, hello_timeout_s: float = HELLO_TIMEOUT_S, **kwargs):
        super().__init__(layout, kv_cache, allocator, **kwargs)
        self.max_connections, self.hello_timeout_s = max_connections, hello_timeout_s
        self._context = server_context(tls) if tls is not None else None
        self._key = hello_key(self.token)
        self._rows = cache_bytes(kv_cache)  # (bytes, where the cells lie); None: every chunk takes the staging path
        self._decoders = ThreadPoolExecutor(max_workers=decode_threads, thread_name_prefix="kv-tcp-decode")
        self._listener = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET,
                                              backlog=128)
        bound = self._listener.getsockname()[1]
        self._endpoint = f"[{host}]:{bound}" if ":" in host else f"{host}:{bound}"
        self._closed = threading.Event()
        self._connections: dict[int, socket.socket] = {}   # authenticated
        self._lock = threading.Lock()
        self._slots = HelloSlots("tcp KV receiver", hello_timeout_s, self._count_bad_hello, MAX_HELLOS)
        self._accepter = threading.Thread(target=self._accept_loop, name="kv-tcp-accept", daemon=True)
        self._accepter.start()

    @property
    def num_connections(self) -> int:
        """Connections open: authenticated ones and those still in their hello."""
        with self._lock:
            return len(self._connections) + len(self._slots)

    # --- connections -----------------------------------------------------------
    def _accept_loop(self) -> None:
        """Hellos and authenticated connections have separate slots, so peers that never authenticate
        cannot starve the senders that do (``HelloSlots``: a new hello drops the oldest)."""
        while not self._closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:  # the listener was closed
                return
            self._slots.admit(conn)
            threading.Thread(target=self._serve, args=(conn,), name="kv-tcp-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        key, authenticated = id(conn), False
        try:
            tune(conn)
            conn.settimeout(self.hello_timeout_s)  # each read; HelloSlots bounds the whole hello
            if self._context is not None:
                wrapped = self._context.wrap_socket(conn, server_side=True)
                if not self._slots.swap(conn, wrapped):  # out of time during the TLS handshake
                    wrapped.close()
                    return
                conn = wrapped
            if not self._hello(conn) or not self._slots.release(conn):  # refused, or out of time
                return
            with self._lock:
                if len(self._connections) >= self.max_connections:
                    log.warning("tcp KV receiver: %d connections open, the limit; closing a new one",
                                len(self._connections))
                    return
                self._connections[key] = conn
            authenticated = True
            self._pieces(conn)
        except (OSError, ConnectionError, WireError, ssl.SSLError) as exc:
            if not authenticated:  # counted and logged rarely, never a traceback (unless dropped before)
                self._slots.drop(conn, f"{type(exc).__name__}: {exc}")
            elif isinstance(exc, WireError):  # an authenticated peer spoke out of turn: _pieces failed what it carried
                log.warning("tcp KV receiver: closed a connection that sent a bad frame (%s)", exc)
            # else: the connection broke: _pieces failed what it carried
        except Exception:  # a bug: say so; _pieces failed what the connection carried
            log.exception("tcp KV connection failed")
        finally:
            self._slots.release(conn)
            with self._lock:
                self._connections.pop(key, None)
            try:
                conn.close()
            except OSError:
                pass

    def _count_bad_hello(self) -> int:
        """Count a connection dropped before it authenticated; how many so far."""
        with self._cond:
            self._stats.bad_hellos += 1
            return self._stats.bad_hellos

    def _hello(self, conn: socket.socket) -> bool:
        """Challenge, check the proof (counted on failure), then the layout; reply. True when accepted."""
        nonce = new_nonce()
        conn.sendall(nonce)
        hello = recv_small(conn)
        if not self.check_token(str(hello.get("proof", "")), hello_proof(self._key, nonce)):
            send_small(conn, {"ok": False, "error": "receiver rejected the cluster token"})
            return False
        try:
            self.check_handshake(hello.get("layout") or {})
        except HandshakeError as exc:
            send_small(conn, {"ok": False, "error": str(exc)})
            return False
        send_small(conn, {"ok": True, "layout": self.describe()})
        blocking(conn)  # idle between pieces: close() or the peer's end wakes the read
        return True

    # --- pieces ------------------------------------------------------------------
    def _pieces(self, conn: socket.socket) -> None:
        piece = _Piece()
        try:
            while True:
                set_timeout(conn, _left(piece.deadline))
                kind, header_len, payload_len = FRAME.unpack(recv_exact(conn, FRAME.size))
                if kind == KIND_CHUNK:
                    self._chunk(conn, piece, header_len, payload_len)
                elif kind in (KIND_END, KIND_ABORT) and header_len <= MAX_ERROR_BYTES and payload_len == 0:
                    reason = bytes(recv_exact(conn, header_len)).decode(errors="replace")
                    self._wait_decodes(piece)
                    if kind == KIND_ABORT:
                        piece.error = piece.error or f"sender aborted mid-transfer: {reason}"
                        for transfer_id in piece.transfer_ids:
                            self.fail(transfer_id, piece.error)
                    send_ack(conn, piece.error)
                    piece = _Piece()
                else:
                    raise WireError(f"bad tcp frame (kind {kind}, header {header_len}, payload {payload_len})")
        except BaseException as exc:
            self._wait_decodes(piece)
            error = "receiver closed" if self._closed.is_set() else f"sender disconnected mid-transfer ({exc})"
            for transfer_id in piece.transfer_ids:
                self.fail(transfer_id, error)
            raise

    def _chunk(self, conn: socket.socket, piece: _Piece, header_len: int, payload_len: int) -> None:
        if header_len > MAX_HEADER_BYTES or payload_len > self.max_payload:
            raise WireError(f"tcp frame of header {header_len} and payload {payload_len} bytes is over the limits")
        header_bytes = recv_exact(conn, header_len)
        if piece.error:  # the piece was refused: read its remaining chunks, write nothing
            return _drain(conn, payload_len)
        try:
            header = unpack_header(header_bytes)
            if header.payload_len != payload_len:
                raise WireError(f"frame payload {payload_len} != header payload_len {header.payload_len}")
        except WireError as exc:
            piece.error = str(exc)
            return _drain(conn, payload_len)
        piece.transfer_ids.add(header.transfer_id)
        deadline_s = header.deadline_ms / 1000 if header.deadline_ms > 0 else self.default_timeout_s
        piece.deadline = time.monotonic() + min(deadline_s, self.max_deadline_s)
        set_timeout(conn, _left(piece.deadline))
        try:
            self.check_header(header)  # before a byte is reserved or staged (an unknown codec, another layout)
            if get_codec(header.codec).as_stored and self._rows is not None:
                self._receive_into_rows(conn, piece, header)
            else:
                self._receive_staged(conn, piece, header)
        except TransferError as exc:  # refused before a payload byte was read
            piece.error = str(exc)
            _drain(conn, payload_len)

    def _receive_into_rows(self, conn: socket.socket, piece: _Piece, header) -> None:
        """Scatter the payload into the reserved cells, then check its checksum there (a mismatch fails the
        transfer: its blocks are freed, never handed over)."""
        transfer = self.begin_write(header)
        written = False
        try:
            block_ids = transfer.dst_block_ids[header.block_start : header.block_end]
            rows, where = self._rows
            cells = views(rows, where.ranges((header.layer_start, header.layer_end), block_ids))
            recv_buffers(conn, cells)
            written = checksum_of(cells) == header.checksum
        finally:
            self.end_write(header, transfer, written)
        if not written:
            piece.error = f"checksum mismatch in chunk {header.chunk_index}"
            self.fail(header.transfer_id, piece.error)

    def _receive_staged(self, conn: socket.socket, piece: _Piece, header) -> None:
        """Receive into a pooled buffer; decode it on the pool while the connection reads on."""
        staging = payload_pool.acquire(header.payload_len, torch.device("cpu"))
        try:
            recv_buffers(conn, [staging.numpy()])
        except BaseException:
            payload_pool.release(staging)
            raise
        piece.decodes.append(self._decoders.submit(self._decode, header, staging))
        while len(piece.decodes) > MAX_PENDING_DECODES or (piece.decodes and piece.decodes[0].done()):
            self._settle(piece, piece.decodes.popleft())

    def _decode(self, header, staging) -> None:
        pin_transfer_thread()
        try:
            self.accept(header, staging)
        finally:
            payload_pool.release(staging)

    def _settle(self, piece: _Piece, future: Future) -> None:
        try:
            future.result()
        except TransferError as exc:
            piece.error = piece.error or str(exc)
        except Exception as exc:  # a decode bug: fail the transfers, keep the connection in step
            piece.error = piece.error or f"{type(exc).__name__}: {exc}"
            for transfer_id in piece.transfer_ids:
                self.fail(transfer_id, piece.error)

    def _wait_decodes(self, piece: _Piece) -> None:
        while piece.decodes:
            self._settle(piece, piece.decodes.popleft())

    def close(self) -> None:
        self._closed.set()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept loop (close alone does not)
        except OSError:
            pass
        self._listener.close()
        self._slots.close()
        with self._lock:
            connections = list(self._connections.values())
        for conn in connections:  # wakes each connection's thread; they fail what they carried
            _shut(conn)
        self._accepter.join(timeout=2)
        self._decoders.shutdown(wait=True)
        super().close()


def _shut(conn: socket.socket) -> None:
    """Wake and fail any read on ``conn`` (its thread closes it)."""
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _left(deadline: float | None) -> float | None:
    """Socket timeout until ``deadline`` (None: wait as long as it takes)."""
    return None if deadline is None else max(0.001, deadline - time.monotonic())


def _drain(conn: socket.socket, nbytes: int) -> None:
    """Read and drop ``nbytes`` (the rest of a refused chunk), keeping the connection in step."""
    scratch = bytearray(min(nbytes, DRAIN_BYTES))
    while nbytes > 0:
        step = min(nbytes, len(scratch))
        recv_buffers(conn, [memoryview(scratch)[:step]])
        nbytes -= step
