"""Tiers below the paged KV cache: host memory and local disk (`kv_cache.tiers`).

    spec.py           TierSpec: a tier's kind, capacity, directory and fsync policy
    host_tier.py      HostTier: blocks in host memory (pinned on CUDA actors), LRU
    disk_tier.py      DiskTier: one checked file per block (fingerprint, chained hash, checksum), LRU
    offload.py        OffloadQueue: evicted blocks copied at eviction, written down on a thread; bounded
    tiered_cache.py   KVTiers: the stack (host over disk), its events, counters and lookups
    onboard.py        Onboarding: a prefix found in a tier loaded back before the request is scheduled
"""
from engine.kv_cache.tiers.disk_tier import DiskTier
from engine.kv_cache.tiers.host_tier import HostTier
from engine.kv_cache.tiers.offload import OffloadQueue
from engine.kv_cache.tiers.onboard import Onboarding
from engine.kv_cache.tiers.spec import TierSpec
from engine.kv_cache.tiers.tiered_cache import KVTiers, check_specs

__all__ = ["DiskTier", "HostTier", "KVTiers", "OffloadQueue", "Onboarding", "TierSpec", "check_specs"]
