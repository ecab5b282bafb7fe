"""Placement policies (router.placement.policies): the pure choosers with exact costs, and the pickers over
views and a `KVIndex` fed by fake actors' events."""
from __future__ import annotations

from engine.kv_cache.block_manager import prompt_block_hashes
from proto.pdserve.v1 import kv_events_pb2 as kpb
from router.placement.kv_index import KVIndex
from router.placement.policies import (DECODE_RUNNING_COST_BLOCKS, DecodeCandidate, PrefillCandidate,
                                       choose_decode_kv_aware, choose_decode_most_free, choose_prefill_prefix_then_load,
                                       choose_prefill_prefix_vs_queue, decode_cost_blocks, pick_decode, pick_prefill,
                                       prefill_cost_tokens, usable_cached_tokens)
from router.pools import DecodeView, PrefillView

BS = 4


def test_usable_cached_tokens_leave_the_last_prompt_token_to_compute():
    assert usable_cached_tokens(3, 13, BS) == 12
    assert usable_cached_tokens(3, 12, BS) == 8          # a fully cached prompt still computes its last block
    assert usable_cached_tokens(0, 12, BS) == 0


def test_prefill_cost_is_uncached_tokens_plus_queued_tokens():
    assert prefill_cost_tokens(PrefillCandidate("a", 2, 5), 20, BS) == 20 - 8 + 5


def test_prefill_cached_prefix_wins_until_the_queue_outweighs_it():
    cached = PrefillCandidate("cached", 4, 10)           # 40-token prompt: cost 40 - 16 + 10 = 34
    idle = PrefillCandidate("idle", 0, 0)                # cost 40
    assert choose_prefill_prefix_vs_queue([idle, cached], 40, BS) is cached
    busier = PrefillCandidate("cached", 4, 17)          # cost 41 > 40
    assert choose_prefill_prefix_vs_queue([idle, busier], 40, BS) is idle
    # ties: the longer cached prefix, then the first candidate
    tied = PrefillCandidate("tied", 4, 16)              # cost 40 = idle's
    assert choose_prefill_prefix_vs_queue([idle, tied], 40, BS) is tied
    other = PrefillCandidate("other", 0, 0)
    assert choose_prefill_prefix_vs_queue([idle, other], 40, BS) is idle
    assert choose_prefill_prefix_vs_queue([], 40, BS) is None


def test_prefix_then_load_prefers_any_longer_prefix():
    a, b = PrefillCandidate("a", 1, 1000), PrefillCandidate("b", 0, 0)
    assert choose_prefill_prefix_then_load([b, a], 40, BS) is a
    assert choose_prefill_prefix_then_load([PrefillCandidate("c", 1, 5), a], 40, BS).actor_id == "c"


def test_decode_kv_aware_weighs_shipped_blocks_against_running_requests():
    assert decode_cost_blocks(DecodeCandidate("a", 50, 3, 2), 10) == 7 + 2 * DECODE_RUNNING_COST_BLOCKS
    holds = DecodeCandidate("holds", 20, 10, 1)         # ships 0 blocks, cost 8
    empty = DecodeCandidate("empty", 60, 0, 0)          # ships 10 blocks, cost 10
    assert choose_decode_kv_aware([empty, holds], 12, 10) is holds
    loaded = DecodeCandidate("holds", 20, 10, 2)        # cost 16 > 10
    assert choose_decode_kv_aware([empty, loaded], 12, 10) is empty
    # room first: an actor the request does not fit is never chosen
    assert choose_decode_kv_aware([empty, holds], 30, 10) is empty
    assert choose_decode_kv_aware([empty, holds], 61, 10) is None
    # equal cost: the most free blocks
    roomy = DecodeCandidate("roomy", 70, 0, 0)
    assert choose_decode_kv_aware([empty, roomy], 12, 10) is roomy
    assert choose_decode_most_free([holds, empty, roomy], 12, 10) is roomy


def _index_with(actor_id: str, hashes: list[bytes]) -> KVIndex:
    index = KVIndex()
    batch = kpb.KVCacheEventBatch(seq=1, events=[kpb.KVCacheEvent(kind=kpb.KV_CACHE_EVENT_KIND_STORED,
                                                                  block_hashes=hashes)])
    assert index.apply(actor_id, kpb.KVEventsResponse(epoch="e", last_seq=1, batches=[batch]))
    return index


