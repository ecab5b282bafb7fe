"""``BaseSender``: the sender plumbing every transport shares — handles, threads, handshake.

A transport subclasses ``BaseSender`` and implements two methods:
    _remote_handshake(dest, local) -> dict   exchange layouts with the receiver
    _ship(dest, chunks, deadline_at, transfer_id, sizes) -> int
        push what ``_prepare`` made of each chunk (``sizes``: every chunk's
        payload bytes, known before encoding), return wire bytes, raise
        TransferError
``send`` runs the encode pipeline and ``_ship`` on a worker thread and
drops every reference to the cache when the piece ends.
"""

from __future__ import annotations

import threading
import time
from abc import abstractmethod
from collections import OrderedDict
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor


from kv_transfer.buffers import tune_malloc
from kv_transfer.chunker import ChunkJob, EncodedChunk, encode_jobs, pipeline
from kv_transfer.codec import CodecError, get_codec
from kv_transfer.interface import FailedSide, KVPiece, KVSender, SendHandle, TransferError, TransferStatus
from kv_transfer.layout import HandshakeError, KVLayout, check_compatible
from kv_transfer.wire import DEFAULT_CHUNK_BYTES


MAX_DESTINATIONS = 256   # per-destination state (handshakes, connections) kept for this many peers

class BaseSender(KVSender):
    def __init__(
        self,
        layout: KVLayout,
        *,
        codec: str = "none",
        token: str = "",
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        max_workers: int = 4,
        prefetch_depth: int = 3,
        encode_workers: int = 1,
    ) -> None:
        tune_malloc()
        self.layout, self.codec, self.token = layout, get_codec(codec), token
        self.chunk_bytes, self.prefetch_depth, self.encode_workers = chunk_bytes, prefetch_depth, encode_workers
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="kv-send")
        self._encoders = ThreadPoolExecutor(max_workers=max(1, encode_workers), thread_name_prefix="kv-encode")
        self._handshaken: OrderedDict[str, None] = OrderedDict()   # LRU: destinations handshaken with
        self._lock = threading.Lock()

    def describe(self) -> dict[str, object]:
        return self.layout.describe(self.codec.name)

    def handshake(self, dest: str) -> None:
        with self._lock:
            if dest in self._handshaken:
                self._handshaken.move_to_end(dest)
                return
        local = self.describe()
        remote = self._remote_handshake(dest, local)
        check_compatible(local, remote)
        with self._lock:
            self._handshaken[dest] = None
            stale = list(self._handshaken)[:-MAX_DESTINATIONS]
        for old in stale:
            self.forget(old)

    def forget(self, dest: str) -> None:
        """Drop cached state for a destination (it died, was replaced, or is the least recently used
        of more than MAX_DESTINATIONS); transports drop their connections to it too."""
        with self._lock:
            self._handshaken.pop(dest, None)

    def send(self, piece: KVPiece, dest: str) -> SendHandle:
        handle = SendHandle(piece.request_id, piece.transfer_id)
        try:
            piece = piece.resolved(self.layout.num_layers)
            self.layout.check_cache(piece.kv_cache)
            piece.check(self.layout.num_layers)
        except ValueError as exc:
            handle._finish(TransferStatus.FAILED, str(exc), FailedSide.SENDER)
            return handle
        self.codec.prepare(piece.kv_cache)  # fast kernels build in the background; until then, the eager codec
        deadline_at = time.monotonic() + piece.deadline_s
        self._pool.submit(self._run, handle, dest, [piece], deadline_at)
        return handle

    def _run(self, handle: SendHandle, dest: str, held: list[KVPiece], deadline_at: float) -> None:
        """``held``: the piece, in a list this thread empties once the chunk jobs hold what they need,
        so that the pool's record of the call does not keep the cache alive."""
        try:
            self.handshake(dest)
            handle.status = TransferStatus.TRANSFERRING
            if held[0].ready is not None:  # the rows' writes are queued on a device stream: wait for them here
                held[0].ready.synchronize()
            jobs = self._jobs(held.pop(), deadline_at)  # the jobs hold the cache until they end; we do not
            chunks = _timed(handle, pipeline(jobs, self._encoders, self._prepare, self.prefetch_depth))
            handle.wire_bytes = self._ship(dest, chunks, deadline_at, handle.transfer_id, [job.nbytes for job in jobs])
            handle._finish(TransferStatus.DONE)
        except HandshakeError as exc:
            handle._finish(TransferStatus.FAILED, str(exc), FailedSide.RECEIVER)
        except CodecError as exc:
            handle._finish(TransferStatus.FAILED, str(exc), FailedSide.SENDER)
        except TransferError as exc:
            handle._finish(exc.status, str(exc), exc.side)
        except Exception as exc:  # transport bug or connection problem
            handle._finish(TransferStatus.FAILED, f"{type(exc).__name__}: {exc}", FailedSide.TRANSPORT)
        finally:
            held.clear()

    def _jobs(self, piece: KVPiece, deadline_at: float) -> list[ChunkJob]:
        """The piece's chunk jobs; a transport that sends some chunks another way (straight from the
        cache's rows) builds its own."""
        return encode_jobs(piece, self.layout, self.codec, deadline_at, self.chunk_bytes)

    def _prepare(self, chunk: EncodedChunk):
        """Per-chunk work a transport wants done on the encode thread (e.g. framing)."""
        return chunk

    @abstractmethod
    def _remote_handshake(self, dest: str, local: dict) -> dict: ...

    @abstractmethod
    def _ship(self, dest: str, chunks: Iterator, deadline_at: float, transfer_id: str, sizes: list[int]) -> int:
        """Push what ``_prepare`` made of each chunk; return wire bytes or raise TransferError."""

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._encoders.shutdown(wait=True, cancel_futures=True)


def _timed(handle: SendHandle, chunks: Iterator) -> Iterator:
    """``chunks``, stamping on ``handle`` when each is ready and goes to the transport."""
    for chunk in chunks:
        handle.chunk_at.append(time.monotonic())
        yield chunk
