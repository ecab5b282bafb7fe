"""`KVIndex`: which actors' prefix caches hold which block hashes (no Ray, no I/O).

Fed only by the actors' own events (`KVEventsResponse`, proto/pdserve/v1/kv_events.proto)
and their snapshots on a resync, never by what the router dispatched: an eviction on
the actor is an event here, so the index does not go stale.

Per actor it follows one epoch (one engine's life) and the last batch applied:

    same epoch, batches seq + 1, seq + 2 ...  → applied in order (resent ones skipped)
    a new epoch                               → that actor's entries are dropped (its cache began empty)
    a batch missing (gap, or last_seq ahead)  → `apply` returns False: the caller asks for a snapshot
    a snapshot                                → that actor's entries are replaced by it
"""
from __future__ import annotations

from dataclasses import dataclass, field

from proto.pdserve.v1 import kv_events_pb2 as kpb


@dataclass(slots=True)
class ActorCache:
    """What the index knows of one actor's cache."""

    epoch: str = ""
    seq: int = 0                     # the last batch applied (or the snapshot's)
    hashes: set[bytes] = field(default_factory=set)
    in_sync: bool = False            # no gap since the last snapshot (or since seq 0 of its epoch)


class KVIndex:
    def __init__(self) -> None:
        self._actors: dict[str, ActorCache] = {}
        self._holders: dict[bytes, set[str]] = {}      # block hash -> actor ids

    # ---- fed by the poller ----------------------------------------------
    def state(self, actor_id: str) -> ActorCache:
        return self._actors.setdefault(actor_id, ActorCache())

    def apply(self, actor_id: str, response: kpb.KVEventsResponse) -> bool:
        """Apply one actor's answer; False when a batch is missing (ask that actor for a snapshot)."""
        st = self.state(actor_id)
        if response.HasField("snapshot"):
            self._replace(actor_id, st, set(response.snapshot.block_hashes))
            st.epoch, st.seq, st.in_sync = response.epoch, response.last_seq, True
            return True
        if response.epoch != st.epoch:               # first contact, or the actor's engine restarted
            self._replace(actor_id, st, set())
            st.epoch, st.seq, st.in_sync = response.epoch, 0, True
        for batch in response.batches:
            if batch.seq <= st.seq:
                continue                             # applied already: resent until acked
            if batch.seq != st.seq + 1:
                st.in_sync = False
                return False
            for event in batch.events:
                if event.kind == kpb.KV_CACHE_EVENT_KIND_STORED:
                    self._add(actor_id, st, event.block_hashes)
                elif event.kind == kpb.KV_CACHE_EVENT_KIND_REMOVED:
                    self._remove(actor_id, st, event.block_hashes)
            st.seq = batch.seq
        st.in_sync = st.in_sync and response.last_seq <= st.seq
        return response.last_seq <= st.seq

    def forget(self, actor_id: str) -> None:
        """The actor left the pools."""
        st = self._actors.pop(actor_id, None)
        if st is not None:
            self._remove(actor_id, st, list(st.hashes))

    # ---- queries -------------------------------------------------------
    @property
    def actor_ids(self) -> list[str]:
        return list(self._actors)

    def hashes_of(self, actor_id: str) -> set[bytes]:
        st = self._actors.get(actor_id)
        return set(st.hashes) if st is not None else set()

    def prefix_blocks(self, actor_id: str, hashes: list[bytes]) -> int:
        """Leading blocks of `hashes` the actor holds (the prefix a hit there would reuse)."""
        st = self._actors.get(actor_id)
        if st is None:
            return 0
        n = 0
        for h in hashes:
            if h not in st.hashes:
                break
            n += 1
        return n

    def prefix_by_actor(self, hashes: list[bytes]) -> dict[str, int]:
        """Every actor holding at least the first block → its cached prefix in blocks."""
        out: dict[str, int] = {}
        alive = set(self._holders.get(hashes[0], ())) if hashes else set()
        for i, h in enumerate(hashes):
            alive &= self._holders.get(h, set())
            if not alive:
                break
            for actor_id in alive:
                out[actor_id] = i + 1
        return out

    # ---- internals -----------------------------------------------------
    def _add(self, actor_id: str, st: ActorCache, hashes) -> None:
        for h in hashes:
            st.hashes.add(h)
            self._holders.setdefault(h, set()).add(actor_id)

    def _remove(self, actor_id: str, st: ActorCache, hashes) -> None:
        for h in hashes:
            st.hashes.discard(h)
            holders = self._holders.get(h)
            if holders is not None:
                holders.discard(actor_id)
                if not holders:
                    del self._holders[h]

    def _replace(self, actor_id: str, st: ActorCache, hashes: set[bytes]) -> None:
        self._remove(actor_id, st, list(st.hashes - hashes))
        self._add(actor_id, st, hashes - st.hashes)
