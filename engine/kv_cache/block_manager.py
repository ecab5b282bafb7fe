"""Block pool with reference counts and a prefix cache of full blocks.

A block is free when its `ref_count` is 0. Free blocks that hold a full,
hashed block of tokens stay findable by hash (the prefix cache) until they are
reused; reuse takes the least recently freed block first (LRU by block).
Block hashes are chained: hash(block i) covers the tokens of blocks 0..i.
`event_sink` (engine.kv_cache.events) hears of every hash that becomes findable
(`stored`) and every one dropped when its block is reused (`removed`); `evict_sink`
(engine.kv_cache.tiers) is told of each hashed block just before it is reused, while its
rows still hold that block's KV, so it can copy them down a tier.
"""
from __future__ import annotations

import hashlib
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass

FREED = -1   # a block-table entry whose block was released (wholly outside the sliding window)


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None


def _pack(token_ids: list[int] | tuple[int, ...]) -> bytes:
    return struct.pack(f"<{len(token_ids)}I", *token_ids)


def _chain(parent: bytes | None, packed: bytes) -> bytes:
    """One block's hash: its packed token ids after its parent's hash."""
    h = hashlib.blake2b(parent or b"", digest_size=16)
    h.update(packed)
    return h.digest()


def hash_block(parent: bytes | None, token_ids: list[int] | tuple[int, ...]) -> bytes:
    return _chain(parent, _pack(token_ids))


def prompt_block_hashes(token_ids: list[int], block_size: int) -> list[bytes]:
    """Chained hashes of every full block of `token_ids` (what the router computes too): `hash_block`'s,
    with the prompt packed once and each block's hash over its slice of those bytes."""
    num_blocks = len(token_ids) // block_size
    if num_blocks == 0:
        return []
    packed = _pack(token_ids[:num_blocks * block_size])
    step = 4 * block_size
    hashes: list[bytes] = []
    parent = None
    for start in range(0, len(packed), step):
        parent = _chain(parent, packed[start:start + step])
        hashes.append(parent)
    return hashes


def blocks_needed(num_prompt_tokens: int, max_tokens: int, num_sequences: int, block_size: int) -> int:
    """KV blocks a request can fill on the decode side (what the router reserves for admission).

    Sequence 0 holds the prompt's blocks and its own output's: ceil((prompt + max_tokens) / block_size).
    Every other sequence shares the prompt's full blocks and owns a copy of the partial last one plus
    its output's blocks: that count less the prompt's full blocks.
    """
    per_sequence = -(-(num_prompt_tokens + max_tokens) // block_size)
    return per_sequence + (num_sequences - 1) * (per_sequence - num_prompt_tokens // block_size)


class BlockManager:
    """Owns every block; requests own only their block tables (lists of ids).

    Thread-safe: a KV receiver reserves blocks from its own threads while the
    engine loop schedules; multi-call sequences hold `lock` (re-entrant).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_cache: bool = True):
        assert num_blocks > 0 and block_size > 0
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[bytes, int] = {}
        self.enable_prefix_cache = enable_prefix_cache
        self.lock = threading.RLock()
        self.event_sink = None           # engine.kv_cache.events.KVEventSink: told of each change to `cached`
        self.evict_sink = None           # evict_sink(block_id, block_hash): a cached block is about to be reused

    # ---- capacity -------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return len(self.blocks) - len(self.free_queue)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self.free_queue)

    # ---- prefix cache ---------------------------------------------------
    def match_prefix(self, hashes: list[bytes]) -> list[int]:
        """Ids of the longest run of cached blocks matching `hashes` (not yet referenced)."""
        if not self.enable_prefix_cache:
            return []
        ids = []
        for h in hashes:
            block_id = self.cached.get(h)
            if block_id is None:
                break
            ids.append(block_id)
        return ids

    def touch(self, block_ids: list[int]) -> None:
        """Take a reference on cached blocks (prefix hits)."""
        with self.lock:
            for block_id in block_ids:
                block = self.blocks[block_id]
                if block.ref_count == 0:
                    del self.free_queue[block_id]
                block.ref_count += 1

    def register(self, block_id: int, block_hash: bytes) -> None:
        """Mark a full block as holding the tokens `block_hash` describes."""
        with self.lock:
            if not self.enable_prefix_cache:
                return
            block = self.blocks[block_id]
            if block.block_hash is not None or block_hash in self.cached:
                return
            block.block_hash = block_hash
            self.cached[block_hash] = block_id
            if self.event_sink is not None:
                self.event_sink.stored(block_id, block_hash)

    # ---- allocate / free ------------------------------------------------
    def allocate(self, num_blocks: int) -> list[int] | None:
        """Fresh blocks with ref_count 1, evicting LRU cached blocks; None if too few are free."""
        with self.lock:
            if num_blocks > len(self.free_queue):
                return None
            ids = []
            for _ in range(num_blocks):
                block_id, _ = self.free_queue.popitem(last=False)
                block = self.blocks[block_id]
                assert block.ref_count == 0
                if block.block_hash is not None:
                    if self.evict_sink is not None:
                        self.evict_sink(block_id, block.block_hash)
                    del self.cached[block.block_hash]
                    if self.event_sink is not None:
                        self.event_sink.removed(block_id, block.block_hash)
                    block.block_hash = None
                block.ref_count = 1
                ids.append(block_id)
            return ids

    def share(self, block_ids: list[int]) -> None:
        """One more reference on blocks already in use (a forked sequence shares its prompt's full blocks).
        FREED entries are skipped."""
        with self.lock:
            for block_id in block_ids:
                if block_id == FREED:
                    continue
                block = self.blocks[block_id]
                assert block.ref_count > 0, f"sharing unreferenced block {block_id}"
                block.ref_count += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference on each block, in reverse so a request's tail is evicted first.
        FREED entries (released earlier, outside a sliding window) are skipped."""
        with self.lock:
            for block_id in reversed(block_ids):
                if block_id == FREED:
                    continue
                block = self.blocks[block_id]
                assert block.ref_count > 0, f"double free of block {block_id}"
                block.ref_count -= 1
                if block.ref_count == 0:
                    self.free_queue[block_id] = None

    def check_no_leaks(self) -> None:
        """Assert every block is unreferenced (call once all requests finished)."""
        held = [b.block_id for b in self.blocks if b.ref_count]
        assert not held, f"blocks still referenced: {held}"
        assert len(self.free_queue) == len(self.blocks)
