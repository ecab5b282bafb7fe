"""`KVEventPoller` over fake actors whose caches are real block managers: a lost batch is a resync
after which the index equals the actor's cache; restarts, dead and departed actors; and after a
dispatched workload (evictions included) the router's index equals every actor's own cache and
the prefill choice follows the cached prefix."""
from __future__ import annotations

import asyncio
import logging

from engine.kv_cache.block_manager import prompt_block_hashes
from engine.sampling.params import SamplingParams
from fake_actors import FakeCache, expected_tokens, fake_cluster
from router.backend import GenerationInput
from router.dispatcher import Dispatcher
from router.routing import RoutingSettings
from router.placement.kv_event_poller import KVEventPoller
from router.placement.kv_index import KVIndex

BS = 4


def run(coro):
    return asyncio.run(coro)


def cached(actor) -> set[bytes]:
    return set(actor.cache.block_manager.cached)


def test_a_lost_batch_triggers_a_resync_and_the_index_equals_the_cache():
    async def main():
        c = fake_cluster(num_prefill=1, num_decode=0, block_size=BS)
        actor, view = c.prefill[0], c.pools.prefill[0]
        poller = KVEventPoller(c.pools, KVIndex())
        actor.cache.compute(list(range(2, 22)))
        assert await poller.sync(view)
        assert poller.index.hashes_of(actor.actor_id) == cached(actor) and poller.index.state(view.actor_id).seq == 1
        actor.lose = {2}                                    # the next batch never arrives
        actor.cache.compute(list(range(50, 70)))
        actor.cache.compute(list(range(2, 30)))
        assert await poller.sync(view)
        assert poller.num_resyncs == 1
        assert poller.index.hashes_of(actor.actor_id) == cached(actor)
        assert poller.index.state(view.actor_id).seq == actor.cache.log.last_seq == 2
        actor.lose = set()
        actor.cache.compute(list(range(100, 140)))          # evicts: a 64-block pool, LRU
        assert await poller.sync(view)
        assert poller.num_resyncs == 1 and poller.index.hashes_of(actor.actor_id) == cached(actor)
    run(main())


def test_an_overflowed_log_is_resynced_from_a_snapshot():
    async def main():
        c = fake_cluster(num_prefill=1, num_decode=0, block_size=BS)
        actor, view = c.prefill[0], c.pools.prefill[0]
        actor.cache.log.max_events = 8
        poller = KVEventPoller(c.pools, KVIndex())
        assert await poller.sync(view)                      # first contact: a snapshot, no resync
        assert poller.num_resyncs == 0 and poller.index.state(view.actor_id).epoch
        for start in range(0, 400, 40):                     # far more than 8 events before the first poll
            actor.cache.compute(list(range(start, start + 40)))
        assert actor.cache.log.num_dropped > 0
        assert await poller.sync(view)
        assert poller.num_resyncs == 1 and poller.index.hashes_of(view.actor_id) == cached(actor)
    run(main())


def test_an_actor_the_index_forgot_comes_back_from_a_snapshot_without_a_warning(caplog):
    """An actor that left the pools (its entries forgotten) and came back, as a role flip moves it between
    pools: its acked log no longer starts at the index's seq 0, so the first poll asks for a snapshot."""
    async def main():
        c = fake_cluster(num_prefill=1, num_decode=0, block_size=BS)
        actor, view = c.prefill[0], c.pools.prefill[0]
        poller = KVEventPoller(c.pools, KVIndex())
        actor.cache.compute(list(range(2, 22)))
        assert await poller.sync(view)
        actor.cache.compute(list(range(40, 60)))
        assert await poller.sync(view)                      # batch 2 acked: the actor drops batches 1-2
        poller.index.forget(view.actor_id)
        actor.cache.compute(list(range(80, 90)))
        with caplog.at_level(logging.WARNING, logger="pdserve.router.placement.kv_event_poller"):
            assert await poller.sync(view)
        assert poller.num_resyncs == 0 and not caplog.records
        assert poller.index.hashes_of(view.actor_id) == cached(actor) and len(cached(actor)) == 12
    run(main())


def test_a_restarted_actor_replaces_its_entries_and_a_dead_one_keeps_them():
    async def main():
        c = fake_cluster(num_prefill=2, num_decode=0, block_size=BS)
        poller = KVEventPoller(c.pools, KVIndex())
        actor = c.prefill[0]
        actor.cache.compute(list(range(2, 22)))
        await poller.sync_all()
        before = cached(actor)
        actor.alive = False
        assert not await poller.sync(c.pools.prefill[0])
        assert poller.index.hashes_of(actor.actor_id) == before
        actor.alive = True
        actor.cache = FakeCache(64, BS)                     # Ray restarted it: a new engine, a new epoch
        actor.cache.compute(list(range(70, 80)))
        await poller.sync_all()
        assert poller.index.hashes_of(actor.actor_id) == cached(actor) and not before & cached(actor)
        assert poller.num_resyncs == 0
        c.pools.prefill.pop(0)                              # replaced: it left the pool
        await poller.sync_all()
        assert poller.index.actor_ids == ["prefill-1"]
    run(main())


