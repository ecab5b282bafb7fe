"""The KV transfer interface: one ABC per side, a status enum, typed results.

Prefill side (``KVSender``, owned by a prefill actor):
    send(piece: KVPiece, dest) -> SendHandle
        Ship ``piece.kv_cache[piece.layers, piece.block_ids[piece.blocks]]`` to
        ``dest`` in the background. Call once with all layers and blocks, or
        once per piece (layer range x block range) as prefill produces them
        (same ``transfer_id``, same ``block_ids``: the transfer's whole block
        list); the receiver gets the same bytes. The receiver reports DONE once
        every cell arrived, with the handoff of the chunks that carry one
        (layer-wise streaming sends it with the last piece). The source blocks
        must stay unchanged until the handle is done; after DONE or FAILED the
        sender holds no reference to the cache.
    handshake(dest) -> None
        Compare layouts with the receiver now (``send`` does it lazily once per
        destination). Raises HandshakeError naming both values on a mismatch.
    close() -> None

    SendHandle.status / .error / .failed_side / .wire_bytes
    SendHandle.wait(timeout) -> TransferStatus;  SendHandle.done() -> bool

Decode side (``KVReceiver``, owned by a decode actor, given its cache tensor
and a ``BlockAllocator``):
    endpoint -> str            address to advertise to prefill actors
    poll() -> list[TransferResult]
        Terminal results (DONE / FAILED / EXPIRED / CANCELLED) since the last
        poll — the decode loop calls it between steps.
    wait(transfer_id, timeout) -> TransferResult | None
    status(transfer_id) -> TransferStatus | None   (None: never seen)
    cancel(transfer_id=None, request_id=None) -> list[str]
        Abort transfers and free their reserved blocks (never DONE ones: those
        blocks belong to the decode worker already).
    stats -> ReceiverStats;   close() -> None
    ``on_complete`` (constructor argument) is called once per terminal result,
    from a transport thread, besides the poll queue.

Lifecycle of one transfer on the receiver:
    first chunk arrives -> PENDING: header checked, blocks reserved
    chunks written into kv_cache[layers, dst_block_ids] -> TRANSFERRING
    every (layer, block) cell written -> DONE (blocks handed over)
    bad chunk / sender gone / no blocks -> FAILED, deadline -> EXPIRED,
    cancel() -> CANCELLED; all three free the reserved blocks.

Block pool (``BlockAllocator``, implemented by the decode actor's block manager):
    allocate(num_blocks) -> list[int] | None   reserve blocks for an incoming transfer
    free(block_ids) -> None                    give them back (failed, expired, cancelled)
    The receiver calls both from transport threads; after DONE the blocks
    belong to the decode worker, which frees them itself.

Where they are implemented: ``kv_transfer.sender.BaseSender`` and
``kv_transfer.receiver.BaseReceiver`` hold what every transport shares;
``kv_transfer.transports`` holds one module (or package) per transport.
"""

from __future__ import annotations

import enum
import threading
import time
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace
from typing import Protocol, runtime_checkable

import torch


class TransferStatus(enum.Enum):
    PENDING = "pending"
    TRANSFERRING = "transferring"
    DONE = "done"
    FAILED = "failed"
    EXPIRED = "expired"
    CANCELLED = "cancelled"

    @property
    def is_terminal(self) -> bool:
        return self in (TransferStatus.DONE, TransferStatus.FAILED, TransferStatus.EXPIRED,
                        TransferStatus.CANCELLED)


class FailedSide(enum.Enum):
    NONE = "none"
    SENDER = "sender"  # encode error, bad arguments, NaN/Inf in the KV
    RECEIVER = "receiver"  # refused: token, handshake, no blocks, checksum, expired
    TRANSPORT = "transport"  # connection lost, peer died, deadline on the wire


class TransferError(RuntimeError):
    """A transfer failed; ``side`` says which end."""

    def __init__(self, message: str, side: FailedSide, status: TransferStatus = TransferStatus.FAILED) -> None:
        super().__init__(message)
        self.side = side
        self.status = status


@dataclass(slots=True)
class TransferResult:
    """One terminal report from the receiver: what the decode worker adopts.

    The prefill side's ``num_tokens`` and ``first_token_id`` ride in every chunk
    header (the handoff travels with the KV); once DONE, ``dst_block_ids`` are
    the decode actor's blocks holding the request's KV, in token order.
    """

    transfer_id: str
    request_id: str
    status: TransferStatus
    dst_block_ids: list[int] = field(default_factory=list)  # empty unless DONE
    num_tokens: int = 0
    first_token_id: int = -1
    handoff: bytes = b""
    codec: str = ""
    error: str = ""
    nbytes: int = 0  # wire bytes received
    # Timeline (the receiver's monotonic clock): when it was done; first and last chunk received → done.
    done_at: float = 0.0
    receive_s: float = 0.0
    receive_tail_s: float = 0.0


