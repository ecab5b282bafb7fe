"""Tensor-parallel actors on local Ray (`pools.decode.tensor_parallel: 2`): each colocated actor is two Ray
actors (rank 0 serves, rank 1 follows) in one placement group with fractional CPUs. Greedy tokens equal
the one-rank colocated engine; killing a rank-1 process mid-decode ends its whole actor, whose requests
migrate and finish exactly, and the pool manager replaces the group; no KV block is left held."""
from __future__ import annotations

import os
import signal
import time

import pytest
import ray

from deploy.config import ConfigError
from deploy.launcher import ActorFactory
from engine import SamplingParams
from router.client import generate

from cluster_helpers import (ClusterThread, cluster_config, join_streams, prompts_and_params, start_greedy_streams,
                             wait_blocks_free)

N = 12
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def cluster(ray_local, tiny_model_dir):
    cfg = cluster_config(tiny_model_dir, extra={"pools.decode.tensor_parallel": 2, "kv_cache.num_blocks": 256})
    c = ClusterThread(cfg, mode="colocated")
    c.cluster.backend.routing.stream_idle_s = 5.0
    c.cluster.manager.interval_s = 0.3
    yield c
    c.stop()


@pytest.fixture(scope="module")
def workload(reference):
    prompts, _ = prompts_and_params(N, seed=41, max_len=200)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return prompts, reference(prompts, [params] * N)


def test_two_rank_actors_generate_what_one_rank_does(cluster, workload):
    prompts, expected = workload
    groups = cluster.cluster.factory.rank_groups
    assert len(groups) == 2 and all(len(ranks) == 1 for _, ranks in groups.values())
    threads, results = start_greedy_streams(cluster.address, prompts, MAX_TOKENS)
    join_streams(threads)
    assert [results[i] for i in range(N)] == expected
    stats = wait_blocks_free(cluster.address, timeout=20)
    assert len(stats.actors) == 2 and all(a.kv_blocks_used == 0 for a in stats.actors), stats


def test_a_killed_rank_fails_its_actor_and_requests_migrate(cluster, workload):
    prompts, expected = workload
    backend, factory = cluster.cluster.backend, cluster.cluster.factory
    victim = backend.pools.decode[0]
    _, ranks = factory.rank_groups[victim.actor_id]
    rank1_pid = ray._private.state.actors(ranks[0][0]._actor_id.hex())["Pid"]
    threads, results = start_greedy_streams(cluster.address, prompts, MAX_TOKENS)
    end = time.monotonic() + 60
    while ray.get(victim.client.handle.stats.remote(), timeout=10)["running_requests"] < 2:
        assert time.monotonic() < end, "the victim never had requests decoding"
        time.sleep(0.005)
    os.kill(rank1_pid, signal.SIGKILL)
    join_streams(threads)
    assert [results[i] for i in range(N)] == expected
    end = time.monotonic() + 90               # the pool manager replaces the whole group
    while victim.actor_id in factory.rank_groups or len(factory.rank_groups) < 2 or \
            not all(v.healthy for v in backend.pools.decode):
        assert time.monotonic() < end, "the lost tensor-parallel actor was not replaced"
        time.sleep(0.2)
    stats = wait_blocks_free(cluster.address, timeout=20)
    assert all(a.kv_blocks_used == 0 for a in stats.actors), stats
    assert list(generate(cluster.address, "after the fault", max_tokens=4, temperature=0.0))[-1].finish_reason


def test_decode_actors_of_two_ranks_prefilling_locally(ray_local, tiny_model_dir, workload):
    """routing.mode colocated in the disaggregated layout: the TP-2 decode actor prefills every request
    itself (its KV never crosses an actor) and its tokens equal the TP-1 engine's."""
    prompts, expected = workload
    cfg = cluster_config(tiny_model_dir, extra={"pools.decode.tensor_parallel": 2, "kv_cache.num_blocks": 256},
                         mode="colocated")
    c = ClusterThread(cfg)
    try:
        assert [len(ranks) for _, ranks in c.cluster.factory.rank_groups.values()] == [1]     # the decode actor
        (group, ranks), = c.cluster.factory.rank_groups.values()
        threads, results = start_greedy_streams(c.address, prompts[:6], MAX_TOKENS)
        join_streams(threads)
        assert [results[i] for i in range(6)] == expected[:6]
        stats = wait_blocks_free(c.address, timeout=20)
        assert all(a.kv_blocks_used == 0 for a in stats.actors), stats
    finally:
        c.stop()
    # stopping the cluster released the follower rank and its placement group (the next cluster has the CPUs)
    import ray
    assert ray.util.placement_group_table(group)["state"] == "REMOVED"
    rank_id = ranks[0][0]._actor_id.hex()
    assert ray._private.state.actors(rank_id)["State"] == "DEAD"


def test_tensor_parallel_actors_that_change_role_are_refused(tiny_model_dir):
    cfg = cluster_config(tiny_model_dir, extra={"pools.prefill.tensor_parallel": 2, "routing.role_flips": "manual"})
    with pytest.raises(ConfigError, match="pools.prefill.tensor_parallel 2: tensor-parallel actors do not change "
                                          "role; set routing.role_flips off"):
        ActorFactory(cfg, "t")


def test_tensor_parallel_actors_with_kv_tiers_are_refused(tiny_model_dir):
    cfg = cluster_config(tiny_model_dir, extra={"pools.decode.tensor_parallel": 2,
                                                "kv_cache.tiers": [{"kind": "host", "capacity_gib": 1}]})
    with pytest.raises(ConfigError, match="kv_cache.tiers: tiers below the paged cache are not available with "
                                          "pools.decode.tensor_parallel 2"):
        ActorFactory(cfg, "t")


@pytest.mark.parametrize("transport,extra", [("tcp", {"kv_cache.dtype": "fp8"}), ("grpc", {"kv_cache.dtype": "int8"}),
                                             ("nixl", {}), ("nixl", {"kv_cache.dtype": "int8"})])
def test_tensor_parallel_kv_shipping_takes_quantized_caches_and_nixl(tiny_model_dir, transport, extra):
    """KV between degrees is resharded by head for every cache dtype and transport: the factory starts."""
    cfg = cluster_config(tiny_model_dir, transport=transport, extra={"pools.prefill.tensor_parallel": 2, **extra})
    assert ActorFactory(cfg, "t").kv_degrees == (2, 1)


def test_a_degree_that_does_not_divide_the_heads_names_the_key(tiny_model_dir):
    from deploy.launcher import engine_args
    cfg = cluster_config(tiny_model_dir, extra={"pools.decode.tensor_parallel": 3})
    with pytest.raises(ConfigError, match=r"pools.decode.tensor_parallel 3 does not divide the model's \d+ "
                                          r"attention heads \(\d+ KV heads\)"):
        engine_args(cfg, "decode", tiny_model_dir)


def test_a_tensor_parallel_actor_counts_one_ray_actor_per_rank(tiny_model_dir):
    """What local Ray must fit (the CPU scale): every rank of every actor, each with the pool's resources."""
    cfg = cluster_config(tiny_model_dir, n_prefill=1, n_decode=2, extra={"pools.decode.tensor_parallel": 2})
    assert ActorFactory(cfg, "t", mode="colocated").most_actors() == {"decode": 6}
    cfg = cluster_config(tiny_model_dir, n_prefill=1, n_decode=2, mode="colocated",
                         extra={"pools.decode.tensor_parallel": 2})
    assert ActorFactory(cfg, "t").most_actors() == {"prefill": 1, "decode": 4}
