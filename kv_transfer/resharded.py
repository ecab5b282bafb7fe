"""KV transfer between tensor-parallel actors of any degrees: one ordinary transfer per head copy.

A prefill actor of degree Np and a decode actor of degree Nd hold the model's KV heads split differently;
a resharding plan (`engine.parallel.reshard.reshard_plan`: a list of head copies, each "heads `source_heads`
of sending rank s go to heads `dest_heads` of receiving rank d") says who sends what to whom. Each copy
travels as a transfer of its own, over any transport and codec, unchanged:

- the sending rank ships the *head view* of its cache (`kv_transfer.head_view.head_view`: the strided view
  ``kv_cache[:, :, :, source_heads]`` of a model-dtype cache; for a quantized cache, ``kv_cache.dtype`` fp8 /
  int8, the views of those heads' bytes and of their scales) under a layout whose ``num_kv_heads`` is the
  copy's width and whose ``kv_head_start`` is the model's first head of it (`head_layout`);
- the receiving rank runs one receiver per copy over the head view of its own cache at ``dest_heads``, with
  the same layout: the handshake compares the model's head range on both ends (and refuses a copy whose heads
  differ, naming both), and the cache dtype as for any transfer;
- every copy of one request carries the same ``transfer_id``, and all of a decode actor's receivers reserve
  their blocks through one `TransferBlocks`: the first to see a transfer allocates, the others get the same
  ids, so the block ids are shared across the decode actor's ranks (its rank 0's block manager allocates);
- `ReshardedReceiver` reports the transfer DONE only when every copy is DONE (every receiving rank holds all
  of its cells); the first copy that fails cancels the others and the blocks are freed once, when no copy
  writes into them any more.

A head view's cell is, byte for byte, the cell of a cache holding only its heads, so a copy of a quantized
cache ships its heads' fp8 / int8 values with their scales as stored (the `fp8_cache` / `int8_cache` codecs):
per-head scales (fp8: per block x head; int8: per token x head) make every head split exact. Transports that
move bytes in place read and write a head view's cells as a few byte runs each (tcp's rows, nixl's
descriptors: `kv_transfer.transports.tcp.rows.CellRuns`); the others gather and scatter it through the codec.

The decode side advertises one endpoint for all its receivers (`group_endpoint`: "tp:" and JSON naming
the sending degree it expects and, per copy, the sending rank, its head range and the copy's receiver);
`ReshardedSender` at the prefill side sends every copy from the rank the plan names. Layer-wise streaming
(several pieces of one transfer) and prefix skipping (a piece covering part of the blocks) pass through:
each piece goes out once per copy. Codecs apply per copy.
"""
from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch

from kv_transfer.interface import (
    BlockAllocator,
    FailedSide,
    KVReceiver,
    KVSender,
    KVPiece,
    ReceiverStats,
    SendHandle,
    TransferResult,
    TransferStatus,
)
from kv_transfer.head_view import head_view
from kv_transfer.layout import KVLayout

ENDPOINT_PREFIX = "tp:"
MAX_FINISHED = 4096


def head_layout(layout: KVLayout, heads: range) -> KVLayout:
    """The layout of `head_view(cache, heads, layout)` for a cache of `layout`: its width and the model's first
    head (a quantized cache's head view has the cells, scales included, of a cache of that width)."""
    return dataclasses.replace(layout, num_kv_heads=len(heads), kv_head_start=layout.kv_head_start + heads.start)


@dataclasses.dataclass(frozen=True, slots=True)
class Copy:
    """One head copy as the sending side reads it from a group endpoint."""

    source_rank: int
    source_heads: range     # positions in the sending rank's cache
    dest_rank: int
    model_heads: range      # the model's KV heads it carries
    endpoint: str           # the receiver of this copy


def group_endpoint(source_degree: int, copies: Sequence[Copy]) -> str:
    body = {"source_tensor_parallel": source_degree,
            "copies": [[c.source_rank, c.source_heads.start, c.source_heads.stop, c.dest_rank,
                        c.model_heads.start, c.model_heads.stop, c.endpoint] for c in copies]}
    return ENDPOINT_PREFIX + json.dumps(body, separators=(",", ":"))


def parse_group_endpoint(dest: str) -> tuple[int, list[Copy]] | None:
    """(the sending degree it expects, its copies), or None for an ordinary endpoint."""
    if not dest.startswith(ENDPOINT_PREFIX):
        return None
    body = json.loads(dest[len(ENDPOINT_PREFIX):])
    return body["source_tensor_parallel"], [Copy(s, range(s0, s1), d, range(m0, m1), ep)
                                            for s, s0, s1, d, m0, m1, ep in body["copies"]]


