"""`KVIndex`: which actors' prefix caches hold which block hashes (no Ray, no I/O).

Fed only by the actors' own events (`KVEventsResponse`, proto/pdserve/v1/kv_events.proto)
and their snapshots on a resync, never by what the router dispatched: an eviction on
the actor is an event here, so the index does not go stale.

Per actor it follows one epoch (one engine's life) and the last batch applied:

    same epoch, batches seq + 1, seq + 2 ...  → applied in order (resent ones skipped)
    a new epoch                               → that actor's entries are dropped (its cache began empty)
    a batch missing (gap, or last_seq ahead)  → `apply` returns False: the caller asks for a snapshot
    a snapshot                                → that actor's entries are replaced by it

Each event names the tier that holds its blocks: the actor's paged cache (the device), or a tier below
it (kv_cache.tiers: host, disk). A block held anywhere counts as cached (`prefix_blocks`,
`prefix_by_actor`); its price is the onboarding a hit there needs, as a share of recomputing it
(`tier_cost`: device 0 < host < disk < 1, recompute 1), so the policies rank a device hit over a host
hit over a disk hit over recompute. The router sets the costs from the actors' measured onboard
bandwidth (`measure_tier`); until then they are `DEFAULT_TIER_COST`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from proto.pdserve.v1 import kv_events_pb2 as kpb

DEVICE, HOST, DISK = kpb.KV_CACHE_TIER_UNSPECIFIED, kpb.KV_CACHE_TIER_HOST, kpb.KV_CACHE_TIER_DISK
TIER_IDS = {"device": DEVICE, "host": HOST, "disk": DISK}
DEFAULT_TIER_COST = {DEVICE: 0.0, HOST: 0.05, DISK: 0.25}   # onboarding a block / recomputing it
MIN_TIER_COST, MAX_TIER_COST = 0.001, 0.99


@dataclass(slots=True)
class ActorCache:
    """What the index knows of one actor's cache."""

    epoch: str = ""
    seq: int = 0                     # the last batch applied (or the snapshot's)
    tiers: dict[int, set[bytes]] = field(default_factory=lambda: {DEVICE: set(), HOST: set(), DISK: set()})
    in_sync: bool = False            # no gap since the last snapshot (or since seq 0 of its epoch)

    @property
    def hashes(self) -> set[bytes]:
        """The hashes in its paged cache."""
        return self.tiers[DEVICE]

    def best_tier(self, block_hash: bytes) -> int | None:
        """The fastest tier holding the block (DEVICE < HOST < DISK), or None."""
        return next((tier for tier, held in self.tiers.items() if block_hash in held), None)


