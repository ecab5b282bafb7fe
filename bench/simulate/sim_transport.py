"""The KV handoff on the virtual clock: a `KVSender` / `KVReceiver` pair that moves no bytes, only time.

The prefill worker calls `send` while its engine step runs; the simulated actor finishes that step
`step_s` later (`SimActor.busy_until`), lengthened by `model.send_busy_s(wire bytes)` where the send's
own work shares the actor's cores (a measured CPU profile; none on a GPU). The transfer then takes
`model.link_s(wire bytes)` (the cache's bytes times the codec's ratio). With layer-wise streaming the
first layers leave while the later ones compute, so only the tail is added after the step:

    whole prompt:   first chunk at step end;               done at step end + link
    layer-wise:     first chunk after the first layer;     done at step end + max(link − step·(L−1)/L, link/L)

Each actor has one link of the model's bandwidth (a GPU's share of the network, or of NVLink with
`--intra-node`), out of a prefill actor and into a decode actor: transfers through the same link take
turns, first sent first, so a prefill actor shipping several prompts, or a decode actor receiving from
several prefill actors, waits for the link as it would for a real NIC. A transfer's bytes hold the
link for `link_s(bytes) − link_s(0)` (the latency does not); when the sender's or the receiver's link
is still busy with earlier bytes, the whole transfer moves later by the wait.

The receiver reserves the destination blocks in the decode engine's real block manager when the
first chunk arrives (no room: the transfer fails on the receiver's side, as a real one does),
reports DONE through `poll` and `on_complete` (which wakes the decode worker), and honours
`cancel` (blocks freed, tombstones refuse a transfer not begun) and the transfer's deadline.
"""
from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

from kv_transfer.interface import (FailedSide, KVPiece, KVReceiver, KVSender, ReceiverStats, SendHandle,
                                   TransferResult, TransferStatus)


class SimNetwork:
    """Endpoints (`sim://N`) → receivers."""

    def __init__(self) -> None:
        self._receivers: dict[str, SimReceiver] = {}
        self._ids = itertools.count()

    def register(self, receiver: SimReceiver) -> str:
        endpoint = f"sim://{next(self._ids)}"
        self._receivers[endpoint] = receiver
        return endpoint

    def unregister(self, endpoint: str) -> None:
        self._receivers.pop(endpoint, None)

    def lookup(self, endpoint: str) -> SimReceiver | None:
        return self._receivers.get(endpoint)


@dataclass(slots=True)
class _Transfer:
    transfer_id: str
    request_id: str
    num_blocks: int
    deadline: float
    block_ids: list[int] | None = None
    status: TransferStatus = TransferStatus.PENDING
    first_at: float = 0.0


class SimReceiver(KVReceiver):
    def __init__(self, network: SimNetwork, allocator, on_complete: Callable[[TransferResult], None]):
        self.network = network
        self.allocator = allocator
        self.on_complete = on_complete
        self.codec = "none"                # the simulated cache holds no values to round-trip
        self._endpoint = network.register(self)
        self._active: dict[str, _Transfer] = {}
        self._finished: dict[str, TransferResult] = {}
        self._ready: list[TransferResult] = []
        self._stats = ReceiverStats()
        self.link_free_at = 0.0            # when this actor's incoming link has carried every byte sent to it

    @property
    def endpoint(self) -> str:
        return self._endpoint

    @property
    def stats(self) -> ReceiverStats:
        return self._stats

    # ---- what the sender's timers call ----------------------------------
    def begin(self, t: _Transfer) -> str:
        """The first chunk arrived: reserve the blocks. Returns "" or why the transfer was refused."""
        if t.transfer_id in self._finished:
            return self._finished[t.transfer_id].error or "refused"
        ids = self.allocator.allocate(t.num_blocks)
        if ids is None:
            self._end(t, TransferStatus.FAILED, f"no room for {t.num_blocks} KV blocks")
            return f"receiver has no room for {t.num_blocks} KV blocks"
        t.block_ids, t.status, t.first_at = ids, TransferStatus.TRANSFERRING, time.monotonic()
        self._active[t.transfer_id] = t
        return ""

    def complete(self, t: _Transfer, piece: KVPiece, nbytes: int) -> str:
        """The last chunk arrived. Returns "" or why the transfer did not complete."""
        if self._active.get(t.transfer_id) is not t:
            return self._finished[t.transfer_id].error if t.transfer_id in self._finished else "cancelled"
        now = time.monotonic()
        if now > t.deadline:
            self._end(t, TransferStatus.EXPIRED, "deadline passed before all KV chunks arrived")
            return "receiver expired the transfer"
        del self._active[t.transfer_id]
        result = TransferResult(t.transfer_id, t.request_id, TransferStatus.DONE, list(t.block_ids),
                                piece.num_tokens, piece.first_token_id, piece.handoff, "none", nbytes=nbytes,
                                done_at=now, receive_s=now - t.first_at, receive_tail_s=0.0)
        self._stats.num_done += 1
        self._stats.bytes_received += nbytes
        self._report(result)
        return ""

    def _end(self, t: _Transfer, status: TransferStatus, error: str) -> None:
        self._active.pop(t.transfer_id, None)
        if t.block_ids:
            self.allocator.free(t.block_ids)
            t.block_ids = []
        self._stats.num_failed += status is TransferStatus.FAILED
        self._stats.num_expired += status is TransferStatus.EXPIRED
        self._stats.num_cancelled += status is TransferStatus.CANCELLED
        self._report(TransferResult(t.transfer_id, t.request_id, status, error=error))

    def _report(self, result: TransferResult) -> None:
        self._finished[result.transfer_id] = result
        self._ready.append(result)
        self.on_complete(result)

    # ---- KVReceiver -------------------------------------------------------
    def poll(self) -> list[TransferResult]:
        ready, self._ready = self._ready, []
        return ready

    def wait(self, transfer_id: str, timeout: float | None = None) -> TransferResult | None:
        return self._finished.get(transfer_id)

    def status(self, transfer_id: str) -> TransferStatus | None:
        if transfer_id in self._active:
            return self._active[transfer_id].status
        result = self._finished.get(transfer_id)
        return None if result is None else result.status

    def cancel(self, transfer_id: str | None = None, request_id: str | None = None) -> list[str]:
        hits = [t for t in self._active.values() if t.transfer_id == transfer_id or t.request_id == request_id]
        if transfer_id is not None and transfer_id not in self._active and transfer_id not in self._finished:
            self._finished[transfer_id] = TransferResult(transfer_id, request_id or "", TransferStatus.CANCELLED,
                                                         error="cancelled by the decode worker")
        for t in hits:
            self._end(t, TransferStatus.CANCELLED, "cancelled by the decode worker")
        return [t.transfer_id for t in hits]

    def close(self) -> None:
        self.network.unregister(self._endpoint)
        for t in list(self._active.values()):
            self._end(t, TransferStatus.CANCELLED, "receiver closed")