# ---- the receiving side -------------------------------------------------------
class TransferBlocks:
    """A decode actor's block pool as all its receivers see it: one set of block ids per transfer.

    `allocate_transfer` by the first copy of a transfer allocates from the pool; later copies of it get the
    same ids. A copy that ends other than DONE calls `free_transfer`: the transfer is refused from then on
    (later copies get None) and its blocks go back to the pool when no copy holds them. `hand_over` (every
    copy DONE) gives them to the decode worker; `release_done` drops copies that were DONE when another failed.
    """

    def __init__(self, allocator: BlockAllocator):
        self.allocator = allocator
        self._lock = threading.Lock()
        self._held: dict[str, list] = {}                    # transfer id -> [block ids, holders]
        self._refused: OrderedDict[str, None] = OrderedDict()

    def allocate_transfer(self, transfer_id: str, num_blocks: int) -> list[int] | None:
        with self._lock:
            if transfer_id in self._refused:
                return None
            entry = self._held.get(transfer_id)
            if entry is not None:
                if len(entry[0]) != num_blocks:
                    return None
                entry[1] += 1
                return list(entry[0])
            ids = self.allocator.allocate(num_blocks)
            if ids is not None:
                self._held[transfer_id] = [list(ids), 1]
            return ids

    def free_transfer(self, transfer_id: str, block_ids: list[int]) -> None:
        self._drop(transfer_id, 1)

    def release_done(self, transfer_id: str, num_copies: int) -> None:
        self._drop(transfer_id, num_copies)

    def refuse(self, transfer_id: str) -> None:
        """No copy of the transfer reserves any more (it failed); frees its blocks if no copy holds them."""
        self._drop(transfer_id, 0)

    def hand_over(self, transfer_id: str) -> list[int]:
        with self._lock:
            return self._held.pop(transfer_id)[0]

    @property
    def num_transfers(self) -> int:
        with self._lock:
            return len(self._held)

    def _drop(self, transfer_id: str, holders: int) -> None:
        with self._lock:
            self._refused[transfer_id] = None
            while len(self._refused) > MAX_FINISHED:
                self._refused.popitem(last=False)
            entry = self._held.get(transfer_id)
            if entry is None:
                return
            entry[1] -= holders
            if entry[1] > 0:
                return
            del self._held[transfer_id]
        self.allocator.free(entry[0])


@dataclasses.dataclass(slots=True)
class _Pending:
    since: float                # time.monotonic(): the first copy ended
    done: list[TransferResult] = dataclasses.field(default_factory=list)


