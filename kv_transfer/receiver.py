"""``BaseReceiver``: the receiver state every transport shares — reserve, write, complete, free.

A transport subclasses it, sets ``_endpoint``, and from its own threads
checks peers (``check_token``, ``check_handshake``, ``describe``) and feeds
chunks to ``accept(header, payload)``; ``fail(transfer_id, error)`` reports a
broken stream. ``accept`` checks the header against the local layout,
reserves destination blocks on a transfer's first chunk (no more than its
tokens fill and ``max_blocks_share`` of the cache, for at most
``max_deadline_s``; later chunks must agree with it), decodes each chunk
straight into ``kv_cache[layers, dst_block_ids]`` and marks the transfer DONE
once every (layer, block) cell arrived (with the handoff of the chunks that carry one:
pieces streamed layer by layer before the first token was sampled carry none). Failures, expiry (reaper thread) and
cancel free the reserved blocks. Each transfer ends with exactly one
``TransferResult``; poll/wait/status/cancel/stats are the KVReceiver methods.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kv_transfer.buffers import scratch_pool, tune_malloc
from kv_transfer.codec import get_codec, pin_transfer_thread
from proto.internal_auth import token_matches
from kv_transfer.interface import (
    BlockAllocator,
    FailedSide,
    KVReceiver,
    ReceiverStats,
    TransferError,
    TransferResult,
    TransferStatus,
)
from kv_transfer.layout import HandshakeError, KVLayout, check_compatible
from kv_transfer.wire import MAX_PAYLOAD_BYTES, ChunkHeader, WireError, checked_payload, validate_header

MAX_FINISHED = 4096  # remembered terminal transfers (late chunks are refused)


@dataclass(slots=True)
class _Transfer:
    transfer_id: str
    request_id: str
    codec: str
    dst_block_ids: list[int]
    dst_index: torch.Tensor  # long [num_blocks] on the cache device
    covered: torch.Tensor  # bool [num_layers, num_blocks]
    deadline: float  # time.monotonic()
    num_tokens: int
    first_token_id: int
    handoff: bytes
    num_missing: int
    status: TransferStatus = TransferStatus.PENDING
    error: str = ""
    nbytes: int = 0
    writers: int = 0  # chunks writing into the blocks right now, outside the lock
    started: float = 0.0  # time.monotonic(): its first chunk arrived (timelines)
    last_chunk_at: float = 0.0  # ... its latest chunk arrived
    lock: threading.Condition = field(default_factory=threading.Condition)

    def refuse_if_ended(self) -> None:
        if self.status.is_terminal:
            raise TransferError(f"transfer {self.transfer_id} is {self.status.value}: {self.error}",
                                FailedSide.RECEIVER)


class BaseReceiver(KVReceiver):
    def __init__(
        self,
        layout: KVLayout,
        kv_cache: torch.Tensor,  # [num_layers, num_blocks, 2, H, B, D]
        allocator: BlockAllocator,
        *,
        codec: str = "none",
        token: str = "",
        on_complete: Callable[[TransferResult], None] | None = None,
        default_timeout_s: float = 30.0,
        max_payload: int = MAX_PAYLOAD_BYTES,
        reap_interval_s: float = 0.05,
        max_deadline_s: float | None = None,
        max_blocks_share: float = 1.0,
    ) -> None:
        """``default_timeout_s``: a transfer's deadline when its chunks carry none; ``max_deadline_s``
        (default: ``default_timeout_s``) caps the deadline a chunk asks for; ``max_blocks_share``: the
        share of the cache's blocks one transfer may reserve."""
        tune_malloc()
        if not 0 < max_blocks_share <= 1:
            raise ValueError(f"max_blocks_share must be in (0, 1], got {max_blocks_share}")
        layout.check_cache(kv_cache)
        get_codec(codec).prepare(kv_cache)  # start building fast kernels, so the first transfers find them ready
        self.layout, self.kv_cache, self.allocator = layout, kv_cache, allocator
        self.codec, self.token, self.on_complete = codec, token, on_complete
        self.default_timeout_s, self.max_payload = default_timeout_s, max_payload
        self.max_deadline_s = default_timeout_s if max_deadline_s is None else max_deadline_s
        self.max_transfer_blocks = max(1, int(kv_cache.shape[1] * max_blocks_share))
        self._stats = ReceiverStats()
        self._active: dict[str, _Transfer] = {}
        self._finished: OrderedDict[str, TransferResult] = OrderedDict()
        self._ready: list[TransferResult] = []
        self._cond = threading.Condition()
        self._stop_reaper = threading.Event()  # set by close(); a transport stops its own threads first
        self._reaper = threading.Thread(target=self._reap, args=(reap_interval_s,), name="kv-reaper", daemon=True)
        self._reaper.start()
        self._endpoint = ""  # the transport sets it

    @property
    def endpoint(self) -> str:
        return self._endpoint

    @property
    def stats(self) -> ReceiverStats:
        return self._stats

    # --- checks a transport runs before accepting chunks -------------------
    def describe(self) -> dict[str, object]:
        return self.layout.describe(self.codec)

    def check_token(self, token: object, expected: str | None = None) -> bool:
        """Constant-time check of a peer's token, or with ``expected`` of a proof derived from it (torch
        rendezvous); each failure is counted in ``stats.auth_failures``."""
        ok = token_matches(token if isinstance(token, str) else "", self.token if expected is None else expected)
        if not ok:
            with self._cond:
                self._stats.auth_failures += 1
        return ok

    def check_handshake(self, remote: dict) -> None:
        try:
            check_compatible(remote, self.describe())
        except HandshakeError:
            with self._cond:
                self._stats.handshake_failures += 1
            raise

    # --- the data path ------------------------------------------------------
    def accept(self, header: ChunkHeader, payload) -> None:
        """Write one chunk. ``payload``: bytes-like or uint8 tensor [payload_len].

        Raises:
            TransferError: the chunk was refused; the transfer is failed and its
                blocks freed (side RECEIVER).
        """
        pin_transfer_thread()
        self.check_header(header)
        try:
            payload = checked_payload(header, payload)
        except WireError as exc:
            self._fail_unknown(header, str(exc))
            raise TransferError(str(exc), FailedSide.RECEIVER) from None
        transfer = self.begin_write(header)
        if payload.device != self.kv_cache.device:  # decode where the cache lives (GPU)
            payload = payload.to(self.kv_cache.device)
        layers, block_slice = (header.layer_start, header.layer_end), slice(header.block_start, header.block_end)
        try:  # decode into kv_cache[l0:l1, dst_ids[b0:b1]] unlocked: chunks (disjoint cells) decode in
            # parallel on the transport's threads; a failure frees blocks once writes drain (_finish)
            with scratch_pool.lease() as scratch:
                get_codec(header.codec).decode_into(payload, header.shape, self.kv_cache, layers,
                                                    transfer.dst_index[block_slice], scratch)
        except BaseException:
            self.end_write(header, transfer, written=False)
            raise
        self.end_write(header, transfer)

    def check_header(self, header: ChunkHeader) -> None:
        """Check a chunk header against the local layout and bounds; TransferError (side RECEIVER) when refused."""
        try:
            validate_header(header, self.describe(), self.max_payload)
        except (HandshakeError, WireError, ValueError) as exc:
            if isinstance(exc, HandshakeError):
                with self._cond:
                    self._stats.handshake_failures += 1
            self._fail_unknown(header, str(exc))
            raise TransferError(str(exc), FailedSide.RECEIVER) from None

    def begin_write(self, header: ChunkHeader) -> _Transfer:
        """Reserve the transfer's blocks on its first chunk and count a writer into them.

        For a header ``check_header`` passed. The caller writes the chunk's cells
        (``kv_cache[l0:l1, transfer.dst_block_ids[b0:b1]]``) itself, then calls
        ``end_write``: until then the blocks are not freed, whatever ends the transfer.
        """
        transfer = self._reserved(header)
        with transfer.lock:
            transfer.refuse_if_ended()
            transfer.status = TransferStatus.TRANSFERRING
            transfer.writers += 1
        return transfer

    def _reserved(self, header: ChunkHeader) -> _Transfer:
        """The chunk's transfer, its blocks reserved on its first chunk; a chunk that claims another block
        count than its transfer's fails the transfer."""
        transfer = self._get_or_reserve(header)
        if header.num_blocks != transfer.covered.shape[1]:
            error = (f"chunk {header.chunk_index} claims {header.num_blocks} blocks; its transfer has "
                     f"{transfer.covered.shape[1]}")
            self.fail(header.transfer_id, error)
            raise TransferError(error, FailedSide.RECEIVER)
        return transfer

    def end_write(self, header: ChunkHeader, transfer: _Transfer, written: bool = True) -> None:
        """The chunk's cells are written (``written``), or the write broke off: then the caller fails it."""
        with transfer.lock:
            transfer.writers -= 1
            transfer.lock.notify_all()
        if not written:
            return
        with transfer.lock:
            transfer.refuse_if_ended()
            cells = transfer.covered[header.layer_start : header.layer_end, header.block_start : header.block_end]
            transfer.num_missing -= int((~cells).sum())
            cells.fill_(True)
            transfer.nbytes += header.payload_len
            if header.first_token_id >= 0 or header.handoff:  # layer-wise: the last piece brings the handoff
                transfer.first_token_id, transfer.handoff = header.first_token_id, header.handoff
            result = self._finish(transfer, TransferStatus.DONE) if transfer.num_missing == 0 else None
        if result is not None:
            self._publish(result)

    def _get_or_reserve(self, header: ChunkHeader) -> _Transfer:
        with self._cond:
            transfer = self._active.get(header.transfer_id)
            if transfer is not None:
                transfer.last_chunk_at = time.monotonic()
                return transfer
            done = self._finished.get(header.transfer_id)
            if done is not None:
                raise TransferError(f"transfer {header.transfer_id} is already {done.status.value}: {done.error}",
                                    FailedSide.RECEIVER)
            too_many = header.num_blocks > self.max_transfer_blocks
            dst_block_ids = None if too_many else self._allocate(header.transfer_id, header.num_blocks)
            if dst_block_ids is None:
                error = f"receiver has no room: {header.num_blocks} KV blocks needed"
                if too_many:
                    error = (f"transfer asks for {header.num_blocks} KV blocks; one transfer gets at most "
                             f"{self.max_transfer_blocks} of this receiver's {self.kv_cache.shape[1]}")
                result = TransferResult(header.transfer_id, header.request_id, TransferStatus.FAILED, error=error)
                self._remember(result)
                self._stats.num_failed += 1
            else:
                num_layers, num_blocks = header.num_layers, header.num_blocks
                deadline_s = header.deadline_ms / 1000 if header.deadline_ms > 0 else self.default_timeout_s
                deadline_s = min(deadline_s, self.max_deadline_s)  # a sender cannot hold blocks longer
                transfer = _Transfer(
                    transfer_id=header.transfer_id,
                    request_id=header.request_id,
                    codec=header.codec,
                    dst_block_ids=list(dst_block_ids),
                    dst_index=torch.tensor(dst_block_ids, dtype=torch.long, device=self.kv_cache.device),
                    covered=torch.zeros(num_layers, num_blocks, dtype=torch.bool),
                    deadline=time.monotonic() + deadline_s,
                    num_tokens=header.num_tokens,
                    first_token_id=header.first_token_id,
                    handoff=header.handoff,
                    num_missing=num_layers * num_blocks,
                )
                transfer.started = transfer.last_chunk_at = time.monotonic()
                self._active[header.transfer_id] = transfer
                return transfer
        self._publish_only(result)
        raise TransferError(error, FailedSide.RECEIVER)

    def _allocate(self, transfer_id: str, num_blocks: int) -> list[int] | None:
        """Reserve a transfer's blocks: by transfer id from an allocator that shares them between receivers
        (`kv_transfer.resharded.TransferBlocks`: each rank of a tensor-parallel decode actor), else any."""
        by_transfer = getattr(self.allocator, "allocate_transfer", None)
        return by_transfer(transfer_id, num_blocks) if by_transfer else self.allocator.allocate(num_blocks)

    def _free(self, transfer_id: str, block_ids: list[int]) -> None:
        by_transfer = getattr(self.allocator, "free_transfer", None)
        by_transfer(transfer_id, block_ids) if by_transfer else self.allocator.free(block_ids)

    # --- terminal transitions -----------------------------------------------
    def _finish(self, transfer: _Transfer, status: TransferStatus, error: str = "") -> TransferResult:
        """Caller holds ``transfer.lock``. Frees blocks unless DONE, once no chunk writes into them."""
        transfer.status, transfer.error = status, error
        dst_block_ids = transfer.dst_block_ids if status == TransferStatus.DONE else []
        if status != TransferStatus.DONE:
            transfer.lock.wait_for(lambda: transfer.writers == 0)  # the terminal status stops new ones
            self._free(transfer.transfer_id, transfer.dst_block_ids)
        transfer.dst_block_ids = []
        now = time.monotonic()
        return TransferResult(transfer.transfer_id, transfer.request_id, status, dst_block_ids=dst_block_ids,
                              num_tokens=transfer.num_tokens, first_token_id=transfer.first_token_id,
                              handoff=transfer.handoff,
                              codec=transfer.codec, error=error, nbytes=transfer.nbytes, done_at=now,
                              receive_s=now - transfer.started, receive_tail_s=now - transfer.last_chunk_at)

    def _remember(self, result: TransferResult) -> None:
        """Caller holds ``self._cond``."""
        self._active.pop(result.transfer_id, None)
        self._finished[result.transfer_id] = result
        while len(self._finished) > MAX_FINISHED:
            self._finished.popitem(last=False)

    def _publish(self, result: TransferResult) -> None:
        with self._cond:
            self._remember(result)
            counter = {
                TransferStatus.DONE: "num_done",
                TransferStatus.FAILED: "num_failed",
                TransferStatus.EXPIRED: "num_expired",
                TransferStatus.CANCELLED: "num_cancelled",
            }[result.status]
            setattr(self._stats, counter, getattr(self._stats, counter) + 1)
            self._stats.bytes_received += result.nbytes
        self._publish_only(result)

    def _publish_only(self, result: TransferResult) -> None:
        with self._cond:
            self._ready.append(result)
            self._cond.notify_all()
        if self.on_complete is not None:
            try:
                self.on_complete(result)
            except Exception:  # a callback bug must not kill the transport thread
                pass

    def _end(self, transfer_id: str, status: TransferStatus, error: str) -> bool:
        with self._cond:
            transfer = self._active.get(transfer_id)
        if transfer is None:
            return False
        with transfer.lock:
            if transfer.status.is_terminal:
                return False
            result = self._finish(transfer, status, error)
        self._publish(result)
        return True

    def fail(self, transfer_id: str, error: str, status: TransferStatus = TransferStatus.FAILED) -> bool:
        """Fail an active transfer and free its blocks; False if it was not active."""
        return self._end(transfer_id, status, error)

    def _fail_unknown(self, header: ChunkHeader, error: str) -> None:
        if not self.fail(header.transfer_id, error):
            with self._cond:
                if header.transfer_id in self._finished:
                    return
                result = TransferResult(header.transfer_id, header.request_id, TransferStatus.FAILED, error=error)
                self._remember(result)
                self._stats.num_failed += 1
            self._publish_only(result)

    def cancel(self, transfer_id: str | None = None, request_id: str | None = None) -> list[str]:
        with self._cond:
            ids = [t.transfer_id for t in self._active.values()
                   if t.transfer_id == transfer_id or t.request_id == request_id]
            if transfer_id is not None and transfer_id not in self._active and transfer_id not in self._finished:
                # Tombstone: chunks that arrive later are refused, nothing is reserved.
                self._finished[transfer_id] = TransferResult(transfer_id, request_id or "", TransferStatus.CANCELLED,
                                                             error="cancelled by the decode worker")
        return [tid for tid in ids if self._end(tid, TransferStatus.CANCELLED, "cancelled by the decode worker")]

    def _reap(self, interval_s: float) -> None:
        while not self._stop_reaper.wait(interval_s):
            now = time.monotonic()
            with self._cond:
                expired = [t.transfer_id for t in self._active.values() if t.deadline < now]
            for transfer_id in expired:
                self._end(transfer_id, TransferStatus.EXPIRED, "deadline passed before all KV chunks arrived")
            self._reap_transport(now)

    def _reap_transport(self, now: float) -> None:
        """A transport's own expiries, on the reaper thread (the gRPC receiver's calls open too long)."""

    # --- what the decode worker reads --------------------------------------
    def poll(self) -> list[TransferResult]:
        with self._cond:
            ready, self._ready = self._ready, []
        return ready

    def wait(self, transfer_id: str, timeout: float | None = None) -> TransferResult | None:
        with self._cond:
            self._cond.wait_for(lambda: transfer_id in self._finished, timeout)
            return self._finished.get(transfer_id)

    def status(self, transfer_id: str) -> TransferStatus | None:
        with self._cond:
            if transfer_id in self._finished:
                return self._finished[transfer_id].status
            transfer = self._active.get(transfer_id)
            return transfer.status if transfer is not None else None

    @property
    def num_active(self) -> int:
        with self._cond:
            return len(self._active)

    def close(self) -> None:
        self._stop_reaper.set()
        with self._cond:
            active = list(self._active)
        for transfer_id in active:
            self._end(transfer_id, TransferStatus.FAILED, "receiver closed")
        self._reaper.join(timeout=1)