def test_pick_prefill_asks_the_index_and_skips_unhealthy_and_excluded_actors():
    prompt = list(range(2, 22))                          # 5 full blocks
    hashes = prompt_block_hashes(prompt, BS)
    index = _index_with("p1", hashes[:3])
    views = [PrefillView("p0", None, 64), PrefillView("p1", None, 64)]
    assert pick_prefill(views, hashes, len(prompt), BS, index) == (views[1], 3)
    views[1].queued_tokens = 13                          # 20 - 12 + 13 = 21 > 20
    assert pick_prefill(views, hashes, len(prompt), BS, index) == (views[0], 0)
    assert pick_prefill(views, hashes, len(prompt), BS, index, policy="prefix_then_load") == (views[1], 3)
    views[1].queued_tokens = 0
    views[1].healthy = False
    assert pick_prefill(views, hashes, len(prompt), BS, index)[0] is views[0]
    assert pick_prefill(views, hashes, len(prompt), BS, index, exclude={"p0"}) == (None, 0)


def test_pick_decode_uses_the_cached_prefix_among_open_actors_with_room():
    hashes = prompt_block_hashes(list(range(2, 42)), BS)          # 10 full blocks
    index = _index_with("d0", hashes)
    views = [DecodeView("d0", None, "kv://d0", 64), DecodeView("d1", None, "kv://d1", 64)]
    views[0].reserved_blocks, views[0].running = 40, 1           # 24 free; cost 0 + 8 < d1's 10
    cached = index.prefix_by_actor(hashes)
    assert pick_decode(views, 20, cached=cached, num_prompt_blocks=10) is views[0]
    assert pick_decode(views, 20, cached=cached, num_prompt_blocks=10, policy="most_free_blocks") is views[1]
    assert pick_decode(views, 30, cached=cached, num_prompt_blocks=10) is views[1]     # no room on d0
    views[0].quarantined_until = float("inf")
    assert pick_decode(views, 20, cached=cached, num_prompt_blocks=10) is views[1]


def _tier_index(holdings: dict[str, tuple[int, list[bytes]]]) -> KVIndex:
    index = KVIndex()
    for actor_id, (tier, hashes) in holdings.items():
        event = kpb.KVCacheEvent(kind=kpb.KV_CACHE_EVENT_KIND_STORED, tier=tier, block_hashes=hashes)
        index.apply(actor_id, kpb.KVEventsResponse(epoch="e", last_seq=1,
                                                   batches=[kpb.KVCacheEventBatch(seq=1, events=[event])]))
    return index


def test_prefill_prices_a_hit_by_its_tier():
    prompt = list(range(2, 42))                          # 10 full blocks (9 usable)
    hashes = prompt_block_hashes(prompt, BS)
    tiers = {"device": kpb.KV_CACHE_TIER_UNSPECIFIED, "host": kpb.KV_CACHE_TIER_HOST, "disk": kpb.KV_CACHE_TIER_DISK}
    views = {name: PrefillView(name, None, 64) for name in [*tiers, "none"]}
    index = _tier_index({name: (tier, hashes) for name, tier in tiers.items()})
    cost = index.tier_cost
    expected = {"device": 40 - 36, "host": 40 - 36 + 10 * cost[kpb.KV_CACHE_TIER_HOST] * BS,
                "disk": 40 - 36 + 10 * cost[kpb.KV_CACHE_TIER_DISK] * BS, "none": 40}
    order = []
    while views:
        best, cached = pick_prefill(list(views.values()), hashes, len(prompt), BS, index)
        c = PrefillCandidate(best.actor_id, cached, 0, index.onboard_cost(best.actor_id, hashes, cached))
        assert prefill_cost_tokens(c, len(prompt), BS) == expected[best.actor_id]
        order.append(views.pop(best.actor_id).actor_id)
    assert order == ["device", "host", "disk", "none"]
    assert pick_prefill([PrefillView("host", None, 64), PrefillView("disk", None, 64)], hashes, len(prompt), BS,
                        index, policy="prefix_then_load")[0].actor_id == "host"


def test_decode_prices_a_hit_by_its_tier():
    hashes = prompt_block_hashes(list(range(2, 42)), BS)          # 10 full blocks
    index = _tier_index({"host": (kpb.KV_CACHE_TIER_HOST, hashes), "disk": (kpb.KV_CACHE_TIER_DISK, hashes)})
    views = [DecodeView("disk", None, "kv://disk", 64), DecodeView("host", None, "kv://host", 64),
             DecodeView("none", None, "kv://none", 64)]
    priced = index.priced_prefix_by_actor(hashes)
    assert pick_decode(views, 20, cached=priced, num_prompt_blocks=10).actor_id == "host"
    assert pick_decode(views[::2], 20, cached=priced, num_prompt_blocks=10).actor_id == "disk"