class ReshardedReceiver(KVReceiver):
    """The decode side of a resharded transfer: one receiver per head copy, one result per transfer.

    Build it with `open`; `endpoint` is the group endpoint prefill actors send to.
    """

    def __init__(self, source_degree: int, blocks: TransferBlocks,
                 on_complete: Callable[[TransferResult], None] | None = None, deadline_s: float = 30.0,
                 reap_interval_s: float = 0.05):
        """`deadline_s`: how long after one copy is DONE the others may take (the receivers' longest deadline):
        a copy that never comes (its sending rank died) expires the transfer."""
        self.source_degree, self.blocks, self.on_complete = source_degree, blocks, on_complete
        self.deadline_s = deadline_s
        self.members: list[tuple[int, range, int, range, KVReceiver]] = []   # (s, s heads, d, model heads, rx)
        self._lock = threading.Condition()
        self._pending: dict[str, _Pending] = {}
        self._finished: OrderedDict[str, TransferResult] = OrderedDict()
        self._ready: list[TransferResult] = []
        self._stats = ReceiverStats()
        self._endpoint = ""
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap, args=(reap_interval_s,), name="kv-tp-reaper", daemon=True)
        self._reaper.start()

    @classmethod
    def open(cls, plan, source_degree: int, layouts: Sequence[KVLayout], allocator: BlockAllocator,
             make_member: Callable[..., KVReceiver], on_complete: Callable[[TransferResult], None] | None = None,
             deadline_s: float = 30.0, codec: str = "none") -> ReshardedReceiver:
        """Receivers for every copy of `plan` (head copies from degree `source_degree` to this actor's ranks,
        whose layouts are `layouts`): `make_member(copy, layout, blocks, on_complete)` opens the receiver of
        one copy on its receiving rank, over `head_view(that rank's cache, copy.dest_heads, layout)` with `layout`,
        reserving through `blocks` and reporting to `on_complete`. `codec`: the members' codec."""
        group = cls(source_degree, TransferBlocks(allocator), on_complete, deadline_s)
        group.codec = codec
        try:
            for c in plan:
                layout = head_layout(layouts[c.dest_rank], c.dest_heads)
                member = make_member(c, layout, group.blocks, group.member_done)
                model_heads = range(layout.kv_head_start, layout.kv_head_start + layout.num_kv_heads)
                group.members.append((c.source_rank, c.source_heads, c.dest_rank, model_heads, member))
        except BaseException:
            group.close()
            raise
        group._endpoint = group_endpoint(source_degree, [Copy(s, sh, d, mh, rx.endpoint)
                                                         for s, sh, d, mh, rx in group.members])
        return group

    @property
    def endpoint(self) -> str:
        return self._endpoint

    @property
    def stats(self) -> ReceiverStats:
        with self._lock:
            stats = dataclasses.replace(self._stats)
        for *_, member in self.members:
            m = member.stats
            stats.auth_failures += m.auth_failures
            stats.handshake_failures += m.handshake_failures
            stats.bad_hellos += m.bad_hellos
            stats.bytes_received += m.bytes_received
        return stats

    def member_done(self, result: TransferResult) -> None:
        """A copy ended (a transport thread): publish the transfer when every copy is DONE or one is not."""
        tid, cancel, release, publish = result.transfer_id, False, 0, None
        with self._lock:
            if tid in self._finished:                  # decided already: a copy DONE late holds blocks
                release = int(result.status == TransferStatus.DONE and
                              self._finished[tid].status != TransferStatus.DONE)
            else:
                pending = self._pending.setdefault(tid, _Pending(time.monotonic()))
                if result.status == TransferStatus.DONE:
                    pending.done.append(result)
                    if len(pending.done) == len(self.members):
                        publish = self._combine(pending.done)
                else:
                    publish = dataclasses.replace(result, dst_block_ids=[])
                    release, cancel = len(pending.done), True
                if publish is not None:
                    self._pending.pop(tid, None)
                    self._remember(publish)
        if publish is not None and publish.status != TransferStatus.DONE:
            self.blocks.refuse(tid)
        if release:
            self.blocks.release_done(tid, release)
        if cancel:
            for *_, member in self.members:
                member.cancel(transfer_id=tid)
        if publish is not None:
            self._publish(publish)

    def _reap(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            now = time.monotonic()
            with self._lock:
                late = [(tid, p.done[0].request_id) for tid, p in self._pending.items()
                        if p.done and p.since + self.deadline_s < now]
            for tid, request_id in late:
                self.member_done(TransferResult(tid, request_id, TransferStatus.EXPIRED,
                                                 error="deadline passed before every receiving rank had its KV"))

    def _combine(self, done: list[TransferResult]) -> TransferResult:
        first = done[0]
        handoff = next((r for r in done if r.first_token_id >= 0 or r.handoff), first)
        ids = self.blocks.hand_over(first.transfer_id)
        return dataclasses.replace(first, dst_block_ids=ids, first_token_id=handoff.first_token_id,
                                   handoff=handoff.handoff, num_tokens=max(r.num_tokens for r in done),
                                   nbytes=sum(r.nbytes for r in done), done_at=max(r.done_at for r in done),
                                   receive_s=max(r.receive_s for r in done),
                                   receive_tail_s=max(r.receive_tail_s for r in done))

    def _remember(self, result: TransferResult) -> None:
        """Caller holds the lock."""
        self._finished[result.transfer_id] = result
        while len(self._finished) > MAX_FINISHED:
            self._finished.popitem(last=False)
        counter = {TransferStatus.DONE: "num_done", TransferStatus.FAILED: "num_failed",
                   TransferStatus.EXPIRED: "num_expired", TransferStatus.CANCELLED: "num_cancelled"}[result.status]
        setattr(self._stats, counter, getattr(self._stats, counter) + 1)

    def _publish(self, result: TransferResult) -> None:
        with self._lock:
            self._ready.append(result)
            self._lock.notify_all()
        if self.on_complete is not None:
            try:
                self.on_complete(result)
            except Exception:  # a callback bug must not kill the transport thread
                pass

    def poll(self) -> list[TransferResult]:
        with self._lock:
            ready, self._ready = self._ready, []
        return ready

    def wait(self, transfer_id: str, timeout: float | None = None) -> TransferResult | None:
        with self._lock:
            self._lock.wait_for(lambda: transfer_id in self._finished, timeout)
            return self._finished.get(transfer_id)

    def status(self, transfer_id: str) -> TransferStatus | None:
        with self._lock:
            if transfer_id in self._finished:
                return self._finished[transfer_id].status
            if transfer_id in self._pending:
                return TransferStatus.TRANSFERRING
        for *_, member in sorted(self.members, key=lambda m: getattr(m[-1], "remote", False)):   # local first
            status = member.status(transfer_id)
            if status is not None:
                return TransferStatus.TRANSFERRING if status.is_terminal else status
        return None

    def cancel(self, transfer_id: str | None = None, request_id: str | None = None) -> list[str]:
        cancelled: list[str] = []
        for *_, member in self.members:
            cancelled += [tid for tid in member.cancel(transfer_id, request_id) if tid not in cancelled]
        return cancelled

    @property
    def num_active(self) -> int:
        return sum(getattr(member, "num_active", 0) for *_, member in self.members)

    def close(self) -> None:
        self._stop.set()
        for *_, member in self.members:
            member.close()
        self._reaper.join(timeout=1)


# ---- the sending side ---------------------------------------------------------
class _GroupHandle(SendHandle):
    """One piece sent as several copies: DONE when every copy is, else the first failure."""

    def __init__(self, piece: KVPiece, handles: list[SendHandle]):
        super().__init__(piece.request_id, piece.transfer_id)
        self.handles = handles
        self._left = len(handles)
        self._count_lock = threading.Lock()
        for handle in handles:
            handle.add_done_callback(self._one_done)

    def _one_done(self, _handle: SendHandle) -> None:
        with self._count_lock:
            self._left -= 1
            if self._left:
                return
        self.wire_bytes = sum(h.wire_bytes for h in self.handles)
        self.chunk_at = sorted(t for h in self.handles for t in h.chunk_at)
        failed = next((h for h in self.handles if h.status != TransferStatus.DONE), None)
        if failed is None:
            self._finish(TransferStatus.DONE)
        else:
            self._finish(failed.status, failed.error, failed.failed_side)


class ReshardedSender(KVSender):
    """The prefill side: every copy a group endpoint names goes from its sending rank's head view.

    `layouts[s]` is sending rank s's layout and `caches[s]` its cache where it is in this process (None for
    a rank of another process, whose sender reads its own cache); `make_member(rank, heads, layout)` opens
    a sender of the transport on rank `rank` for the head view `heads` of its cache (one per distinct view,
    kept open). An ordinary endpoint (a decode actor that does not reshard) is sent to from rank 0 directly
    when this actor is of degree 1.
    """

    def __init__(self, layouts: Sequence[KVLayout], caches: Sequence[torch.Tensor | None],
                 make_member: Callable[[int, range, KVLayout], KVSender]):
        self.layouts, self.caches, self.make_member = list(layouts), list(caches), make_member
        self.degree = len(self.layouts)
        self._senders: dict[tuple[int, int, int], KVSender] = {}
        self._lock = threading.Lock()

    def _sender(self, rank: int, heads: range) -> KVSender:
        key = (rank, heads.start, heads.stop)
        with self._lock:
            sender = self._senders.get(key)
            if sender is None:
                sender = self._senders[key] = self.make_member(rank, heads, head_layout(self.layouts[rank], heads))
            return sender

    def _copies(self, dest: str) -> list[Copy]:
        parsed = parse_group_endpoint(dest)
        if parsed is None:
            if self.degree != 1:
                raise ValueError(f"a tensor_parallel {self.degree} sender needs a resharding destination "
                                 f"(its endpoint names one receiver per head copy); got {dest!r}")
            heads = range(0, self.layouts[0].num_kv_heads)
            return [Copy(0, heads, 0, heads, dest)]
        degree, copies = parsed
        if degree != self.degree:
            raise ValueError(f"the destination expects KV from tensor_parallel {degree}; this sender is "
                             f"tensor_parallel {self.degree}")
        return copies

    def send(self, piece: KVPiece, dest: str) -> SendHandle:
        try:
            copies = self._copies(dest)
        except ValueError as exc:
            handle = SendHandle(piece.request_id, piece.transfer_id)
            handle._finish(TransferStatus.FAILED, str(exc), FailedSide.SENDER)
            return handle
        handles = [self._sender(c.source_rank, c.source_heads).send(self._piece(piece, c), c.endpoint)
                   for c in copies]
        return _GroupHandle(piece, handles)

    def _piece(self, piece: KVPiece, c: Copy) -> KVPiece:
        cache = self.caches[c.source_rank]
        if cache is None:
            return piece
        return dataclasses.replace(piece, kv_cache=head_view(cache, c.source_heads, self.layouts[c.source_rank]))

    def handshake(self, dest: str) -> None:
        for c in self._copies(dest):
            self._sender(c.source_rank, c.source_heads).handshake(c.endpoint)

    def close(self) -> None:
        with self._lock:
            senders, self._senders = list(self._senders.values()), {}
        for sender in senders:
            sender.close()
