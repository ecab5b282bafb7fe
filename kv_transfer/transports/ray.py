"""Ray transport: payloads through the object store (same node, zero-copy reads).

The receiver starts a small async ``inbox`` actor; its endpoint is
"ray://<actor name>". Senders ``ray.put`` each chunk's payload (numpy uint8)
and push (kind, piece id, token, msgpack header, [payload ref]) to the inbox;
a receiver thread pops items, reads payloads with ``ray.get`` (a read-only
view of shared memory), writes them into the cache, and acks each piece
(handshake or the last chunk of a send) through the inbox. Only bytes and
object refs cross; ``ray`` is imported lazily so kv_transfer stays ray-free.
Nothing grows with dead senders: the inbox drops acks whose sender stopped
waiting (and, after ACK_TTL_S, acks never asked for); the receiver forgets a
piece that stayed silent longer than its ``max_deadline_s``.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field

import msgpack

from kv_transfer.chunker import EncodedChunk
from kv_transfer.interface import FailedSide, TransferError, TransferStatus
from kv_transfer.layout import HandshakeError
from kv_transfer.receiver import BaseReceiver
from kv_transfer.sender import BaseSender
from kv_transfer.wire import MAX_HEADER_BYTES, WireError, readonly_tensor, unpack_header

PREFIX = "ray://"


ACK_TTL_S = 600.0  # an ack nobody collected (its sender died before asking) is dropped after this
MAX_ACKS = 4096  # acks kept at most, and pieces remembered as given up on


class _Inbox:
    """Mailbox actor body (wrapped with ray.remote lazily)."""

    def __init__(self) -> None:
        self.items: asyncio.Queue = asyncio.Queue()
        self.acks: OrderedDict[str, tuple[bytes, float]] = OrderedDict()  # piece id -> (reply, when), uncollected
        self.waiters: dict[str, asyncio.Event] = {}
        self.given_up: OrderedDict[str, None] = OrderedDict()  # pieces whose sender stopped waiting

    async def push(self, item: list) -> None:
        await self.items.put(item)

    async def pop(self, max_items: int, timeout_s: float) -> list:
        try:
            first = await asyncio.wait_for(self.items.get(), timeout_s)
        except asyncio.TimeoutError:
            return []
        batch = [first]
        while len(batch) < max_items and not self.items.empty():
            batch.append(self.items.get_nowait())
        return batch

    async def ack(self, piece_id: str, reply: bytes) -> None:
        if piece_id in self.given_up:  # a late ack: nobody will collect it
            return
        self.acks[piece_id] = (reply, time.monotonic())
        self.acks.move_to_end(piece_id)
        cutoff = time.monotonic() - ACK_TTL_S
        while self.acks and (len(self.acks) > MAX_ACKS or next(iter(self.acks.values()))[1] < cutoff):
            self.acks.popitem(last=False)
        if piece_id in self.waiters:
            self.waiters[piece_id].set()

    async def wait_ack(self, piece_id: str, timeout_s: float) -> bytes | None:
        if piece_id not in self.acks:
            event = self.waiters.setdefault(piece_id, asyncio.Event())
            try:
                await asyncio.wait_for(event.wait(), timeout_s)
            except asyncio.TimeoutError:
                self.given_up[piece_id] = None
                while len(self.given_up) > MAX_ACKS:
                    self.given_up.popitem(last=False)
                return None
            finally:
                self.waiters.pop(piece_id, None)
        reply = self.acks.pop(piece_id, None)
        return None if reply is None else reply[0]

    async def num_entries(self) -> int:
        """Acks and waiters held (given-up pieces are bounded separately)."""
        return len(self.acks) + len(self.waiters)


@dataclass(slots=True)
class _Piece:
    """What the receiver keeps of one send() in flight."""

    transfer_ids: set[str] = field(default_factory=set)
    error: str | None = None  # the first error: the rest of the piece is drained, then acked with it
    seen: float = field(default_factory=time.monotonic)  # when its last item came


def _ray():
    import ray  # lazy: only the ray transport needs it

    return ray


class RayReceiver(BaseReceiver):
    def __init__(self, layout, kv_cache, allocator, *, name: str | None = None, **kwargs):
        super().__init__(layout, kv_cache, allocator, **kwargs)
        ray = _ray()
        name = name or f"pdserve-kv-inbox-{uuid.uuid4().hex[:12]}"
        self._inbox = ray.remote(num_cpus=0, max_concurrency=64)(_Inbox).options(name=name).remote()
        self._endpoint = PREFIX + name
        self._closed = threading.Event()
        self._pieces: dict[str, _Piece] = {}  # piece id -> its state, touched by the receive thread only
        self._thread = threading.Thread(target=self._loop, name="kv-ray-recv", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        ray = _ray()
        while not self._closed.is_set():
            try:
                batch = ray.get(self._inbox.pop.remote(64, 0.2))
            except Exception:
                if self._closed.wait(0.1):
                    return
                continue
            for kind, piece_id, token, header_bytes, refs, is_last in batch:
                reply = self._handle(ray, kind, piece_id, token, header_bytes, refs)
                if reply is not None or is_last:
                    piece = self._pieces.pop(piece_id, None)
                    error = reply if reply is not None else (piece.error if piece is not None else None) or ""
                    answer = {"ok": not error, "error": error, "layout": self.describe()}
                    self._inbox.ack.remote(piece_id, msgpack.packb(answer))
            self._forget_silent_pieces()

    def _forget_silent_pieces(self) -> None:
        """A sender that died mid-piece never sends its last chunk: forget the piece once it has been
        silent longer than any transfer may live here (its transfers have expired by then)."""
        cutoff = time.monotonic() - self.max_deadline_s
        for piece_id in [piece_id for piece_id, piece in self._pieces.items() if piece.seen < cutoff]:
            del self._pieces[piece_id]

    def _handle(self, ray, kind, piece_id, token, header_bytes, refs) -> str | None:
        """Returns an error string to ack at once, or None to continue the piece."""
        if not isinstance(token, str) or not self.check_token(token):
            return "receiver rejected the cluster token"
        if kind == "handshake":
            try:
                self.check_handshake(msgpack.unpackb(header_bytes, raw=False, max_map_len=64))
            except Exception as exc:
                return str(exc)
            return ""
        if kind == "abort":  # the sender failed mid-piece: free what it reserved
            for transfer_id in self._pieces.get(piece_id, _Piece()).transfer_ids:
                self.fail(transfer_id, "sender aborted mid-transfer")
            return "sender aborted"
        piece = self._pieces.setdefault(piece_id, _Piece())
        piece.seen = time.monotonic()
        if piece.error is not None:
            return None
        try:
            if not isinstance(header_bytes, bytes) or len(header_bytes) > MAX_HEADER_BYTES or len(refs) != 1:
                raise WireError("malformed ray chunk")
            header = unpack_header(header_bytes)
            piece.transfer_ids.add(header.transfer_id)
            array = ray.get(refs[0])
            if array.nbytes != header.payload_len:
                self.fail(header.transfer_id, "truncated chunk")
                raise WireError(f"truncated chunk: {array.nbytes} bytes, header says {header.payload_len}")
            self.accept(header, readonly_tensor(array.reshape(-1)))
        except Exception as exc:
            piece.error = str(exc) or type(exc).__name__
        return None

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=2)
        try:
            _ray().kill(self._inbox)
        except Exception:
            pass
        super().close()


class RaySender(BaseSender):
    def _inbox(self, dest: str):
        if not dest.startswith(PREFIX):
            raise TransferError(f"bad ray endpoint {dest!r}; expected {PREFIX}<name>", FailedSide.SENDER)
        try:
            return _ray().get_actor(dest[len(PREFIX) :])
        except ValueError:
            raise TransferError(f"no KV inbox actor at {dest}", FailedSide.TRANSPORT) from None

    def _ask(self, inbox, piece_id: str, timeout_s: float) -> dict:
        reply = _ray().get(inbox.wait_ack.remote(piece_id, max(0.001, timeout_s)))
        if reply is None:
            raise TransferError("receiver did not answer before the deadline", FailedSide.TRANSPORT,
                                TransferStatus.EXPIRED)
        return msgpack.unpackb(reply, raw=False, max_map_len=64)

    def _remote_handshake(self, dest: str, local: dict) -> dict:
        inbox, piece_id = self._inbox(dest), uuid.uuid4().hex
        inbox.push.remote(["handshake", piece_id, self.token, msgpack.packb(local), [], True])
        answer = self._ask(inbox, piece_id, 10.0)
        if not answer["ok"]:
            error = str(answer["error"])
            raise HandshakeError(error) if "mismatch" in error else TransferError(error, FailedSide.RECEIVER)
        return answer["layout"]

    def _ship(self, dest: str, chunks: Iterator[EncodedChunk], deadline_at: float, transfer_id: str = "",
              sizes: list[int] | None = None) -> int:
        ray, inbox, piece_id = _ray(), self._inbox(dest), uuid.uuid4().hex
        refs, wire_bytes, pending = [], 0, None
        try:
            for chunk in chunks:
                if pending is not None:
                    inbox.push.remote(["chunk", piece_id, self.token, *pending, False])
                ref = ray.put(chunk.payload.cpu().numpy())  # copies into the object store
                chunk.release()
                refs.append(ref)  # keep objects alive until the receiver acked
                pending = (chunk.header_bytes, [ref])
                wire_bytes += len(chunk.header_bytes) + chunk.payload.numel()
        except Exception:
            if pending is not None:
                inbox.push.remote(["chunk", piece_id, self.token, *pending, False])
                inbox.push.remote(["abort", piece_id, self.token, b"", [], True])
            raise
        inbox.push.remote(["chunk", piece_id, self.token, *pending, True])
        answer = self._ask(inbox, piece_id, deadline_at - time.monotonic())
        if not answer["ok"]:
            raise TransferError(str(answer["error"]), FailedSide.RECEIVER)
        return wire_bytes