class KVIndex:
    def __init__(self) -> None:
        self._actors: dict[str, ActorCache] = {}
        self._holders: dict[bytes, set[str]] = {}      # block hash -> actor ids holding it in some tier
        self.tier_cost: dict[int, float] = dict(DEFAULT_TIER_COST)

    # ---- fed by the poller ----------------------------------------------
    def state(self, actor_id: str) -> ActorCache:
        return self._actors.setdefault(actor_id, ActorCache())

    def apply(self, actor_id: str, response: kpb.KVEventsResponse) -> bool:
        """Apply one actor's answer; False when a batch is missing (ask that actor for a snapshot)."""
        st = self.state(actor_id)
        if response.HasField("snapshot"):
            held = {tier: set() for tier in st.tiers}
            held[DEVICE] = set(response.snapshot.block_hashes)
            for tier in response.snapshot.tiers:
                held.setdefault(tier.tier, set()).update(tier.block_hashes)
            for tier, hashes in held.items():
                self._replace(actor_id, st, tier, hashes)
            st.epoch, st.seq, st.in_sync = response.epoch, response.last_seq, True
            return True
        if response.epoch != st.epoch:               # first contact, or the actor's engine restarted
            for tier in st.tiers:
                self._replace(actor_id, st, tier, set())
            st.epoch, st.seq, st.in_sync = response.epoch, 0, True
        for batch in response.batches:
            if batch.seq <= st.seq:
                continue                             # applied already: resent until acked
            if batch.seq != st.seq + 1:
                st.in_sync = False
                return False
            for event in batch.events:
                if event.kind == kpb.KV_CACHE_EVENT_KIND_STORED:
                    self._add(actor_id, st, event.tier, event.block_hashes)
                elif event.kind == kpb.KV_CACHE_EVENT_KIND_REMOVED:
                    self._remove(actor_id, st, event.tier, event.block_hashes)
            st.seq = batch.seq
        st.in_sync = st.in_sync and response.last_seq <= st.seq
        return response.last_seq <= st.seq

    def forget(self, actor_id: str) -> None:
        """The actor left the pools."""
        st = self._actors.pop(actor_id, None)
        if st is not None:
            for tier, held in st.tiers.items():
                self._remove(actor_id, st, tier, list(held))

    # ---- queries -------------------------------------------------------
    @property
    def actor_ids(self) -> list[str]:
        return list(self._actors)

    def hashes_of(self, actor_id: str, tier: int = DEVICE) -> set[bytes]:
        """The hashes the actor holds in `tier` (its paged cache by default)."""
        st = self._actors.get(actor_id)
        return set(st.tiers.get(tier, ())) if st is not None else set()

    def prefix_blocks(self, actor_id: str, hashes: list[bytes]) -> int:
        """Leading blocks of `hashes` the actor holds in some tier (the prefix a hit there would reuse)."""
        st = self._actors.get(actor_id)
        if st is None:
            return 0
        n = 0
        for h in hashes:
            if st.best_tier(h) is None:
                break
            n += 1
        return n

    def onboard_cost(self, actor_id: str, hashes: list[bytes], num_blocks: int) -> float:
        """What loading the first `num_blocks` of `hashes` into the actor's paged cache costs, in blocks of
        recompute (0 when its paged cache holds them all)."""
        st = self._actors.get(actor_id)
        if st is None:
            return 0.0
        return sum(self.tier_cost.get(st.best_tier(h), 1.0) for h in hashes[:num_blocks])

    def priced_prefix_by_actor(self, hashes: list[bytes]) -> dict[str, float]:
        """`prefix_by_actor` less each actor's onboarding cost: the blocks its hit saves, as if in its paged
        cache (a device hit counts 1 a block, a host or disk hit less)."""
        return {actor_id: n - self.onboard_cost(actor_id, hashes, n)
                for actor_id, n in self.prefix_by_actor(hashes).items()}

    def measure_tier(self, tier: int, onboard_s_per_block: float, recompute_s_per_block: float) -> None:
        """Price `tier` from measurements: reading a block into the paged cache vs computing its tokens.
        Lower tiers never price below the ones above them."""
        if onboard_s_per_block <= 0 or recompute_s_per_block <= 0 or tier == DEVICE:
            return
        cost = min(max(onboard_s_per_block / recompute_s_per_block, MIN_TIER_COST), MAX_TIER_COST)
        self.tier_cost[tier] = cost
        if tier == HOST:
            self.tier_cost[DISK] = max(self.tier_cost[DISK], cost)
        else:
            self.tier_cost[HOST] = min(self.tier_cost[HOST], cost)

    def prefix_by_actor(self, hashes: list[bytes]) -> dict[str, int]:
        """Every actor holding at least the first block (in some tier) → its cached prefix in blocks."""
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
    def _add(self, actor_id: str, st: ActorCache, tier: int, hashes) -> None:
        held = st.tiers.setdefault(tier, set())
        for h in hashes:
            held.add(h)
            self._holders.setdefault(h, set()).add(actor_id)

    def _remove(self, actor_id: str, st: ActorCache, tier: int, hashes) -> None:
        held = st.tiers.setdefault(tier, set())
        for h in hashes:
            held.discard(h)
            if st.best_tier(h) is not None:
                continue                                 # still in another of its tiers
            holders = self._holders.get(h)
            if holders is not None:
                holders.discard(actor_id)
                if not holders:
                    del self._holders[h]

    def _replace(self, actor_id: str, st: ActorCache, tier: int, hashes: set[bytes]) -> None:
        held = st.tiers.setdefault(tier, set())
        self._remove(actor_id, st, tier, list(held - hashes))
        self._add(actor_id, st, tier, hashes - held)
