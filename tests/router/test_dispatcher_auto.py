"""`Dispatcher` in routing.mode auto and colocated, against fake actors: each request's placement follows
`router.placement.auto` over the live profile, is counted and carried to the request's log line, and the live
profile's per-actor state (local-prefill backlog) returns to zero."""
from __future__ import annotations

import asyncio
import logging
import math

import pytest

from fake_actors import expected_tokens, fake_cluster
from router.backend import GenerationInput
from router.dispatcher import Dispatcher
from engine.performance import LinearPerformance
from router.placement.live_profile import LiveProfile
from router.routing import RoutingSettings
from router.request_core import RequestRecord, _log_finished
from test_dispatcher import BLOCK_SIZE, Counts, assert_nothing_held, collect, request

# 1000 prompt tokens/s on both sides, 10 ms decode steps, 50 ms remote overhead; SLOs 1 s / 50 ms.
SEED = LinearPerformance(prefill_tokens_per_s=1000.0, kv_bytes_per_s=1e9, kv_bytes_per_token=100, step_base_s=0.01,
                         step_per_seq_s=0.0)
LONG = list(range(1, 201))          # 200 tokens: 0.2 s of local prefill over 6 tokens would cost TPOT 33 ms


class PlacementCounts(Counts):
    def __init__(self):
        super().__init__()
        self.placements: list[str] = []

    def placement(self, choice: str) -> None:
        self.placements.append(choice)


def make(cluster, mode: str = "auto", base=SEED, **routing) -> Dispatcher:
    settings = RoutingSettings(**{"max_queue": 8, "stream_idle_s": 2.0, "mode": mode, "ttft_slo_s": 1.0,
                                  "tpot_slo_s": 0.05, **routing})
    return Dispatcher(cluster.pools, tokenizer=None, max_model_len=1024, block_size=BLOCK_SIZE, routing=settings,
                      metrics=PlacementCounts(),
                      live=LiveProfile(base, BLOCK_SIZE, chunk_tokens=64, remote_overhead_s=0.05))


def run(coro):
    return asyncio.run(coro)


def test_auto_places_a_short_prompt_locally_and_a_long_one_remotely():
    async def main():
        c = fake_cluster()
        d = make(c)
        tokens, chunks = await collect(d, request("short", max_tokens=6))
        assert tokens == expected_tokens(request().prompt_token_ids, 6)
        assert not any(a.jobs for a in c.prefill)
        placement = chunks[-1].timing.placement
        assert (placement.choice.value, placement.reason) == ("local", "keeps_slo")
        tokens, chunks = await collect(d, request("long", max_tokens=6, prompt=LONG))
        assert tokens == expected_tokens(LONG, 6)
        [pjob] = [j for a in c.prefill for j in a.jobs]
        assert list(pjob.prompt_token_ids) == LONG and pjob.transfer_id
        assert chunks[-1].timing.placement.choice.value == "remote"
        assert d.metrics.placements == ["local", "remote"] and d.metrics.local == 1
        assert all(d.live.local_backlog(v.actor_id) == 0 for v in c.pools.decode)
        assert_nothing_held(c)
    run(main())


def test_auto_sends_a_long_prompt_local_when_the_prefill_pool_is_backed_up():
    async def main():
        c = fake_cluster()
        d = make(c, max_prefill_backlog_tokens=1000)
        for view in c.pools.prefill:
            view.queued_tokens = 5000      # 5 s of queue: remote misses the 1 s TTFT SLO
        tokens, chunks = await collect(d, request("long", max_tokens=6, prompt=LONG))
        assert tokens == expected_tokens(LONG, 6)
        assert not any(a.jobs for a in c.prefill)      # admitted at once (the backlog bound holds no auto request)
        placement = chunks[-1].timing.placement
        assert placement.choice.value == "local" and not placement.remote.keeps_slo
        assert placement.inputs.prefill.queued_tokens == 5000
        for view in c.pools.prefill:
            view.queued_tokens = 0
        assert_nothing_held(c)
    run(main())


