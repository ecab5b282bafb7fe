"""The tiers below one actor's paged cache, top first (host, then disk), and what flows between them.

    evicted(block_id, hash)    BlockManager.allocate, lock held: a full block is about to be reused.
                               Already in a tier: marked recently used, nothing copied. Else a copy goes
                               on the offload queue (offload.py), or is dropped and counted when it is full.
    (offload thread)           the copy goes to the top tier; what a tier pushes out (LRU) goes to the
                               tier below; what leaves the last tier is gone.
    count(hashes)              how many leading hashes some tier holds (what this actor can onboard).
    load(hashes)               the leading blocks, checked, as host tensors with the tier each came from
                               (onboarding's thread; `installed` then adds the copy into the paged cache
                               to that tier's onboarding time).

Each block that enters or leaves a tier is an event (`event_sink.stored/removed` with the tier), so the
router's KV index follows the tiers as it follows the paged cache.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import torch

from engine.kv_cache.tiers.disk_tier import DiskTier
from engine.kv_cache.tiers.host_tier import HostTier
from engine.kv_cache.tiers.offload import OffloadQueue
from engine.kv_cache.tiers.spec import TierSpec
from proto.pdserve.v1 import kv_events_pb2 as kpb

TIER_IDS = {"host": kpb.KV_CACHE_TIER_HOST, "disk": kpb.KV_CACHE_TIER_DISK}


@dataclass(slots=True)
class TierCounters:
    num_lookups: int = 0         # prompt blocks requests wanted past the paged cache's hit (`looked_up`)
    num_hits: int = 0            # of them, blocks this tier served
    offload_bytes: int = 0       # written into this tier
    onboard_bytes: int = 0       # read from this tier into the paged cache
    onboard_s: float = 0.0       # time spent reading them


def check_specs(specs: list[TierSpec] | tuple[TierSpec, ...]) -> None:
    """Raise ValueError naming `tiers[i].<field>` when the list cannot be used."""
    kinds = []
    for i, spec in enumerate(specs):
        try:
            spec.check()
        except ValueError as e:
            raise ValueError(f"tiers[{i}].{e}") from None
        if spec.kind in kinds:
            raise ValueError(f"tiers[{i}].kind: one {spec.kind} tier at most")
        kinds.append(spec.kind)
    if kinds == ["disk", "host"]:
        raise ValueError("tiers[1].kind: the host tier goes above the disk tier (list it first)")


class KVTiers:
    """The tier stack of one paged cache `kv_cache` ([L, num_blocks, 2, Hkv, bs, D])."""

    def __init__(self, specs: list[TierSpec] | tuple[TierSpec, ...], kv_cache: torch.Tensor, fingerprint: str,
                 event_sink=None, offload_queue_blocks: int = 64):
        """`fingerprint` names the model and cache layout (disk blocks of another are refused). Raises
        ValueError naming `tiers[i].<field>` for a spec that cannot be used (an unwritable directory)."""
        check_specs(specs)
        self.kv_cache = kv_cache
        block = kv_cache[:, 0]
        self.bytes_per_block = block.numel() * block.element_size()
        self.tiers: list[HostTier | DiskTier] = []
        for i, spec in enumerate(specs):
            if spec.kind == "host":
                self.tiers.append(HostTier(spec.capacity_bytes, pin=kv_cache.is_cuda))
                continue
            try:
                self.tiers.append(DiskTier(spec.path, spec.capacity_bytes, fingerprint, kv_cache.dtype,
                                           tuple(block.shape), spec.fsync, spec.reopen))
            except ValueError as e:
                raise ValueError(f"tiers[{i}].{e}") from None
        self.counters = [TierCounters() for _ in self.tiers]
        self.event_sink = event_sink
        self.lock = threading.Lock()      # the stack's moves between tiers (offload thread, disabling, snapshots)
        self.offload = OffloadQueue(self._store, offload_queue_blocks)

    def held(self) -> list[tuple[int, list[bytes]]]:
        """(tier id, hashes) of every tier that is on, top first (snapshots; `lock` held)."""
        return [(TIER_IDS[tier.kind], tier.hashes()) for tier in self.tiers if tier.enabled]

    def announce(self) -> None:
        """Publish the blocks tiers already hold (a reopened disk tier)."""
        for tier in self.tiers:
            for block_hash in tier.hashes():
                self._event("stored", tier, block_hash)

    def _event(self, kind: str, tier, block_hash: bytes) -> None:
        if self.event_sink is not None:
            getattr(self.event_sink, kind)(-1, block_hash, tier=TIER_IDS[tier.kind])

    # ---- offload -------------------------------------------------------
    def holds(self, block_hash: bytes) -> bool:
        return any(tier.enabled and block_hash in tier for tier in self.tiers)

    def evicted(self, block_id: int, block_hash: bytes) -> None:
        """The BlockManager's eviction hook (its lock held): copy the block before it is reused."""
        for tier in self.tiers:
            if tier.enabled and tier.touch(block_hash):
                return
        if any(tier.enabled for tier in self.tiers):
            self.offload.offer(block_hash, self.kv_cache[:, block_id])

    def _store(self, block_hash: bytes, rows: torch.Tensor) -> None:
        """Offload thread: the block into the top tier that is on, and what it pushes out further down."""
        block = rows.to("cpu")
        with self.lock:
            self._put(0, block_hash, block)

    def _put(self, index: int, block_hash: bytes, block: torch.Tensor) -> None:
        while index < len(self.tiers) and not self.tiers[index].enabled:
            index += 1
        if index == len(self.tiers):
            return
        tier, counters = self.tiers[index], self.counters[index]
        had = block_hash in tier
        out = tier.put(block_hash, block)
        if block_hash in tier and not had:
            counters.offload_bytes += block.numel() * block.element_size()
            self._event("stored", tier, block_hash)
        if isinstance(tier, HostTier):
            for old_hash, old in out:
                if old_hash != block_hash:
                    self._event("removed", tier, old_hash)
                self._put(index + 1, old_hash, old)
        else:
            for old_hash in out:
                self._event("removed", tier, old_hash)

    # ---- onboard -------------------------------------------------------
    def count(self, hashes: list[bytes]) -> int:
        """How many leading `hashes` some tier that is on holds."""
        n = 0
        for block_hash in hashes:
            if not self.holds(block_hash):
                break
            n += 1
        return n

    def looked_up(self, num_blocks: int) -> None:
        """A request wanted `num_blocks` prompt blocks the paged cache lacks (each tier's hit rate is the
        share of these it served)."""
        for counters, tier in zip(self.counters, self.tiers):
            if tier.enabled:
                counters.num_lookups += num_blocks

    def load(self, hashes: list[bytes]) -> list[tuple[torch.Tensor, int]]:
        """The leading blocks of `hashes` the tiers hold and that pass their checks (a failing disk block
        is dropped: the rest of the prefix is then recomputed), each with the index of its tier. Counts
        hits, bytes and the time the reads took."""
        blocks = []
        for block_hash in hashes:
            for tier, counters in zip(self.tiers, self.counters):
                held = tier.enabled and block_hash in tier
                start = time.perf_counter()
                block = tier.get(block_hash) if held else None
                if block is None:
                    if held and block_hash not in tier:      # it failed a check: the tier dropped it
                        self._event("removed", tier, block_hash)
                    continue
                counters.num_hits += 1
                counters.onboard_bytes += self.bytes_per_block
                counters.onboard_s += time.perf_counter() - start
                blocks.append((block, self.tiers.index(tier)))
                break
            else:
                break
        return blocks

    def installed(self, index: int, seconds: float) -> None:
        """A block read from tier `index` took `seconds` to copy into the paged cache."""
        self.counters[index].onboard_s += seconds

    def disable(self, index: int, reason: str) -> None:
        """Turn a disk tier off (tests, an operator): its blocks leave the index."""
        with self.lock:
            for block_hash in self.tiers[index].disable(reason):
                self._event("removed", self.tiers[index], block_hash)

    def close(self) -> None:
        self.offload.close()

    # ---- stats ---------------------------------------------------------
    def onboard_bytes_per_s(self) -> dict[str, float]:
        """Measured read bandwidth of each tier into the paged cache (0 before its first onboard)."""
        return {t.kind: (c.onboard_bytes / c.onboard_s if c.onboard_s > 0 else 0.0)
                for t, c in zip(self.tiers, self.counters)}

    def stats(self) -> list[dict]:
        """One entry per tier, top first."""
        out = []
        for tier, c in zip(self.tiers, self.counters):
            out.append({
                "kind": tier.kind, "enabled": tier.enabled, "num_blocks": tier.num_blocks,
                "num_bytes": tier.num_bytes, "capacity_bytes": tier.capacity_bytes,
                "num_lookups": c.num_lookups, "num_hits": c.num_hits,
                "hit_rate": c.num_hits / c.num_lookups if c.num_lookups else 0.0,
                "offload_bytes": c.offload_bytes, "onboard_bytes": c.onboard_bytes,
                "onboard_bytes_per_s": c.onboard_bytes / c.onboard_s if c.onboard_s > 0 else 0.0,
                "onboard_s_per_block": c.onboard_s / c.num_hits if c.num_hits else 0.0,
                "num_corrupt": getattr(tier, "num_corrupt", 0),
                "num_dropped_offloads": self.offload.num_dropped})
        return out