@dataclass(frozen=True, slots=True)
class KVPiece:
    """What one ``send`` ships: the cells ``kv_cache[layers, block_ids[blocks]]`` of one transfer.

    ``block_ids`` is the transfer's whole block list, in token order (any ids; every piece of a
    transfer passes the same list); ``layers`` and ``blocks`` (a range into ``block_ids``) pick this
    piece's rectangle, None meaning all. ``num_tokens``, ``first_token_id`` and ``handoff`` reach the
    receiver's TransferResult (``handoff``: opaque bytes for the decode side, in every chunk header);
    pieces sent before the first token is known leave them unset and a later piece sets them.
    ``deadline_s`` bounds the whole transfer, and the receiver expires it too. ``ready``: None, or an
    event (``.synchronize()``) marking the rows' device writes done; the sender's thread waits on it
    before reading them (never the caller's stream).
    """

    request_id: str
    kv_cache: torch.Tensor  # [num_layers, num_blocks, 2, num_kv_heads, block_size, head_dim], or a head view of one
    block_ids: tuple[int, ...] | list[int]
    transfer_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    layers: tuple[int, int] | None = None
    blocks: tuple[int, int] | None = None
    deadline_s: float = 30.0
    num_tokens: int = 0
    first_token_id: int = -1
    handoff: bytes = b""
    ready: object | None = None

    def resolved(self, num_layers: int) -> KVPiece:
        """This piece with its ranges made explicit (``layers``/``blocks`` None -> all) and ids a tuple."""
        return replace(self, block_ids=tuple(self.block_ids), layers=tuple(self.layers or (0, num_layers)),
                       blocks=tuple(self.blocks or (0, len(self.block_ids))))

    def check(self, num_layers: int) -> None:
        """ValueError naming the range that does not fit the cache (call on a resolved piece)."""
        if not (0 <= self.layers[0] < self.layers[1] <= num_layers):
            raise ValueError(f"bad layer range {self.layers} for {num_layers} layers")
        if not self.block_ids or min(self.block_ids) < 0 or max(self.block_ids) >= self.kv_cache.shape[1]:
            raise ValueError(f"block_ids must be non-empty ids in [0, {self.kv_cache.shape[1]})")
        if not (0 <= self.blocks[0] < self.blocks[1] <= len(self.block_ids)):
            raise ValueError(f"bad block range {self.blocks} for {len(self.block_ids)} blocks")


@dataclass(slots=True)
class ReceiverStats:
    num_done: int = 0
    num_failed: int = 0
    num_expired: int = 0
    num_cancelled: int = 0
    auth_failures: int = 0
    handshake_failures: int = 0
    bad_hellos: int = 0     # connections dropped before they authenticated: malformed, too slow, evicted
    bytes_received: int = 0


class SendHandle:
    """Status of one ``send`` call (one piece of a transfer)."""

    def __init__(self, request_id: str, transfer_id: str) -> None:
        self.request_id = request_id
        self.transfer_id = transfer_id
        self.status = TransferStatus.PENDING
        self.error = ""
        self.failed_side = FailedSide.NONE
        self.wire_bytes = 0
        self.started_at = time.perf_counter()
        self.elapsed_s = 0.0
        self.chunk_at: list[float] = []  # time.monotonic() as each chunk went to the transport (timelines)
        self._event = threading.Event()
        self._callbacks: list = []
        self._callbacks_lock = threading.Lock()

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> TransferStatus:
        self._event.wait(timeout)
        return self.status

    def add_done_callback(self, fn) -> None:
        """Call ``fn(handle)`` once the send ends (at once if it has), on the thread that ends it: a
        worker's loop is woken instead of polling its handles."""
        with self._callbacks_lock:
            if not self._event.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    def _finish(self, status: TransferStatus, error: str = "", side: FailedSide = FailedSide.NONE) -> None:
        self.status, self.error, self.failed_side = status, error, side
        self.elapsed_s = time.perf_counter() - self.started_at
        with self._callbacks_lock:
            self._event.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn(self)

    def __repr__(self) -> str:
        return (f"SendHandle({self.transfer_id}, {self.status.value}, side={self.failed_side.value}, "
                f"error={self.error!r})")


class KVSender(ABC):
    @abstractmethod
    def send(self, piece: KVPiece, dest: str) -> SendHandle:
        """Ship ``piece`` to the receiver at ``dest`` (its ``endpoint`` string) in the background.

        Returns a SendHandle; never raises for transfer errors (see handle.status,
        handle.failed_side, handle.error).
        """

    @abstractmethod
    def handshake(self, dest: str) -> None: ...

    @abstractmethod
    def close(self) -> None: ...


class KVReceiver(ABC):
    @property
    @abstractmethod
    def endpoint(self) -> str: ...

    @abstractmethod
    def poll(self) -> list[TransferResult]:
        """Terminal results since the last call (each transfer reports exactly once)."""

    @abstractmethod
    def wait(self, transfer_id: str, timeout: float | None = None) -> TransferResult | None:
        """Block until ``transfer_id`` ends (None on timeout); does not consume it from ``poll``."""

    @abstractmethod
    def status(self, transfer_id: str) -> TransferStatus | None: ...

    @abstractmethod
    def cancel(self, transfer_id: str | None = None, request_id: str | None = None) -> list[str]:
        """Abort active transfers (their blocks are freed); returns the ids cancelled.

        Cancelling a transfer id not seen yet leaves a tombstone: its chunks are refused.
        """

    @property
    @abstractmethod
    def stats(self) -> ReceiverStats: ...

    @abstractmethod
    def close(self) -> None: ...


@runtime_checkable
class BlockAllocator(Protocol):
    """The receiver's view of the decode actor's block pool.

    The decode actor owns the allocator; the receiver only reserves blocks for
    an incoming transfer and gives them back if the transfer fails, expires or
    is cancelled. After DONE the blocks belong to the decode worker.
    """

    def allocate(self, num_blocks: int) -> list[int] | None:
        """Reserve ``num_blocks`` block ids (any order); None when not enough are free."""

    def free(self, block_ids: list[int]) -> None:
        """Return block ids to the pool."""