def test_after_a_workload_the_index_equals_every_actor_cache_and_prefill_follows_the_prefix():
    async def main():
        c = fake_cluster(num_prefill=2, num_decode=2, kv_blocks=48, block_size=BS)
        d = Dispatcher(c.pools, tokenizer=None, max_model_len=1024, block_size=BS,
                       routing=RoutingSettings(max_queue=64, stream_idle_s=2.0))
        systems = [[s] * 24 for s in (3, 5, 7, 9)]         # four shared prefixes of 6 blocks
        params = SamplingParams(max_tokens=3, temperature=0.0)

        async def one(i: int) -> None:
            prompt = systems[i % 4] + [100 + i, 101 + i, 102 + i, 103 + i, 104 + i]
            chunks = [ch async for ch in d.generate(GenerationInput(f"r{i}", prompt, params, None))]
            assert [t for ch in chunks for t in ch.token_ids] == expected_tokens(prompt, 3)
        for wave in range(6):                               # 4 concurrent requests per wave: evictions happen
            await asyncio.gather(*(one(wave * 4 + j) for j in range(4)))
        assert any(a.cache.log.last_seq > 1 for a in c.prefill)
        await d.kv_poller.sync_all()
        for actor in (*c.prefill, *c.decode):
            assert d.kv_index.hashes_of(actor.actor_id) == cached(actor), actor.actor_id
        assert d.kv_poller.num_resyncs == 0
        # a prompt cached on exactly one prefill actor goes there
        prompt = [11] * 20 + [1]
        hashes = prompt_block_hashes(prompt, BS)
        c.prefill[1].cache.compute(prompt)
        await d.kv_poller.sync_all()
        assert d.kv_index.prefix_by_actor(hashes) == {"prefill-1": 5}
        before = len(c.prefill[1].jobs)
        chunks = [ch async for ch in d.generate(GenerationInput("warm", prompt, params, None))]
        assert len(c.prefill[1].jobs) == before + 1 and chunks[-1].usage.cached_prompt_tokens == 20
    run(main())


def test_a_bad_answer_is_logged_once_and_polling_goes_on(caplog):
    caplog.set_level(logging.INFO, logger="pdserve.router.placement.kv_event_poller")

    async def main():
        c = fake_cluster(num_prefill=1, num_decode=0, block_size=BS)
        actor, view = c.prefill[0], c.pools.prefill[0]
        poller = KVEventPoller(c.pools, KVIndex())
        good = actor.kv_events

        async def broken(request):
            raise RuntimeError("garbled answer")
        actor.kv_events = broken
        await poller.sync_all()
        await poller.sync_all()
        assert not await poller.sync(view)
        assert sum("garbled answer" in r.getMessage() for r in caplog.records) == 1
        actor.kv_events = good
        actor.cache.compute(list(range(2, 22)))
        assert await poller.sync(view)
        assert poller.index.hashes_of(view.actor_id) == cached(actor)
        assert any("answer again" in r.getMessage() for r in caplog.records)
    run(main())


class EngineClient:
    """The actor protocol's kv_events over a real engine's log, losing the batches in `lose`."""

    def __init__(self, engine):
        self.engine, self.lose = engine, set()

    async def kv_events(self, request):
        response = self.engine.kv_events.answer(request)
        kept = [b for b in response.batches if b.seq not in self.lose]
        del response.batches[:]
        response.batches.extend(kept)
        return response


def test_a_lost_batch_of_a_real_engine_is_resynced_to_its_cache(tiny_model_dir):
    from engine import Engine, EngineArgs
    from router.pools import Pools, PrefillView
    engine = Engine(EngineArgs(tiny_model_dir, dtype="float32", num_blocks=24, block_size=16, attention="eager"))
    client = EngineClient(engine)
    view = PrefillView("engine", client, 24)
    poller = KVEventPoller(Pools([view]), KVIndex())
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

    async def main():
        engine.generate([[3] * 150], params)
        assert await poller.sync(view) and poller.index.hashes_of("engine") == set(engine.block_manager.cached)
        client.lose = {2}
        engine.generate([[4] * 150], params)             # batch 2: lost
        assert await poller.sync(view)                   # the gap shows in last_seq: resync
        engine.generate([[5] * 150], params)             # evicts 5 of the first prompt's 9 cached blocks
        assert await poller.sync(view)
        assert poller.num_resyncs == 1 and len(engine.block_manager.cached) == 3 * 9 - 5
        assert poller.index.hashes_of("engine") == set(engine.block_manager.cached)
    run(main())
