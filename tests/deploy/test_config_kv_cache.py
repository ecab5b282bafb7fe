"""The kv_cache section's block budget (deploy/config/kv_cache.py)."""
from __future__ import annotations

from deploy.config import KVCacheSection


def test_resolve_num_blocks():
    assert KVCacheSection(num_blocks=7).resolve_num_blocks(1024) == 7
    assert KVCacheSection(memory_gib=1).resolve_num_blocks(1 << 20) == 1024
    assert KVCacheSection(memory_fraction=0.5).resolve_num_blocks(100, free_bytes=1000) == 5
    assert KVCacheSection().resolve_num_blocks(100, free_bytes=1000) == 9  # default 0.9