class SimSender(KVSender):
    """Times each piece from `model.link_s` after the step that produced it (module docstring).

    Args:
        network: where receivers are found.
        actor: the sending simulated actor (`busy_until`: when the current step ends; `step_s`: its length).
        model: the link's time (`link_s`) and the layer count.
        kv_bytes_per_block: the simulated cache's bytes per block (all layers, K and V).
        ratio: wire bytes per cache byte (`kv_transfer.wire_bytes_per_kv_byte`).
        layerwise: the send overlaps the prefill's layers.
    """

    def __init__(self, network: SimNetwork, actor, model, kv_bytes_per_block: int, ratio: float,
                 layerwise: bool = True):
        self.network, self.actor, self.model = network, actor, model
        self.kv_bytes_per_block, self.ratio, self.layerwise = kv_bytes_per_block, ratio, layerwise
        self.link_free_at = 0.0            # when this actor's outgoing link has carried every byte it was given

    def handshake(self, dest: str) -> None:
        pass

    def send(self, piece: KVPiece, dest: str) -> SendHandle:
        handle = SendHandle(piece.request_id, piece.transfer_id)
        receiver = self.network.lookup(dest)
        if receiver is None:
            handle._finish(TransferStatus.FAILED, f"no receiver at {dest}", FailedSide.TRANSPORT)
            return handle
        first, last = piece.blocks or (0, len(piece.block_ids))
        num_blocks = len(piece.block_ids)
        wire = round((last - first) * self.kv_bytes_per_block * self.ratio)
        busy = self.model.send_busy_s(wire)
        if busy > 0:
            self.actor.lengthen(busy)        # the send's own work, on the prefill actor's cores
        loop = asyncio.get_running_loop()
        now = loop.time()                   # the step's start: its length is still ahead (clock.py)
        step_end = max(self.actor.busy_until, now)
        step_s = self.actor.step_s if self.actor.busy_until > now else 0.0
        link = self.model.link_s(wire)
        layers = self.model.num_layers
        if self.layerwise and step_s > 0:
            first_at = step_end - step_s * (layers - 1) / layers
            done_at = step_end + max(link - step_s * (layers - 1) / layers, link / layers)
        else:
            first_at, done_at = step_end, step_end + link
        occupied = link - self.model.link_s(0.0)            # the bytes' time on each link (module docstring)
        free_before = self.link_free_at, receiver.link_free_at
        wait = max(free_before) - (done_at - occupied)
        if wait > 0:
            first_at, done_at = first_at + wait, done_at + wait
        self.link_free_at = receiver.link_free_at = done_at
        t = _Transfer(piece.transfer_id, piece.request_id, num_blocks, now + piece.deadline_s)

        def begin() -> None:
            refused = receiver.begin(t)
            if refused:             # no bytes follow: the links are free again, unless a later transfer queued
                if self.link_free_at == done_at:
                    self.link_free_at = free_before[0]
                if receiver.link_free_at == done_at:
                    receiver.link_free_at = free_before[1]
                handle._finish(TransferStatus.FAILED, refused, FailedSide.RECEIVER)
                return
            loop.call_at(done_at, finish)

        def finish() -> None:
            failed = receiver.complete(t, piece, wire)
            if failed:
                handle._finish(TransferStatus.FAILED, failed, FailedSide.RECEIVER)
                return
            handle.wire_bytes = wire
            handle.chunk_at.append(step_end)        # handed to the link when the step ends; the rest is wire
            handle._finish(TransferStatus.DONE)
        loop.call_at(max(first_at, now), begin)
        return handle

    def close(self) -> None:
        pass
