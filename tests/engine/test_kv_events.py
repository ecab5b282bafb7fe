"""Prefix-cache events: the exact stored / removed sequence of a block manager under LRU eviction,
and `KVEventLog`'s numbered batches (ack, resend, gap on overflow, snapshot)."""
from __future__ import annotations

from engine import Engine, EngineArgs, SamplingParams
from engine.kv_cache.block_manager import BlockManager, prompt_block_hashes
from engine.kv_cache.events import KVEventLog
from proto.pdserve.v1 import kv_events_pb2 as kpb

STORED, REMOVED = "stored", "removed"


class Recorder:
    """A sink that keeps every event as (kind, block id, hash)."""

    def __init__(self):
        self.events: list[tuple[str, int, bytes]] = []

    def stored(self, block_id, block_hash):
        self.events.append((STORED, block_id, block_hash))

    def removed(self, block_id, block_hash):
        self.events.append((REMOVED, block_id, block_hash))


def replay(responses: list[kpb.KVEventsResponse]) -> set[bytes]:
    """The cached set that applying every batch in order yields."""
    cached: set[bytes] = set()
    for response in responses:
        for batch in response.batches:
            for event in batch.events:
                (cached.update if event.kind == kpb.KV_CACHE_EVENT_KIND_STORED else cached.difference_update)(
                    event.block_hashes)
    return cached


def test_block_manager_events_exact_ids_under_lru_eviction():
    bm = BlockManager(num_blocks=6, block_size=4)
    rec = Recorder()
    bm.event_sink = rec
    a = bm.allocate(3)
    h = prompt_block_hashes(list(range(12)), 4)
    for block_id, block_hash in zip(a, h):
        bm.register(block_id, block_hash)
    bm.register(a[0], h[0])                 # already cached: no event
    assert rec.events == [(STORED, 0, h[0]), (STORED, 1, h[1]), (STORED, 2, h[2])]
    bm.free(a)                              # LRU order of the cached blocks: 2, 1, 0
    b = bm.allocate(5)                      # never-used 3, 4, 5, then evicts 2 and 1
    assert b == [3, 4, 5, 2, 1]
    assert rec.events[3:] == [(REMOVED, 2, h[2]), (REMOVED, 1, h[1])]
    other = prompt_block_hashes(list(range(100, 108)), 4)
    bm.register(b[3], other[0])
    bm.register(b[4], other[1])
    assert rec.events[5:] == [(STORED, 2, other[0]), (STORED, 1, other[1])]
    assert set(bm.cached) == {h[0], *other}
    bm.free(b)
    bm.check_no_leaks()


def test_disabled_prefix_cache_publishes_nothing():
    bm = BlockManager(num_blocks=4, block_size=4, enable_prefix_cache=False)
    rec = Recorder()
    bm.event_sink = rec
    [block_id] = bm.allocate(1)
    bm.register(block_id, prompt_block_hashes([1, 2, 3, 4], 4)[0])
    bm.free([block_id])
    bm.allocate(4)
    assert rec.events == []


def test_engine_events_follow_lru_eviction_exactly(tiny_model_dir):
    engine = Engine(EngineArgs(tiny_model_dir, dtype="float32", num_blocks=24, block_size=16, attention="eager"))
    rec = Recorder()
    engine.block_manager.event_sink = rec
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [[t] * 150 for t in (3, 4, 5)]          # 9 full blocks + 6 tokens: 10 blocks each
    hashes = [prompt_block_hashes(p, 16) for p in prompts]
    engine.generate([prompts[0]], params)
    assert rec.events == [(STORED, i, hashes[0][i]) for i in range(9)]
    # freed tail first: free queue = never-used 10..23, then 9, 8, ..., 0
    engine.generate([prompts[1]], params)
    assert rec.events[9:] == [(STORED, 10 + i, hashes[1][i]) for i in range(9)]
    # free queue = 20..23, 9, 8, ..., 0, 19, ..., 10: the third prompt takes 20..23, 9, 8, 7, 6, 5, 4
    del rec.events[:18]
    engine.generate([prompts[2]], params)
    table = [20, 21, 22, 23, 9, 8, 7, 6, 5]
    assert rec.events == [(REMOVED, b, hashes[0][b]) for b in (8, 7, 6, 5, 4)] + \
        [(STORED, b, hashes[2][i]) for i, b in enumerate(table)]
    assert set(engine.block_manager.cached) == set(hashes[0][:4]) | set(hashes[1][:9]) | set(hashes[2][:9])
    engine.block_manager.check_no_leaks()


