"""Tiers below the paged cache: offload on eviction, onboard before scheduling, checked disk blocks."""
from __future__ import annotations

import errno
import os
import threading

import pytest
import torch

from engine import Engine, EngineArgs, SamplingParams
from engine.kv_cache.block_manager import prompt_block_hashes
from engine.kv_cache.tiers import KVTiers, OffloadQueue, TierSpec
from engine.kv_cache.tiers import disk_tier
from proto.pdserve.v1 import kv_events_pb2 as kpb
from waiting import wait_until

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPT = [7] * 40 + list(range(3, 113))               # 150 tokens: 9 full blocks of 16 + 6
FILLERS = [[t] * 150 for t in range(120, 124)]       # each takes 10 of the pool's 24 blocks
NUM_HIT_TOKENS = 9 * 16


def _engine(model_dir, tiers=(), num_blocks=24, **kw) -> Engine:
    return Engine(EngineArgs(model_dir, dtype="float32", attention="eager", num_blocks=num_blocks, block_size=16,
                             kv_tiers=tuple(tiers), **kw))


def _rows(engine: Engine, hashes: list[bytes]) -> torch.Tensor:
    ids = engine.block_manager.match_prefix(hashes)
    assert len(ids) == len(hashes)
    return engine.kv_cache[:, ids].clone()


def _evict(engine: Engine, hashes: list[bytes]) -> None:
    """Run other prompts until none of `hashes` is in the paged cache; wait for their offload."""
    for filler in FILLERS:
        engine.generate([filler], GREEDY)
    assert engine.block_manager.match_prefix(hashes) == []
    assert engine.kv_tiers.offload.drain(timeout=30)


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """The prompt's output without any cache, and its blocks' rows as computed."""
    engine = _engine(tiny_model_dir, num_blocks=64)
    out = engine.generate([PROMPT], GREEDY)[0]
    return out.token_ids, _rows(engine, prompt_block_hashes(PROMPT, 16)[:9])


@pytest.mark.parametrize("kind", ["host", "disk"])
def test_offload_evict_onboard_is_bit_identical(tiny_model_dir, tmp_path, reference, kind):
    tokens, rows = reference
    engine = _engine(tiny_model_dir, [TierSpec(kind, 1 << 30, path=str(tmp_path / "kv"))])
    hashes = prompt_block_hashes(PROMPT, 16)[:9]
    first = engine.generate([PROMPT], GREEDY)[0]
    _evict(engine, hashes)
    assert engine.kv_tiers.count(hashes) == 9
    again = engine.generate([PROMPT], GREEDY)[0]
    assert again.num_cached_tokens == NUM_HIT_TOKENS       # every full block came back from the tier
    assert first.token_ids == again.token_ids == tokens
    assert torch.equal(_rows(engine, hashes), rows)         # the onboarded blocks, bit for bit
    stats = engine.kv_tiers.stats()[0]
    assert stats["num_hits"] == 9 and stats["onboard_bytes"] == 9 * engine.kv_bytes_per_block
    # the prompt, each filler and the prompt again each wanted 9 blocks below the paged cache: 9 were here
    assert stats["num_lookups"] == 6 * 9 and stats["hit_rate"] == 9 / 54
    assert engine.onboarding.num_onboarded_blocks == 9
    engine.block_manager.check_no_leaks()


def test_host_overflow_moves_down_to_disk(tiny_model_dir, tmp_path, reference):
    block_bytes = _engine(tiny_model_dir, num_blocks=2).kv_bytes_per_block
    tiers = [TierSpec("host", 12 * block_bytes), TierSpec("disk", 1 << 30, path=str(tmp_path))]
    engine = _engine(tiny_model_dir, tiers)
    hashes = prompt_block_hashes(PROMPT, 16)[:9]
    engine.generate([PROMPT], GREEDY)
    _evict(engine, hashes)
    host, disk = engine.kv_tiers.tiers
    assert host.num_blocks == 12 and not any(h in host for h in hashes)     # pushed out of the host tier
    assert all(h in disk for h in hashes)
    again = engine.generate([PROMPT], GREEDY)[0]
    assert again.num_cached_tokens == NUM_HIT_TOKENS and again.token_ids == reference[0]
    engine.block_manager.check_no_leaks()


