"""Onboarding: a prompt prefix found in a tier is loaded back into the paged cache before it is scheduled.

    start(req)          engine thread, as a request comes in: the prompt's blocks past the paged cache's
                        hit that some tier holds are read and installed on this module's thread (disk reads
                        and checks included): written into free blocks of the paged cache and registered
                        under their hashes, then released (cached, most recently used). The request waits
                        here, not in the scheduler. False: nothing to load.
    ready()             engine thread, at each step: the requests whose blocks are in the paged cache now;
                        they go to the scheduler, whose prefix match finds them: prefill computes the rest.
    prefetch(hashes)    decode side, any thread (the router asking how much of a prompt this actor holds):
                        the count includes what the tiers hold, and those blocks start loading into the
                        paged cache at once, so the transfer that follows skips them.
    await_prefetch()    decode side (`Engine.expect_kv`): wait (bounded) for such a load before pinning.
    pin(hashes)         decode side, the fallback: load on the calling thread and keep a reference.

A block that fails a check ends the loaded run there; the rest of the prompt is computed. When the paged
cache has too few free blocks, fewer are installed: the request computes the others. Installing takes the
block manager's lock, as a KV receiver does: nothing else writes a block it has just allocated.
"""
from __future__ import annotations

import threading
import time
from concurrent import futures

import torch

from engine.kv_cache.block_manager import BlockManager, prompt_block_hashes
from engine.kv_cache.tiers.tiered_cache import KVTiers


class Onboarding:
    def __init__(self, tiers: KVTiers, block_manager: BlockManager, kv_cache: torch.Tensor):
        self.tiers = tiers
        self.block_manager = block_manager
        self.kv_cache = kv_cache
        self.num_onboarded_blocks = 0
        self._pool = futures.ThreadPoolExecutor(1, thread_name_prefix="kv-onboard")
        self._pending: list[tuple[object, futures.Future]] = []        # (request, its load): engine thread
        self._prefetches: list[tuple[frozenset[bytes], futures.Future]] = []    # any thread, under _lock
        self._lock = threading.Lock()

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def _split(self, hashes: list[bytes]) -> tuple[list[bytes], list[bytes]]:
        """(the leading hashes the paged cache holds, the ones after them that some tier holds), counting
        the rest as looked up in the tiers; nothing without a prefix cache (blocks loaded back could not
        be found)."""
        if not self.block_manager.enable_prefix_cache:
            return [], []
        with self.block_manager.lock:
            num_device = len(self.block_manager.match_prefix(hashes))
        rest = hashes[num_device:]
        if rest:
            self.tiers.looked_up(len(rest))
        return hashes[:num_device], rest[:self.tiers.count(rest)]

    # ---- prefill and colocated: a request waits for its blocks ------------
    def start(self, req) -> bool:
        """Begin loading the tier blocks of `req`'s prompt (an engine Request); False if there are none."""
        if req.owes_prompt_logprobs or req.prompt_kv_lossy:      # as the scheduler: no prefix hits for them
            return False
        block_size = self.block_manager.block_size
        device, wanted = self._split(prompt_block_hashes(req.all_token_ids, block_size)
                                     [:(req.num_tokens - 1) // block_size])
        if not wanted:
            return False
        self._pending.append((req, self._pool.submit(self._onboard, device, wanted)))
        return True

    def ready(self) -> list:
        """Requests whose blocks are in the paged cache now (or could not be loaded: they compute them)."""
        done = [req for req, load in self._pending if load.done()]
        if done:
            self._pending = [(req, load) for req, load in self._pending if not load.done()]
        return done

    def wait(self, timeout: float) -> None:
        """Wait up to `timeout` for one pending load (an engine with nothing else to do)."""
        if self._pending:
            futures.wait([load for _, load in self._pending], timeout, futures.FIRST_COMPLETED)

    def cancel(self, req) -> None:
        """Forget `req` (aborted); its blocks still land in the paged cache, cached for whoever comes next."""
        self._pending = [(r, load) for r, load in self._pending if r is not req]

    # ---- decode side: the transfer skips what this actor can onboard -------
    def prefetch(self, hashes: list[bytes]) -> int:
        """How many leading `hashes` the paged cache holds or a tier can onboard; those in a tier start
        loading into the paged cache now (once per run of hashes in flight)."""
        device, wanted = self._split(hashes)
        if wanted:
            with self._lock:
                self._prefetches = [(keys, load) for keys, load in self._prefetches if not load.done()]
                if not any(wanted[-1] in keys for keys, _ in self._prefetches):
                    self._prefetches.append((frozenset(wanted), self._pool.submit(self._onboard, device, wanted)))
        return len(device) + len(wanted)

    def await_prefetch(self, hashes: list[bytes], timeout: float) -> None:
        """Wait up to `timeout` for the prefetches of any of `hashes` still in flight."""
        with self._lock:
            loads = [load for keys, load in self._prefetches if not keys.isdisjoint(hashes)]
        if loads:
            futures.wait(loads, timeout)

    def pin(self, hashes: list[bytes]) -> list[int]:
        """Load the leading blocks of `hashes` the tiers hold now, on this thread; their block ids, each
        with a reference the caller owns."""
        blocks = self.tiers.load(hashes[:self.tiers.count(hashes)])
        with self.block_manager.lock:
            return self._install(hashes, blocks)

    # ---- the onboarding thread -----------------------------------------
    def _onboard(self, device_hashes: list[bytes], hashes: list[bytes]) -> int:
        """Read `hashes`' blocks from the tiers and install them behind `device_hashes` (which must still be
        cached: else the installed blocks could never be matched); how many were installed."""
        blocks = self.tiers.load(hashes)
        bm = self.block_manager
        with bm.lock:
            held = bm.match_prefix(device_hashes)
            if len(held) < len(device_hashes):
                return 0
            bm.touch(held)            # the prefix before them must outlive the allocation below
            ids = self._install(hashes, blocks)
            bm.free(ids)
            bm.free(held)
        return len(ids)

    def _install(self, hashes: list[bytes], blocks: list[tuple[torch.Tensor, int]]) -> list[int]:
        """Write `blocks` (the leading blocks of `hashes`, each with its tier) into fresh blocks, registered;
        their ids, referenced once (block manager's lock held)."""
        bm = self.block_manager
        ids = bm.allocate(min(len(blocks), bm.num_free_blocks)) or []
        for block_id, block_hash, (block, tier) in zip(ids, hashes, blocks):
            start = time.perf_counter()
            self.kv_cache[:, block_id].copy_(block)        # [L, 2, Hkv, bs, D]; from pinned memory: synchronous
            self.tiers.installed(tier, time.perf_counter() - start)
            bm.register(block_id, block_hash)
        self.num_onboarded_blocks += len(ids)
        return ids

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