def test_auto_learns_the_prefill_rate_and_the_kv_size_from_prefill_results():
    async def main():
        c = fake_cluster()
        d = make(c)
        await collect(d, request("long", max_tokens=6, prompt=LONG))
        # the fake reports 200 tokens in prefill_s 0.01 and 1000 KV bytes in 0.002 s
        assert d.live.prefill_profile(200).tokens_per_s == pytest.approx(0.8 * 1000 + 0.2 * 20000)
        assert d.live.kv_bytes_per_s == 0.8 * 1e9 + 0.2 * 500_000
        assert d.live.kv_bytes_per_token == 1000 / 200
        assert d.live.output_tokens == 6
    run(main())


def test_colocated_mode_prefills_every_prompt_on_its_decode_actor():
    async def main():
        c = fake_cluster()
        d = make(c, mode="colocated")
        tokens, chunks = await collect(d, request("long", max_tokens=5, prompt=LONG))
        assert tokens == expected_tokens(LONG, 5)
        assert not any(a.jobs for a in c.prefill) and d.metrics.local == 1
        assert chunks[-1].timing.placement is None and d.metrics.placements == []
        assert_nothing_held(c)
    run(main())


def test_the_request_log_line_carries_the_placement(caplog):
    async def main():
        c = fake_cluster()
        d = make(c)
        _, chunks = await collect(d, request("long", max_tokens=6, prompt=LONG))
        return chunks[-1].timing
    timing = run(main())
    record = RequestRecord("long", "grpc", "", 0.0, 200)
    record.timing = timing
    root = logging.getLogger("pdserve")
    propagate, root.propagate = root.propagate, True       # configure_logging (other tests) turns it off
    try:
        with caplog.at_level(logging.INFO, logger="pdserve.router"):
            _log_finished(record)
    finally:
        root.propagate = propagate
    [line] = [r for r in caplog.records if r.getMessage().startswith("request_finished")]
    assert "placement=remote" in line.getMessage() and "est_local_tpot_s=" in line.getMessage()
    assert line.fields["placement_reason"] == "keeps_slo"


def test_disaggregated_mode_makes_no_placement_decision():
    async def main():
        c = fake_cluster()
        d = make(c, mode="disaggregated")
        _, chunks = await collect(d, GenerationInput("r", LONG, request().params, None))
        assert chunks[-1].timing.placement is None and d.metrics.placements == []
        assert any(a.jobs for a in c.prefill)
    run(main())


def test_a_request_is_recorded_when_the_consumer_closes_after_its_last_chunk():
    """The servicer stops at the request's last chunk and closes the generator there: the finished
    request still reaches `completed` (the autoscaler) and the live profile (auto placement)."""
    async def main():
        c = fake_cluster()
        d = make(c)
        gen = d.generate(request("r", max_tokens=6, prompt=LONG))
        async for chunk in gen:
            if chunk.finish_reason is not None:
                break
        await gen.aclose()
        finished = d.recent_finished(math.inf)
        assert len(finished) == 1 and finished[0].num_output_tokens == 6
        assert d.live.output_tokens == 6
        assert_nothing_held(c)
    run(main())


def test_without_a_prefill_actor_auto_prefills_local_and_records_which_prompts_needed_one():
    async def main():
        c = fake_cluster(num_prefill=0, kv_blocks=128)
        d = make(c)
        tokens, chunks = await collect(d, request("short", max_tokens=6))
        assert tokens == expected_tokens(request().prompt_token_ids, 6)
        first = chunks[-1].timing.placement
        assert (first.choice.value, first.reason, first.needs_prefill_actor) == ("local", "no_prefill_actor", False)
        assert first.remote is not None and first.inputs.prefill.actor_id == "shadow"
        assert d.placer.shadow.queued_tokens == 0
        longer = list(range(1, 401))   # 0.4 s of local prefill over 6 tokens: TPOT 77 ms > 50; a prefill actor keeps it
        tokens, chunks = await collect(d, request("long", max_tokens=6, prompt=longer))
        assert tokens == expected_tokens(longer, 6)
        second = chunks[-1].timing.placement
        assert (second.choice.value, second.needs_prefill_actor) == ("local", True)
        assert not second.local.keeps_slo and second.remote.keeps_slo
        assert d.placer.shadow.queued_tokens == 400                  # the shadow actor would hold its prompt
        placed = [(p.num_prompt_tokens, p.needs_prefill_actor) for p in d.recent_placements(math.inf)]
        assert placed == [(len(request().prompt_token_ids), False), (400, True)]
        assert d.metrics.placements == ["local", "local"] and d.metrics.local == 2
        assert_nothing_held(c)
    run(main())


