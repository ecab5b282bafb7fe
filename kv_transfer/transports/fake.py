"""In-process stand-ins for tests, benchmarks and warm-up: the fake transport and a block pool.

A ``FakeHub`` stands in for the network: receivers register on it under a
``fake://N`` endpoint, senders look them up. Chunks still go through the
real wire format (pack, frame, split, checksum), so everything but the
socket is exercised. ``FakeHub.tamper`` lets tests corrupt or drop frames.
``SimpleBlockPool`` stands in for the decode actor's block manager (a
``BlockAllocator`` with exact ids and a leak check).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator

from kv_transfer.chunker import EncodedChunk
from kv_transfer.interface import FailedSide, TransferError, TransferStatus
from kv_transfer.receiver import BaseReceiver
from kv_transfer.sender import BaseSender
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


class FakeReceiver(BaseReceiver):
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
        if not receiver.check_token(self.token):
            raise TransferError("receiver rejected the cluster token", FailedSide.RECEIVER)
        return receiver

    def _remote_handshake(self, dest: str, local: dict) -> dict:
        receiver = self._receiver(dest)
        receiver.check_handshake(local)
        return receiver.describe()

    def _ship(self, dest: str, chunks: Iterator[EncodedChunk], deadline_at: float, transfer_id: str = "",
              sizes: list[int] | None = None) -> int:
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
                    receiver.fail(transfer_id, str(exc))
                    raise TransferError(str(exc), FailedSide.RECEIVER) from None
                receiver.accept(header, payload)
                wire_bytes += len(frame)
        except Exception as exc:
            # Like a broken stream: the receiver frees what it reserved.
            if transfer_id and not (isinstance(exc, TransferError) and exc.side == FailedSide.RECEIVER):
                receiver.fail(transfer_id, f"sender aborted mid-transfer: {exc}")
            raise
        return wire_bytes


class SimpleBlockPool:
    """A thread-safe in-memory allocator for tests and warm-up.

    Hands out the lowest free ids first (so tests can assert exact ids) and
    asserts on double frees; ``num_used`` == 0 is the leak check.
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks))
        self._used: set[int] = set()
        self._lock = threading.Lock()

    @property
    def num_used(self) -> int:
        with self._lock:
            return len(self._used)

    @property
    def num_free(self) -> int:
        with self._lock:
            return len(self._free)

    @property
    def used_ids(self) -> set[int]:
        with self._lock:
            return set(self._used)

    def can_allocate(self, num_blocks: int) -> bool:
        with self._lock:
            return len(self._free) >= num_blocks

    def allocate(self, num_blocks: int) -> list[int] | None:
        with self._lock:
            if num_blocks > len(self._free):
                return None
            self._free.sort()
            block_ids, self._free = self._free[:num_blocks], self._free[num_blocks:]
            self._used.update(block_ids)
            return block_ids

    def take(self, block_ids: list[int]) -> None:
        """Mark specific ids used (tests use it to force non-contiguous allocations)."""
        with self._lock:
            for block_id in block_ids:
                assert block_id not in self._used, f"block {block_id} already used"
                self._free.remove(block_id)
                self._used.add(block_id)

    def free(self, block_ids: list[int]) -> None:
        with self._lock:
            for block_id in block_ids:
                assert block_id in self._used, f"double free of block {block_id}"
                self._used.remove(block_id)
                self._free.append(block_id)