def test_log_numbers_batches_resends_until_acked_and_replays_to_the_cache():
    bm = BlockManager(num_blocks=4, block_size=2)
    log = KVEventLog(bm)
    h = prompt_block_hashes([1, 2, 3, 4, 5, 6], 2)
    ids = bm.allocate(3)
    for block_id, block_hash in zip(ids, h):
        bm.register(block_id, block_hash)
    first = log.answer(kpb.KVEventsRequest())
    assert (first.epoch, first.last_seq) == (log.epoch, 1)
    [batch] = first.batches
    assert batch.seq == 1 and [(e.kind, list(e.block_hashes)) for e in batch.events] == \
        [(kpb.KV_CACHE_EVENT_KIND_STORED, h)]
    bm.free(ids)
    other = prompt_block_hashes([9, 9, 9, 9], 2)
    more = bm.allocate(3)                    # never-used 3, then evicts 2 and 1 (LRU)
    for block_id, block_hash in zip(more, other):
        bm.register(block_id, block_hash)
    again = log.answer(kpb.KVEventsRequest(epoch="someone else's", acked_seq=1))   # not this epoch: no ack
    assert [b.seq for b in again.batches] == [1, 2]
    assert [(e.kind, list(e.block_hashes)) for e in again.batches[1].events] == \
        [(kpb.KV_CACHE_EVENT_KIND_REMOVED, [h[2], h[1]]), (kpb.KV_CACHE_EVENT_KIND_STORED, other)]
    acked = log.answer(kpb.KVEventsRequest(epoch=log.epoch, acked_seq=1))
    assert [b.seq for b in acked.batches] == [2] and acked.last_seq == 2
    assert replay([again]) == set(bm.cached) == {h[0], *other}
    assert log.answer(kpb.KVEventsRequest(epoch=log.epoch, acked_seq=2)).batches == []
    bm.free(more)


def test_overflow_leaves_a_gap_and_a_snapshot_stands_at_last_seq():
    bm = BlockManager(num_blocks=8, block_size=2)
    log = KVEventLog(bm, max_events=3)
    h = prompt_block_hashes(list(range(10)), 2)
    ids = bm.allocate(5)
    for block_id, block_hash in zip(ids[:3], h):
        bm.register(block_id, block_hash)
    assert log.answer(kpb.KVEventsRequest()).last_seq == 1
    for block_id, block_hash in zip(ids[3:], h[3:]):       # a 4th unacked event: all dropped, seq 2 skipped
        bm.register(block_id, block_hash)
    assert log.num_dropped == 1
    gap = log.answer(kpb.KVEventsRequest(epoch=log.epoch, acked_seq=1))
    assert gap.last_seq == 3 and [b.seq for b in gap.batches] == [3]   # seq 2 never comes: the puller resyncs
    bm.free(ids[:1])
    more = bm.allocate(4)                                   # 3 never-used blocks, then block 0: h[0] removed
    snap = log.answer(kpb.KVEventsRequest(epoch=log.epoch, acked_seq=1, snapshot=True))
    assert snap.last_seq == 4 and not snap.batches          # the pending removal is sealed into batch 4 first
    assert set(snap.snapshot.block_hashes) == set(bm.cached) == set(h[1:5])
    assert log.answer(kpb.KVEventsRequest(epoch=log.epoch, acked_seq=4)).batches == []
    bm.free(ids[1:])
    bm.free(more)
    bm.check_no_leaks()