def test_the_need_for_a_prefill_actor_is_asked_with_the_batch_spread_over_both_pools():
    c = fake_cluster(num_prefill=1, num_decode=3)
    d = make(c)
    assert d.placer.all_decode_running(c.pools.decode, 8) == 6          # 8 x 3 decode actors / 4 actors
    c.pools.prefill[0].healthy = False                     # a prefill actor that is down decodes nothing either
    assert d.placer.all_decode_running(c.pools.decode, 8) == 8
    c.pools.prefill[0].healthy = True
    c.pools.decode[0].draining = True
    assert d.placer.all_decode_running(c.pools.decode, 9) == 6          # 9 x 2 / 3


def test_auto_placement_prices_a_prefix_the_decode_actor_holds_in_a_tier():
    """The same prefix counts fully from the decode actor's paged cache and at its onboarding price from a
    tier below it: auto placement sees fewer cached tokens for a host hit, fewer still for a disk hit."""
    from engine.kv_cache.block_manager import prompt_block_hashes
    from proto.pdserve.v1 import kv_events_pb2 as kpb
    hashes = prompt_block_hashes(LONG, BLOCK_SIZE)
    cached_tokens = {}
    for tier in (kpb.KV_CACHE_TIER_UNSPECIFIED, kpb.KV_CACHE_TIER_HOST, kpb.KV_CACHE_TIER_DISK):
        c = fake_cluster()
        d = make(c)
        view, pview = c.pools.decode[0], c.pools.prefill[0]
        event = kpb.KVCacheEvent(kind=kpb.KV_CACHE_EVENT_KIND_STORED, tier=tier, block_hashes=hashes)
        d.kv_index.apply(view.actor_id, kpb.KVEventsResponse(epoch="e", last_seq=1, batches=[
            kpb.KVCacheEventBatch(seq=1, events=[event])]))
        _, placement = d.placer.prefill_locally(view, pview, 0, hashes, len(LONG), 6, c.pools.decode)
        cached_tokens[tier] = placement.inputs.decode.cached_tokens
    cost = make(fake_cluster()).kv_index.tier_cost
    blocks = len(hashes)
    assert cached_tokens == {kpb.KV_CACHE_TIER_UNSPECIFIED: blocks * BLOCK_SIZE,
                             kpb.KV_CACHE_TIER_HOST: round(blocks * (1 - cost[kpb.KV_CACHE_TIER_HOST]) * BLOCK_SIZE),
                             kpb.KV_CACHE_TIER_DISK: round(blocks * (1 - cost[kpb.KV_CACHE_TIER_DISK]) * BLOCK_SIZE)}


def test_the_acceptance_a_decode_actor_reports_reaches_the_live_profile_and_its_placements():
    from engine.performance import Speculation

    async def main():
        c = fake_cluster(num_decode=1)
        c.decode[0].spec_counts = (40, 30)           # each request: 30 of 40 proposals accepted
        base = LinearPerformance(prefill_tokens_per_s=1000.0, kv_bytes_per_s=1e9, kv_bytes_per_token=100,
                                 step_base_s=0.01, step_per_seq_s=0.001, speculation=Speculation("ngram", 4))
        d = make(c, base=base)
        _, chunks = await collect(d, request("first", max_tokens=6))
        usage = chunks[-1].usage
        assert (usage.spec_proposed_tokens, usage.spec_accepted_tokens) == (40, 30)
        assert d.live.acceptance("decode-0") == pytest.approx(0.75)
        _, chunks = await collect(d, request("second", max_tokens=6))
        inp = chunks[-1].timing.placement.inputs
        context = inp.num_prompt_tokens + inp.output_tokens / 2
        assert inp.decode_profile.seconds_per_token(1) == pytest.approx(d.live.token_seconds(1, context, 0.75))
        assert d.live.token_seconds(1, context, 0.75) < d.live.token_seconds(1, context, 0.0)
        assert_nothing_held(c)
    run(main())
