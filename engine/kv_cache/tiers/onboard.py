"""Onboarding: a prompt prefix found in a tier is loaded back into the paged cache before it is scheduled.

    start(req)      engine thread, as a request comes in: the prompt's blocks past the paged cache's hit
                    that some tier holds are read on this module's thread (disk reads and checks
                    included); the request waits here, not in the scheduler. False: nothing to load.
    ready()         engine thread, at each step: requests whose reads finished. Their blocks are written
                    into free blocks of the paged cache and registered under their hashes (then released:
                    they stay cached, most recently used), and the requests go to the scheduler, whose
                    prefix match now finds them: prefill computes only the rest.
    pin(hashes)     decode side (`Engine.expect_kv`): load now and keep a reference, so the transfer
                    skips blocks this actor can onboard.

A block that fails a check ends the loaded run there; the rest of the prompt is computed. When the paged
cache has too few free blocks, fewer are installed: the request computes the others.
"""
from __future__ import annotations

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
        # (request, its prompt's hashes the paged cache held, the hashes being read, the reads)
        self._pending: list[tuple[object, list[bytes], list[bytes], futures.Future]] = []

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def start(self, req) -> bool:
        """Begin loading the tier blocks of `req`'s prompt (an engine Request); False if there are none."""
        if req.owes_prompt_logprobs or req.prompt_kv_lossy:      # as the scheduler: no prefix hits for them
            return False
        block_size = self.block_manager.block_size
        hashes = prompt_block_hashes(req.all_token_ids, block_size)[:(req.num_tokens - 1) // block_size]
        with self.block_manager.lock:
            num_device = len(self.block_manager.match_prefix(hashes))
        wanted = hashes[num_device:num_device + self.tiers.count(hashes[num_device:])]
        if not wanted:
            return False
        self._pending.append((req, hashes[:num_device], wanted, self._pool.submit(self.tiers.load, wanted)))
        return True

    def ready(self) -> list:
        """Requests whose blocks were read, with the blocks now in the paged cache."""
        done, still = [], []
        for entry in self._pending:
            (done if entry[3].done() else still).append(entry)
        self._pending = still
        bm = self.block_manager
        for _, device_hashes, hashes, reads in done:
            blocks = reads.result() if reads.exception() is None else []
            with bm.lock:        # the prefix the paged cache holds must outlive the allocation below
                held = bm.match_prefix(device_hashes)
                bm.touch(held)
                ids = self._install(hashes, blocks) if len(held) == len(device_hashes) else []
                bm.free(ids)
                bm.free(held)
        return [entry[0] for entry in done]

    def wait(self, timeout: float) -> None:
        """Wait up to `timeout` for one pending read (an engine with nothing else to do)."""
        if self._pending:
            futures.wait([entry[3] for entry in self._pending], timeout, futures.FIRST_COMPLETED)

    def cancel(self, req) -> None:
        """Forget `req` (aborted); its reads finish unused."""
        self._pending = [e for e in self._pending if e[0] is not req]

    def pin(self, hashes: list[bytes]) -> list[int]:
        """Load the leading blocks of `hashes` the tiers hold now, on this thread; their block ids, each
        with a reference the caller owns."""
        return self._install(hashes, self.tiers.load(hashes[:self.tiers.count(hashes)]))

    def _install(self, hashes: list[bytes], blocks: list[tuple[torch.Tensor, int]]) -> list[int]:
        """Write `blocks` (the leading blocks of `hashes`, each with its tier) into fresh blocks, registered;
        their ids."""
        bm = self.block_manager
        with bm.lock:
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
