"""`KVIndex` (router.placement.kv_index): batches in order, resent ones skipped, a new epoch starts empty,
a gap asks for a resync, a snapshot replaces one actor's entries, and the prefix queries."""
from __future__ import annotations

from engine.kv_cache.block_manager import prompt_block_hashes
from proto.pdserve.v1 import kv_events_pb2 as kpb
from router.placement.kv_index import KVIndex

H = prompt_block_hashes(list(range(40)), 4)          # 10 chained hashes
STORED, REMOVED = kpb.KV_CACHE_EVENT_KIND_STORED, kpb.KV_CACHE_EVENT_KIND_REMOVED


def batch(seq: int, *runs: tuple[int, list[bytes]]) -> kpb.KVCacheEventBatch:
    return kpb.KVCacheEventBatch(seq=seq, events=[kpb.KVCacheEvent(kind=k, block_hashes=h) for k, h in runs])


def response(epoch: str, last_seq: int, *batches) -> kpb.KVEventsResponse:
    return kpb.KVEventsResponse(epoch=epoch, last_seq=last_seq, batches=list(batches))


def test_batches_apply_in_order_and_resent_ones_are_skipped():
    index = KVIndex()
    b1 = batch(1, (STORED, H[:4]))
    b2 = batch(2, (REMOVED, H[2:4]), (STORED, H[2:3]))
    assert index.apply("a", response("e1", 2, b1, b2))
    assert index.hashes_of("a") == set(H[:3])
    assert index.apply("a", response("e1", 3, b2, batch(3, (STORED, [H[5]]))))   # b2 resent: skipped
    assert index.hashes_of("a") == {*H[:3], H[5]}
    assert index.state("a").seq == 3 and index.state("a").in_sync


def test_a_gap_asks_for_a_resync_and_a_snapshot_replaces_the_actor_entries():
    index = KVIndex()
    assert index.apply("a", response("e1", 1, batch(1, (STORED, H[:4]))))
    assert not index.apply("a", response("e1", 3, batch(3, (STORED, [H[9]]))))     # batch 2 missing
    assert not index.state("a").in_sync and index.state("a").seq == 1
    assert not index.apply("a", response("e1", 2))                                  # last_seq ahead, no batch
    snap = kpb.KVEventsResponse(epoch="e1", last_seq=3, snapshot=kpb.KVCacheSnapshot(block_hashes=H[4:6]))
    assert index.apply("a", snap)
    assert index.hashes_of("a") == set(H[4:6]) and index.state("a").seq == 3 and index.state("a").in_sync
    assert index.prefix_by_actor(H) == {}                                          # H[0] is gone everywhere


def test_a_new_epoch_starts_from_an_empty_cache():
    index = KVIndex()
    assert index.apply("a", response("e1", 1, batch(1, (STORED, H[:4]))))
    assert index.apply("a", response("e2", 1, batch(1, (STORED, H[:1]))))         # restarted actor
    assert index.hashes_of("a") == {H[0]} and index.state("a").epoch == "e2"
    assert not index.apply("a", response("e3", 4, batch(4, (STORED, H[:2]))))     # its batches 1-3 are gone
    assert index.hashes_of("a") == set()


def test_prefix_queries_over_several_actors_and_forget():
    index = KVIndex()
    index.apply("a", response("e", 1, batch(1, (STORED, H[:5]))))
    index.apply("b", response("e", 1, batch(1, (STORED, [*H[:2], *H[3:8]]))))     # b lacks H[2]
    index.apply("c", response("e", 1, batch(1, (STORED, H[1:6]))))                # c lacks the first block
    assert index.prefix_by_actor(H) == {"a": 5, "b": 2}
    assert [index.prefix_blocks(x, H) for x in "abcd"] == [5, 2, 0, 0]
    assert index.prefix_by_actor([]) == {}
    index.forget("a")
    assert index.prefix_by_actor(H) == {"b": 2} and index.actor_ids == ["b", "c"]


def tiered(seq: int, *runs: tuple[int, int, list[bytes]]) -> kpb.KVCacheEventBatch:
    """A batch of (kind, tier, hashes) runs."""
    return kpb.KVCacheEventBatch(seq=seq, events=[kpb.KVCacheEvent(kind=k, tier=t, block_hashes=h)
                                                  for k, t, h in runs])


DEVICE, HOST, DISK = kpb.KV_CACHE_TIER_UNSPECIFIED, kpb.KV_CACHE_TIER_HOST, kpb.KV_CACHE_TIER_DISK


def test_the_index_follows_each_tier_and_a_block_counts_while_any_tier_holds_it():
    index = KVIndex()
    # blocks 0..3 computed; 2, 3 evicted to the host tier; 3 pushed on to disk
    assert index.apply("a", response("e1", 2, tiered(1, (STORED, DEVICE, H[:4])),
                                     tiered(2, (REMOVED, DEVICE, H[2:4]), (STORED, HOST, H[2:4]),
                                            (REMOVED, HOST, H[3:4]), (STORED, DISK, H[3:4]))))
    assert index.hashes_of("a") == set(H[:2])
    assert index.hashes_of("a", HOST) == {H[2]} and index.hashes_of("a", DISK) == {H[3]}
    assert index.prefix_blocks("a", H) == 4 and index.prefix_by_actor(H) == {"a": 4}
    cost = index.tier_cost
    assert index.onboard_cost("a", H, 4) == cost[HOST] + cost[DISK]
    assert index.priced_prefix_by_actor(H) == {"a": 4 - cost[HOST] - cost[DISK]}
    assert index.apply("a", response("e1", 3, tiered(3, (REMOVED, DISK, H[3:4]))))     # left the last tier
    assert index.prefix_by_actor(H) == {"a": 3}
    snap = kpb.KVCacheSnapshot(block_hashes=H[:1], tiers=[kpb.KVCacheTierHashes(tier=DISK, block_hashes=H[1:3])])
    assert index.apply("a", kpb.KVEventsResponse(epoch="e1", last_seq=3, snapshot=snap))
    assert index.hashes_of("a", HOST) == set() and index.hashes_of("a", DISK) == set(H[1:3])
    assert index.onboard_cost("a", H, 3) == 2 * cost[DISK]
    index.forget("a")
    assert index.prefix_by_actor(H) == {}


def test_a_device_hit_beats_host_beats_disk_beats_recompute():
    index = KVIndex()
    for actor, tier in (("device", DEVICE), ("host", HOST), ("disk", DISK)):
        index.apply(actor, response("e", 1, tiered(1, (STORED, tier, H[:6]))))
    priced = index.priced_prefix_by_actor(H)
    assert priced["device"] == 6 > priced["host"] > priced["disk"] > 0      # "recompute" holds nothing: 0


def test_measured_onboarding_prices_the_tiers_in_order():
    index = KVIndex()
    index.measure_tier(HOST, onboard_s_per_block=0.001, recompute_s_per_block=0.1)
    assert index.tier_cost[HOST] == 0.01
    index.measure_tier(DISK, onboard_s_per_block=0.0001, recompute_s_per_block=0.1)   # faster than host?
    assert index.tier_cost[DISK] == index.tier_cost[HOST] == 0.001                    # never below it
    index.measure_tier(DISK, onboard_s_per_block=1.0, recompute_s_per_block=0.1)      # slower than recompute
    assert index.tier_cost[DISK] == 0.99
