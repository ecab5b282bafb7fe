"""`KVEventPoller`: pulls every actor's prefix-cache events into the router's `KVIndex`.

Pull, not push: each poll of an actor is one `kv_events(KVEventsRequest)` call of the
actor protocol (router.actor_protocol) carrying the epoch and the last batch the index
applied (the ack); the actor answers with every batch after it. It runs

    every `interval_s`, over every actor of every pool (actors gone from the pools are forgotten)
    at once for one actor when the dispatcher pokes it (its prefill or its request just ended:
        the blocks it cached are then in the index before the next request is placed)

One poll per actor at a time (a poke during a poll runs after it), so an actor's answers
apply in order. The first poll of an actor the index does not know (new, or forgotten while
it left the pools, e.g. to change role) asks for a snapshot. A missing batch after that (the
index's `apply` says so) is a resync: the same call asks that actor for a snapshot and the index
rebuilds its entries from it, with a warning. An actor
that does not answer keeps its entries (the pool manager decides about its health).
"""
from __future__ import annotations

import asyncio
import logging

from proto.pdserve.v1 import kv_events_pb2 as kpb
from router.actor_protocol import ActorUnavailable
from router.placement.kv_index import KVIndex

log = logging.getLogger(f"pdserve.{__name__}")


class KVEventPoller:
    def __init__(self, pools, index: KVIndex, interval_s: float = 0.2, timeout_s: float = 2.0):
        """pools: `router.pools.Pools` (read at every poll: actors come and go)."""
        self.pools, self.index = pools, index
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self.num_polls = 0
        self.num_resyncs = 0
        self._locks: dict[str, asyncio.Lock] = {}
        self._poked: set[str] = set()            # actors with a poke waiting for their lock
        self._failing: set[str] = set()          # actors whose answers fail (logged once until one works)
        self._tasks: set[asyncio.Task] = set()

    async def run(self) -> None:
        """Poll every `interval_s` until cancelled."""
        while True:
            try:
                await self.sync_all()
            except Exception:                    # never let the index's feed die
                log.exception("KV event poll failed")
            await asyncio.sleep(self.interval_s)

    async def sync_all(self) -> None:
        views = self.pools.all()
        present = {v.actor_id for v in views}
        for actor_id in self.index.actor_ids:
            if actor_id not in present:
                self.index.forget(actor_id)
                self._locks.pop(actor_id, None)
        await asyncio.gather(*(self.sync(v) for v in views))

    def poke(self, view) -> None:
        """Poll `view`'s actor now, in the background (coalesced with a poke already waiting)."""
        if view.actor_id in self._poked:
            return
        self._poked.add(view.actor_id)
        task = asyncio.ensure_future(self.sync(view, poked=True))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def sync(self, view, poked: bool = False) -> bool:
        """One poll of the actor (and a snapshot when a batch is missing); True when the index is in
        sync with it afterwards, False when the actor did not answer."""
        lock = self._locks.setdefault(view.actor_id, asyncio.Lock())
        async with lock:
            if poked:
                self._poked.discard(view.actor_id)
            st = self.index.state(view.actor_id)
            try:
                if not st.epoch:                 # first contact (or forgotten, e.g. while it changed role)
                    self.index.apply(view.actor_id, await self._ask(view, kpb.KVEventsRequest(snapshot=True)))
                    response = None
                else:
                    response = await self._ask(view, kpb.KVEventsRequest(epoch=st.epoch, acked_seq=st.seq))
                if response is not None and not self.index.apply(view.actor_id, response):
                    self.num_resyncs += 1
                    log.warning("KV events of %s: batch %d missing (actor at %d); resyncing from a snapshot",
                                view.actor_id, st.seq + 1, response.last_seq)
                    self.index.apply(view.actor_id, await self._ask(view, kpb.KVEventsRequest(snapshot=True)))
            except (ActorUnavailable, asyncio.TimeoutError):
                return False                     # down or restarting: the pool manager's business
            except Exception as e:               # a bad answer: keep polling, say so once
                if view.actor_id not in self._failing:
                    self._failing.add(view.actor_id)
                    log.warning("KV events of %s failed (%s: %s); its index entries may be stale", view.actor_id,
                                type(e).__name__, e)
                return False
            if view.actor_id in self._failing:
                self._failing.discard(view.actor_id)
                log.info("KV events of %s answer again", view.actor_id)
            return True

    async def _ask(self, view, request: kpb.KVEventsRequest) -> kpb.KVEventsResponse:
        self.num_polls += 1
        return await asyncio.wait_for(view.client.kv_events(request), self.timeout_s)