def _block_file(tmp_path, block_hash: bytes) -> str:
    return os.path.join(tmp_path, block_hash.hex() + disk_tier.SUFFIX)


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_damaged_disk_block_is_dropped_and_recomputed(tiny_model_dir, tmp_path, reference, damage):
    engine = _engine(tiny_model_dir, [TierSpec("disk", 1 << 30, path=str(tmp_path))])
    hashes = prompt_block_hashes(PROMPT, 16)[:9]
    engine.generate([PROMPT], GREEDY)
    _evict(engine, hashes)
    path = _block_file(tmp_path, hashes[4])
    with open(path, "r+b") as f:
        if damage == "flip":
            f.seek(-7, os.SEEK_END)
            byte = f.read(1)
            f.seek(-7, os.SEEK_END)
            f.write(bytes([byte[0] ^ 0x40]))
        else:
            f.truncate(os.path.getsize(path) - 100)
    again = engine.generate([PROMPT], GREEDY)[0]
    assert again.num_cached_tokens == 4 * 16               # blocks 0..3 onboarded; 4.. recomputed
    assert again.token_ids == reference[0]
    tier = engine.kv_tiers.tiers[0]
    assert tier.num_corrupt == 1 and not os.path.exists(path) and hashes[4] not in tier
    stats = engine.kv_tiers.stats()[0]
    assert (stats["num_lookups"], stats["num_hits"], stats["num_corrupt"]) == (6 * 9, 4, 1)
    engine.block_manager.check_no_leaks()


def test_full_disk_turns_the_tier_off_and_serving_continues(tiny_model_dir, tmp_path, reference, monkeypatch):
    engine = _engine(tiny_model_dir, [TierSpec("disk", 1 << 30, path=str(tmp_path))])
    engine.generate([FILLERS[0]], GREEDY)
    engine.generate([FILLERS[1]], GREEDY)
    engine.generate([FILLERS[2]], GREEDY)                 # evicts the first filler's blocks to disk
    assert engine.kv_tiers.offload.drain(timeout=30)
    tier = engine.kv_tiers.tiers[0]
    assert tier.num_blocks > 0

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(disk_tier, "open", full, raising=False)
    out = [engine.generate([p], GREEDY)[0] for p in [PROMPT] + FILLERS]
    assert engine.kv_tiers.offload.drain(timeout=30)
    assert out[0].token_ids == reference[0]
    assert not tier.enabled and tier.num_blocks == 0 and "No space left" in tier.disabled_reason
    assert engine.kv_tiers.stats()[0]["enabled"] is False
    engine.block_manager.check_no_leaks()


def test_events_carry_the_tier(tiny_model_dir, tmp_path):
    engine = _engine(tiny_model_dir, [TierSpec("host", 1 << 30)])
    hashes = prompt_block_hashes(PROMPT, 16)[:9]
    engine.generate([PROMPT], GREEDY)
    _evict(engine, hashes)
    stored = {}
    for batch in engine.kv_events.answer(kpb.KVEventsRequest()).batches:
        for event in batch.events:
            if event.kind == kpb.KV_CACHE_EVENT_KIND_STORED:
                for h in event.block_hashes:
                    stored.setdefault(h, set()).add(event.tier)
    assert all(stored[h] == {kpb.KV_CACHE_TIER_UNSPECIFIED, kpb.KV_CACHE_TIER_HOST} for h in hashes)
    snapshot = engine.kv_events.snapshot().snapshot
    assert [t.tier for t in snapshot.tiers] == [kpb.KV_CACHE_TIER_HOST]
    assert set(hashes) <= set(snapshot.tiers[0].block_hashes)
    assert not set(hashes) & set(snapshot.block_hashes)


def test_reopened_disk_tier_serves_and_publishes(tiny_model_dir, tmp_path, reference):
    spec = TierSpec("disk", 1 << 30, path=str(tmp_path), reopen=True, fsync="always")
    first = _engine(tiny_model_dir, [spec])
    hashes = prompt_block_hashes(PROMPT, 16)[:9]
    first.generate([PROMPT], GREEDY)
    _evict(first, hashes)
    first.kv_tiers.close()
    second = _engine(tiny_model_dir, [spec])               # a restarted actor
    published = {h for b in second.kv_events.answer(kpb.KVEventsRequest()).batches for e in b.events
                 if e.tier == kpb.KV_CACHE_TIER_DISK for h in e.block_hashes}
    assert set(hashes) <= published
    again = second.generate([PROMPT], GREEDY)[0]
    assert again.num_cached_tokens == NUM_HIT_TOKENS and again.token_ids == reference[0]
    fresh = _engine(tiny_model_dir, [TierSpec("disk", 1 << 30, path=str(tmp_path))])   # reopen off: emptied
    assert fresh.kv_tiers.tiers[0].num_blocks == 0 and not os.listdir(tmp_path)


@pytest.mark.parametrize("asked", [True, False])
def test_decode_side_counts_and_pins_tier_blocks(tiny_model_dir, reference, asked):
    """The router's question starts loading the tier blocks (the job then pins them from the paged cache);
    a job the question did not precede reads them itself."""
    engine = _engine(tiny_model_dir, [TierSpec("host", 1 << 30)])
    hashes = prompt_block_hashes(PROMPT, 16)[:9]
    engine.generate([PROMPT], GREEDY)
    _evict(engine, hashes)
    if asked:
        assert engine.cached_prefix_blocks(hashes) == 9      # what the router asks: the transfer skips them
        engine.onboarding.await_prefetch(hashes, timeout=30)
        assert len(engine.block_manager.match_prefix(hashes)) == 9      # in the paged cache already
        assert engine.cached_prefix_blocks(hashes) == 9 and engine.onboarding.num_onboarded_blocks == 9
    req = engine.expect_kv("r", PROMPT, GREEDY, transfer_id="t", deadline=float("inf"), num_cached_blocks=9)
    assert len(req.block_table) == 9 and engine.onboarding.num_onboarded_blocks == 9
    assert torch.equal(engine.kv_cache[:, req.block_table], reference[1])
    engine.abort("r")
    engine.block_manager.check_no_leaks()


