"""Prefix-cache events: what a block manager made findable or dropped, numbered in batches for the router.

The block manager calls its `event_sink` (a `KVEventSink`) under its lock:

    stored(block_id, block_hash)    a full block got its chained hash: prefix hits may use it from now on
    removed(block_id, block_hash)   a cached block was reused for other tokens: its hash is gone

The tiers below the paged cache (engine/kv_cache/tiers) report to the same sink with their tier
(`stored(-1, block_hash, tier=KV_CACHE_TIER_HOST)`): each event carries where the block is held.

`KVEventLog` is the sink every worker's engine has. It keeps the events in order
and hands them out as numbered `KVCacheEventBatch`es (proto/pdserve/v1/kv_events.proto)
to whoever pulls (the router's `KVEventPoller`):

    answer(KVEventsRequest{epoch, acked_seq}) -> KVEventsResponse{epoch, last_seq, batches > acked_seq}

A pull seals the pending events into batch `last_seq + 1`; a batch stays until a later
pull acks it, so a lost response is sent again. The epoch names this log (one engine's
life: the cache is empty at seq 0). When more than `max_events` wait unacked (nobody
pulls), the log drops them and skips a number, so the puller sees a gap and asks for
a snapshot: every cached hash (and every tier's), as of `last_seq`, taken under the block manager's lock
(it drops nothing: a test or a second reader may take one at any time).
"""
from __future__ import annotations

import contextlib
import threading
import uuid
from collections import deque
from typing import Protocol

from proto.pdserve.v1 import kv_events_pb2 as kpb

STORED, REMOVED = kpb.KV_CACHE_EVENT_KIND_STORED, kpb.KV_CACHE_EVENT_KIND_REMOVED
DEVICE = kpb.KV_CACHE_TIER_UNSPECIFIED      # the paged cache
MAX_EVENTS = 1 << 16        # unacked events an actor keeps (16-byte hashes: ~1 MiB) before it drops them


class KVEventSink(Protocol):
    def stored(self, block_id: int, block_hash: bytes, tier: int = DEVICE) -> None: ...

    def removed(self, block_id: int, block_hash: bytes, tier: int = DEVICE) -> None: ...


class KVEventLog:
    """The batched, numbered event log of one block manager (thread-safe)."""

    def __init__(self, block_manager, max_events: int = MAX_EVENTS):
        """Becomes `block_manager.event_sink`; the cache must be empty (the epoch starts at seq 0)."""
        assert not block_manager.cached, "attach the event log before anything is cached"
        self.epoch = uuid.uuid4().hex
        self.max_events = max_events
        self.num_dropped = 0                 # times unacked events were dropped (a gap the puller resyncs over)
        self._block_manager = block_manager
        self._lock = threading.Lock()
        self._pending: list[tuple[int, int, bytes]] = []         # (kind, tier, hash) since the last sealed batch
        self._batches: deque[kpb.KVCacheEventBatch] = deque()    # sealed, not acked yet, oldest first
        self._num_events = 0                                     # in _pending and _batches
        self._last_seq = 0
        self.tiers = None                    # engine.kv_cache.tiers.KVTiers, when the engine has tiers
        block_manager.event_sink = self

    # ---- the sink (block manager's lock held, or the tiers') -------------
    def stored(self, block_id: int, block_hash: bytes, tier: int = DEVICE) -> None:
        self._add(STORED, tier, block_hash)

    def removed(self, block_id: int, block_hash: bytes, tier: int = DEVICE) -> None:
        self._add(REMOVED, tier, block_hash)

    def _add(self, kind: int, tier: int, block_hash: bytes) -> None:
        with self._lock:
            self._pending.append((kind, tier, block_hash))
            self._num_events += 1
            if self._num_events > self.max_events:
                self._pending.clear()
                self._batches.clear()
                self._num_events = 0
                self._last_seq += 1          # the dropped batch's number: the puller sees the gap
                self.num_dropped += 1

    # ---- the puller ----------------------------------------------------
    @property
    def last_seq(self) -> int:
        return self._last_seq

    def answer(self, request: kpb.KVEventsRequest) -> kpb.KVEventsResponse:
        """Batches after `request.acked_seq` (dropping those it acks), or a snapshot when asked."""
        if request.snapshot:
            return self.snapshot()
        with self._lock:
            if request.epoch == self.epoch:
                while self._batches and self._batches[0].seq <= request.acked_seq:
                    self._num_events -= sum(len(e.block_hashes) for e in self._batches.popleft().events)
            self._seal()
            return kpb.KVEventsResponse(epoch=self.epoch, last_seq=self._last_seq, batches=list(self._batches))

    def answer_bytes(self, request: bytes) -> bytes:
        """`answer` over the wire: a serialized `KVEventsRequest` in, a serialized response out (what the
        actors' Ray calls carry)."""
        return self.answer(kpb.KVEventsRequest.FromString(request)).SerializeToString()

    def snapshot(self) -> kpb.KVEventsResponse:
        """Every cached hash as of `last_seq` (pending events are sealed first, so the snapshot holds
        every batch up to it). Nothing is dropped: replaying stored/removed events over a state that
        has them is a no-op, so batches a puller applies after the snapshot change nothing."""
        tiers_lock = self.tiers.lock if self.tiers is not None else contextlib.nullcontext()
        with self._block_manager.lock, tiers_lock, self._lock:
            self._seal()
            snapshot = kpb.KVCacheSnapshot(block_hashes=list(self._block_manager.cached))
            for tier_id, hashes in (self.tiers.held() if self.tiers is not None else []):
                snapshot.tiers.add(tier=tier_id, block_hashes=hashes)
            return kpb.KVEventsResponse(epoch=self.epoch, last_seq=self._last_seq, snapshot=snapshot)

    def _seal(self) -> None:
        """Pending events → the next batch: runs of one kind and tier, in order."""
        if not self._pending:
            return
        self._last_seq += 1
        batch = kpb.KVCacheEventBatch(seq=self._last_seq)
        run = None
        for kind, tier, block_hash in self._pending:
            if run is None or run.kind != kind or run.tier != tier:
                run = batch.events.add(kind=kind, tier=tier)
            run.block_hashes.append(block_hash)
        self._pending.clear()
        self._batches.append(batch)
