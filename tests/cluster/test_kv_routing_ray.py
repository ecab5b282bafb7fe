"""KV-aware routing on Ray: 2 prefill + 2 decode actors (tiny preset, fractional CPUs). The router's
index equals every actor's own prefix cache, and a prompt goes to the prefill actor that caches its
prefix (which, without the index, would lose the tie to prefill-0)."""
from __future__ import annotations

import pytest

from engine import SamplingParams
from engine.kv_cache.block_manager import prompt_block_hashes
from proto.pdserve.v1 import kv_events_pb2 as kpb
from router.client import generate

from cluster_helpers import ClusterThread, cluster_config, wait_blocks_free

BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def cluster(ray_local, tiny_model_dir):
    c = ClusterThread(cluster_config(tiny_model_dir, "grpc", "none", n_prefill=2, n_decode=2))
    yield c
    c.stop()


async def _set_queued(view, tokens: int) -> None:
    view.queued_tokens = tokens


async def _snapshots(backend) -> dict[str, set[bytes]]:
    """Every actor's cache as its engine reports it, after one more poll of the router's index."""
    await backend.kv_poller.sync_all()
    out = {}
    for view in backend.pools.all():
        response = await view.client.kv_events(kpb.KVEventsRequest(snapshot=True))
        out[view.actor_id] = set(response.snapshot.block_hashes)
    return out


def _run(cluster, prompt: list[int]):
    msgs = list(generate(cluster.address, token_ids=prompt, max_tokens=6, temperature=0.0, ignore_eos=True))
    return [t for m in msgs for t in m.token_ids], msgs[-1].usage.cached_prompt_tokens


def test_index_matches_the_actors_caches_and_prefill_follows_the_cached_prefix(cluster, reference):
    backend = cluster.cluster.backend
    p0, p1 = backend.pools.prefill
    system_a, system_b = list(range(2, 66)), list(range(300, 364))          # 4 blocks each
    prompts = [system_a + [900, 901, 902], system_b + [903, 904], system_a + [905, 906, 907, 908],
               system_b + [909]]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    expected = reference(prompts, [params] * 4)
    cluster.call(_set_queued(p0, 10_000))             # A lands on prefill-1 ...
    got_a = _run(cluster, prompts[0])
    cluster.call(_set_queued(p0, 0))
    got_b = _run(cluster, prompts[1])                 # ... B on prefill-0 (a tie: the first)
    assert (got_a, got_b) == ((expected[0], 0), (expected[1], 0))
    hashes_a, hashes_b = prompt_block_hashes(prompts[0], BLOCK_SIZE), prompt_block_hashes(prompts[1], BLOCK_SIZE)
    truth = cluster.call(_snapshots(backend))
    assert set(hashes_a) <= truth[p1.actor_id] and not set(hashes_a) & truth[p0.actor_id]
    assert set(hashes_b) <= truth[p0.actor_id] and not set(hashes_b) & truth[p1.actor_id]
    # the second turn of each goes where its system prompt is cached
    assert _run(cluster, prompts[2]) == (expected[2], 64)
    assert _run(cluster, prompts[3]) == (expected[3], 64)
    truth = cluster.call(_snapshots(backend))
    for actor_id, hashes in truth.items():
        assert backend.kv_index.hashes_of(actor_id) == hashes, actor_id
    assert backend.kv_index.prefix_by_actor(prompt_block_hashes(prompts[2], BLOCK_SIZE))[p1.actor_id] == 4
    for hashes in (hashes_a, hashes_b):                # decode actors cache what they adopt
        assert any(set(hashes) <= truth[v.actor_id] for v in backend.pools.decode)
    assert backend.kv_poller.num_resyncs == 0
    stats = wait_blocks_free(cluster.address)
    assert all(a.kv_blocks_used == 0 for a in stats.actors), stats