def test_full_offload_queue_drops_and_counts():
    started, release = threading.Event(), threading.Event()
    stored = []

    def store(block_hash, block):
        started.set()
        release.wait(30)
        stored.append(block_hash)
    queue = OffloadQueue(store, max_blocks=1)
    rows = torch.zeros(4)
    assert queue.offer(b"a", rows)
    assert started.wait(30)                             # taken by the thread, which now blocks
    assert queue.offer(b"b", rows)                      # fills the queue
    assert not queue.offer(b"c", rows) and queue.num_dropped == 1
    release.set()
    assert queue.drain(timeout=30) and stored == [b"a", b"b"]
    queue.close()


def test_offload_copies_the_block_before_it_is_overwritten():
    kv_cache = torch.arange(2 * 3 * 2 * 1 * 2 * 2, dtype=torch.float32).view(2, 3, 2, 1, 2, 2)
    tiers = KVTiers([TierSpec("host", 1 << 20)], kv_cache, "fp")
    before = kv_cache[:, 1].clone()
    tiers.evicted(1, b"h" * 16)
    kv_cache[:, 1] = -1.0                               # the block's new owner writes at once
    assert tiers.offload.drain(timeout=30)
    assert torch.equal(tiers.tiers[0].get(b"h" * 16), before)
    tiers.close()


@pytest.mark.parametrize("spec, key", [
    (TierSpec("host", 0), "tiers[0].capacity"),
    (TierSpec("disk", 1 << 20), "tiers[0].path"),
    (TierSpec("tape", 1 << 20), "tiers[0].kind"),
    (TierSpec("disk", 1 << 20, path="/dev/null/kv"), "tiers[0].path"),
])
def test_bad_tier_is_an_error_naming_the_key(spec, key):
    with pytest.raises(ValueError, match=key.replace("[", r"\[").replace("]", r"\]")):
        KVTiers([spec], torch.zeros(2, 4, 2, 1, 2, 2), "fp")


def test_a_request_aborted_while_onboarding_leaves_its_blocks_cached(tiny_model_dir):
    engine = _engine(tiny_model_dir, [TierSpec("host", 1 << 30)])
    hashes = prompt_block_hashes(PROMPT, 16)[:9]
    engine.generate([PROMPT], GREEDY)
    _evict(engine, hashes)
    rid = engine.add_request(PROMPT, GREEDY)
    assert engine.onboarding.num_pending == 1 and engine.has_unfinished()
    assert engine.abort(rid).finish_reason == "abort"
    assert not engine.has_unfinished() and rid not in engine.requests
    wait_until(lambda: len(engine.block_manager.match_prefix(hashes)) == 9, timeout=30)
    engine.block_manager.check_no_leaks()


def test_an_fp8_cache_round_trips_as_stored(tiny_model_dir):
    plain = _engine(tiny_model_dir, num_blocks=64, kv_cache_dtype="fp8")
    expected = plain.generate([PROMPT], GREEDY)[0].token_ids
    hashes = prompt_block_hashes(PROMPT, 16)[:9]
    rows = _rows(plain, hashes)
    engine = _engine(tiny_model_dir, [TierSpec("host", 1 << 30)], kv_cache_dtype="fp8")
    engine.generate([PROMPT], GREEDY)
    _evict(engine, hashes)
    again = engine.generate([PROMPT], GREEDY)[0]
    assert again.num_cached_tokens == NUM_HIT_TOKENS and again.token_ids == expected
    assert torch.equal(_rows(engine, hashes), rows)           # byte cells and scales, bit for bit


def test_without_a_prefix_cache_nothing_is_offloaded_or_onboarded(tiny_model_dir, reference):
    engine = _engine(tiny_model_dir, [TierSpec("host", 1 << 30)], enable_prefix_cache=False)
    for prompt in [PROMPT, *FILLERS, PROMPT]:
        out = engine.generate([prompt], GREEDY)[0]
    assert engine.kv_tiers.offload.drain(timeout=30)
    assert out.num_cached_tokens == 0 and out.token_ids == reference[0]
    assert engine.kv_tiers.tiers[0].num_blocks == 0 and engine.onboarding.num_onboarded_blocks == 0
    assert engine.cached_prefix_blocks(prompt_block_hashes(PROMPT, 16)) == 0
    engine.block_manager.check_no_leaks()
