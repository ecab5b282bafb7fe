"""In-process fake transport for tests and warm-up.

A ``FakeHub`` stands in for the network: receivers register on it under a
``fake://N`` endpoint, senders look them up. Chunks still go through the
real wire format (pack, frame, split, checksum), so everything but the
socket is exercised. ``FakeHub.tamper`` lets tests corrupt or drop frames.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator

from kv_transfer.base import FailedSide, TransferError, TransferStatus
from kv_transfer.chunker import EncodedChunk
from kv_transfer.receiver import CoreReceiver
from kv_transfer.sender_core import BaseSender
from kv_transfer.wire import WireError, pack_frame, split_frame


class FakeHub:
    def __init__(self) -> None:
        self._receivers: dict[str, FakeReceiver] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        # frame -> frame or None (drop the rest of the stream: the sender "died")
        self.tamper: Callable[[bytes], bytes | None] | None = None

    def register(self, receiver: FakeReceiver) -> str:
        with self._lock:
            endpoint = f"fake://{next(self._ids)}"
            self._receivers[endpoint] = receiver
        return endpoint

    def unregister(self, endpoint: str) -> None:
        with self._lock:
            self._receivers.pop(endpoint, None)

    def lookup(self, endpoint: str) -> FakeReceiver:
        with self._lock:
            receiver = self._receivers.get(endpoint)
        if receiver is None:
            raise TransferError(f"no fake receiver at {endpoint}", FailedSide.TRANSPORT)
        return receiver


class FakeReceiver(CoreReceiver):
    def __init__(self, layout, kv_cache, allocator, *, hub: FakeHub, **kwargs) -> None:
        super().__init__(layout, kv_cache, allocator, **kwargs)
        self.hub = hub
        self._endpoint = hub.register(self)

    def close(self) -> None:
        self.hub.unregister(self._endpoint)
        super().close()


class FakeSender(BaseSender):
    def __init__(self, layout, *, hub: FakeHub, **kwargs) -> None:
        super().__init__(layout, **kwargs)
        self.hub = hub

    def _receiver(self, dest: str) -> FakeReceiver:
        receiver = self.hub.lookup(dest)
        if not receiver.core.check_token(self.token):
            raise TransferError("receiver rejected the cluster token", FailedSide.RECEIVER)
        return receiver

    def _remote_handshake(self, dest: str, local: dict) -> dict:
        receiver = self._receiver(dest)
        receiver.core.check_handshake(local)
        return receiver.core.describe()

    def _ship(self, dest: str, chunks: Iterator[EncodedChunk], deadline_at: float, transfer_id: str = "", sizes: list[int] | None = None) -> int:
        receiver = self._receiver(dest)
        wire_bytes, transfer_id = 0, ""
        try:
            for chunk in chunks:
                transfer_id = chunk.header.transfer_id
                if time.monotonic() > deadline_at:
                    raise TransferError("send deadline passed", FailedSide.TRANSPORT, TransferStatus.EXPIRED)
                frame = pack_frame(chunk.header_bytes, chunk.payload.cpu().numpy())
                chunk.release()
                if self.hub.tamper is not None:
                    frame = self.hub.tamper(frame)
                    if frame is None:  # the sender vanished mid-stream
                        raise TransferError("stream dropped", FailedSide.TRANSPORT)
                try:
                    header, payload = split_frame(frame)
                except WireError as exc:
                    receiver.core.fail(transfer_id, str(exc))
                    raise TransferError(str(exc), FailedSide.RECEIVER) from None
                receiver.core.accept(header, payload)
                wire_bytes += len(frame)
        except Exception as exc:
            # Like a broken stream: the receiver frees what it reserved.
            if transfer_id and not (isinstance(exc, TransferError) and exc.side == FailedSide.RECEIVER):
                receiver.core.fail(transfer_id, f"sender aborted mid-transfer: {exc}")
            raise
        return wire_bytes
