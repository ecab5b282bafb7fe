"""KV transfer of a tensor-parallel actor across its ranks' processes (kv_transfer/resharded.py in Ray).

Rank 0 (the serving actor) builds the resharded sender or receiver; the copies whose rank is another one
run in that rank's process (`RankActor`), reached through the proxies here:

- decode side: `RemoteReceiver` stands for a copy's receiver on rank r. That receiver reserves its blocks
  from rank 0's `TransferBlocks` (`RankBlocks`: a Ray call to rank 0 per transfer) and reports its result
  to rank 0's `ReshardedReceiver` (`ServingActor.copy_done`), which publishes the transfer once every
  rank has all of its cells;
- prefill side: `RemoteSender` sends a copy from rank r's own cache (`RankActor.send_copy`), the piece's
  ranges and handoff given, and finishes its handle when rank r's send ends.

Calls from a rank into rank 0 never wait on a call back into that rank, and rank 0 answers them on its
event loop without blocking (a copy's result is handed to a thread), so no two processes wait on each other.
"""
from __future__ import annotations

import dataclasses
import logging
import threading

from kv_transfer import KVLayout, KVPiece, make_receiver, make_sender
from kv_transfer.interface import (
    FailedSide, KVReceiver, KVSender, ReceiverStats, SendHandle, TransferResult, TransferStatus,
)
from kv_transfer.resharded import head_view

log = logging.getLogger(f"pdserve.{__name__}")
CALL_TIMEOUT_S = 30.0


# ---- on rank r: what rank 0 asks of it ------------------------------------------
class RankBlocks:
    """A copy receiver's block pool on rank r: rank 0's `TransferBlocks`, by Ray call."""

    def __init__(self, rank0):
        self.rank0 = rank0

    def allocate_transfer(self, transfer_id: str, num_blocks: int) -> list[int] | None:
        import ray
        return ray.get(self.rank0.allocate_transfer.remote(transfer_id, num_blocks), timeout=CALL_TIMEOUT_S)

    def free_transfer(self, transfer_id: str, block_ids: list[int]) -> None:
        import ray
        ray.get(self.rank0.free_transfer.remote(transfer_id), timeout=CALL_TIMEOUT_S)

    def allocate(self, num_blocks: int):            # BlockAllocator; every copy reserves by transfer id
        raise NotImplementedError("a copy receiver reserves by transfer id")

    def free(self, block_ids: list[int]) -> None:
        raise NotImplementedError("a copy receiver frees by transfer id")


class RankTransfers:
    """The copy receivers and senders of one rank r > 0 (held by its `RankActor`)."""

    def __init__(self, kv_cache, device):
        self.kv_cache, self.device = kv_cache, device
        self.receivers: dict[str, KVReceiver] = {}
        self.senders: dict[tuple[int, int], KVSender] = {}
        self._lock = threading.Lock()

    def open_receiver(self, key: str, transfer, layout: KVLayout, heads: range, rank0) -> str:
        def report(result: TransferResult) -> None:
            rank0.copy_done.remote(result)

        receiver = make_receiver(transfer, layout, head_view(self.kv_cache, heads, layout), RankBlocks(rank0), report)
        with self._lock:
            self.receivers[key] = receiver
        return receiver.endpoint

    def send(self, transfer, layout: KVLayout, heads: range, piece: dict, dest: str) -> tuple:
        key = (heads.start, heads.stop)
        with self._lock:
            sender = self.senders.get(key)
            if sender is None:
                sender = self.senders[key] = make_sender(transfer, layout, self.device)
        handle = sender.send(KVPiece(kv_cache=head_view(self.kv_cache, heads, layout), **piece), dest)
        handle.wait(piece.get("deadline_s", 30.0) + CALL_TIMEOUT_S)
        return handle.status.value, handle.error, handle.failed_side.value, handle.wire_bytes

    def close(self) -> None:
        with self._lock:
            parts = [*self.receivers.values(), *self.senders.values()]
            self.receivers, self.senders = {}, {}
        for part in parts:
            part.close()


# ---- on rank 0: stand-ins for the other ranks' copies ----------------------------------
class RemoteReceiver(KVReceiver):
    """Rank 0's view of a copy receiver on another rank (`ReshardedReceiver` asks only these calls)."""

    remote = True

    def __init__(self, rank, key: str, endpoint: str):
        self.rank, self.key, self._endpoint = rank, key, endpoint

    @property
    def endpoint(self) -> str:
        return self._endpoint

    def status(self, transfer_id: str) -> TransferStatus | None:
        import ray
        value = ray.get(self.rank.copy_status.remote(self.key, transfer_id), timeout=CALL_TIMEOUT_S)
        return None if value is None else TransferStatus(value)

    def cancel(self, transfer_id: str | None = None, request_id: str | None = None) -> list[str]:
        self.rank.cancel_copy.remote(self.key, transfer_id, request_id)      # its result reports the cancel
        return []

    @property
    def stats(self) -> ReceiverStats:
        import ray
        try:
            return ReceiverStats(**ray.get(self.rank.copy_stats.remote(self.key), timeout=CALL_TIMEOUT_S))
        except Exception:          # the rank is gone: its actor is ending
            return ReceiverStats()

    def poll(self) -> list[TransferResult]:
        return []                  # results come to rank 0 through `ServingActor.copy_done`

    def wait(self, transfer_id: str, timeout: float | None = None) -> TransferResult | None:
        raise NotImplementedError("the resharded receiver waits on its own results")

    def close(self) -> None:
        self.rank.close_copies.remote()


class RemoteSender(KVSender):
    """Rank 0's sender of a copy read from another rank's cache: the piece's ranges travel, not its cells."""

    def __init__(self, rank, transfer, layout: KVLayout, heads: range):
        self.rank, self.transfer, self.layout, self.heads = rank, transfer, layout, heads

    def send(self, piece: KVPiece, dest: str) -> SendHandle:
        handle = SendHandle(piece.request_id, piece.transfer_id)
        fields = {f.name: getattr(piece, f.name) for f in dataclasses.fields(KVPiece)
                  if f.name not in ("kv_cache", "ready")}
        fields["block_ids"] = list(fields["block_ids"])
        ref = self.rank.send_copy.remote(self.transfer, self.layout, self.heads, fields, dest)

        def done(future) -> None:
            try:
                status, error, side, wire_bytes = future.result()
            except Exception as exc:              # the rank died: its actor is ending
                handle._finish(TransferStatus.FAILED, f"tensor-parallel rank lost: {exc}", FailedSide.SENDER)
                return
            handle.wire_bytes = wire_bytes
            handle._finish(TransferStatus(status), error, FailedSide(side))

        ref.future().add_done_callback(done)
        return handle

    def handshake(self, dest: str) -> None:
        pass                       # each send handshakes on its rank

    def close(self) -> None:
        pass                       # the rank closes its senders when it ends
