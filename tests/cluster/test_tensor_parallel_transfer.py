"""Disaggregated tensor-parallel pools on local Ray: prefill actors of degree Np ship KV to decode actors of
degree Nd (Np > Nd, Np < Nd, equal), each rank sending the head copies the resharding plan gives it and
each receiving rank holding only its heads, over tcp, grpc, torch and nixl, for a model-dtype and an int8
cache. Greedy tokens equal the one-rank colocated engine (with the same cache dtype); every KV went through a
transfer; no block is left held on any actor."""
from __future__ import annotations

import threading
import time

import pytest
import ray

from engine import SamplingParams
from router.client import generate
from engine.kv_cache.block_manager import prompt_block_hashes
from kv_transfer.transports.nixl import agent as nixl_agent
from proto.pdserve.v1 import worker_pb2 as wpb

from cluster_helpers import (ClusterThread, cluster_config, join_streams, prompts_and_params, start_greedy_streams,
                             wait_blocks_free)

N = 6
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def workload(reference):
    prompts, _ = prompts_and_params(N, seed=43, max_len=120)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return prompts, reference(prompts, [params] * N)


@pytest.fixture(scope="module")
def second_turn(reference, workload):
    """The first prompts, extended: the decode actor holds their leading blocks, the rest ships."""
    prompts = [p + p[:20] for p in workload[0]]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return prompts, reference(prompts, [params] * N)


def _generate_all(address, prompts) -> dict[int, list[int]]:
    threads, results = start_greedy_streams(address, prompts, MAX_TOKENS)
    join_streams(threads)
    return results


def _counter(metric) -> float:
    return sum(s.value for m in metric.collect() for s in m.samples if s.name.endswith("_total"))


@pytest.mark.parametrize("prefill_tp,decode_tp,transport", [(2, 1, "tcp"), (1, 2, "grpc"), (2, 2, "torch")])
def test_tokens_across_degrees_equal_one_rank(ray_local, tiny_model_dir, workload, second_turn, prefill_tp, decode_tp,
                                              transport):
    """Then a second turn: decode-side prefix reuse ships only the blocks past what the decode actor holds."""
    prompts, expected = workload
    cfg = cluster_config(tiny_model_dir, transport=transport, extra={
        "pools.prefill.tensor_parallel": prefill_tp, "pools.decode.tensor_parallel": decode_tp,
        "kv_cache.num_blocks": 256, "pools.prefill.resources.num_cpus": 0.25, "pools.decode.resources.num_cpus": 0.25,
        "server.metrics_port": 0, "routing.local_prefill_tokens": 0})
    c = ClusterThread(cfg)
    try:
        groups = c.cluster.factory.rank_groups
        assert sorted(len(ranks) for _, ranks in groups.values()) == sorted(
            n - 1 for n in (prefill_tp, decode_tp) if n > 1)
        results = _generate_all(c.address, prompts)
        assert [results[i] for i in range(N)] == expected
        metrics = c.cluster.backend.metrics
        assert _counter(metrics.local_prefills) == 0 and _counter(metrics.transfer_failures) == 0
        assert _counter(metrics.kv_bytes) > 0
        stats = wait_blocks_free(c.address, timeout=20)
        assert all(a.kv_blocks_used == 0 for a in stats.actors), stats

        decode = c.cluster.backend.pools.decode[0].client.handle
        query = wpb.PrefixQuery(block_hashes=prompt_block_hashes(second_turn[0][0], cfg.kv_cache.block_size))
        held = wpb.PrefixHits.FromString(ray.get(decode.cached_prefix.remote(query.SerializeToString())))
        assert held.num_cached_blocks > 0                          # what the router's query will skip
        shipped = _counter(metrics.kv_bytes)
        results = _generate_all(c.address, second_turn[0])
        assert [results[i] for i in range(N)] == second_turn[1]
        assert _counter(metrics.local_prefills) == 0 and _counter(metrics.kv_bytes) > shipped
        stats = wait_blocks_free(c.address, timeout=20)
        assert all(a.kv_blocks_used == 0 for a in stats.actors), stats
    finally:
        c.stop()


@pytest.mark.parametrize("prefill_tp,decode_tp,transport,cache_dtype", [
    pytest.param(2, 1, "tcp", "int8", id="int8-cache-tcp"),
    pytest.param(1, 2, "nixl", "auto", id="nixl", marks=pytest.mark.skipif(
        nixl_agent.available() is not None, reason=f"nixl cannot be imported: {nixl_agent.available()}"))])
def test_quantized_cache_and_nixl_across_degrees(ray_local, tiny_model_dir, workload, prefill_tp, decode_tp, transport,
                                                 cache_dtype):
    """An int8 cache's cells go with their scales, each rank's heads as stored: the tokens are the one-rank engine's
    with the same cache dtype. Over nixl each receiving rank registers its whole cache and reads its heads. Layer
    by layer, then a second turn past the prefix the decode actor holds."""
    from engine import Engine, EngineArgs
    prompts = workload[0][:4]
    turns = [prompts, [p + p[:20] for p in prompts]]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    engine = Engine(EngineArgs(tiny_model_dir, dtype="float32", num_blocks=256, kv_cache_dtype=cache_dtype))
    expected = [[c.token_ids for c in engine.generate(turn, [params] * len(turn))] for turn in turns]
    cfg = cluster_config(tiny_model_dir, transport=transport, extra={
        "pools.prefill.tensor_parallel": prefill_tp, "pools.decode.tensor_parallel": decode_tp,
        "kv_cache.num_blocks": 256, "kv_cache.dtype": cache_dtype, "pools.prefill.resources.num_cpus": 0.25,
        "pools.decode.resources.num_cpus": 0.25, "server.metrics_port": 0, "routing.local_prefill_tokens": 0})
    c = ClusterThread(cfg)
    try:
        metrics, shipped = c.cluster.backend.metrics, 0.0
        for turn, tokens in zip(turns, expected):
            results = _generate_all(c.address, turn)
            assert [results[i] for i in range(len(turn))] == tokens
            assert _counter(metrics.local_prefills) == 0 and _counter(metrics.transfer_failures) == 0
            assert _counter(metrics.kv_bytes) > shipped
            shipped = _counter(metrics.kv_bytes)
            stats = wait_blocks_free(c.address, timeout=20)
            assert all(a.kv_blocks_used == 0 for a in stats.actors), stats
            decode = c.cluster.backend.pools.decode[0].client.handle
            query = wpb.PrefixQuery(block_hashes=prompt_block_hashes(turns[1][0], cfg.kv_cache.block_size))
            held = wpb.PrefixHits.FromString(ray.get(decode.cached_prefix.remote(query.SerializeToString())))
            assert held.num_cached_blocks > 0                  # the second turn ships only what follows
    finally:
        c.stop()


def test_a_rank_killed_mid_decode_migrates_its_requests(ray_local, tiny_model_dir, workload):
    """Rank 1 of a TP-2 decode actor fed by a TP-2 prefill actor dies mid-decode: its actor ends, the
    requests migrate to the other decode actor and finish exactly, the pool manager replaces the whole
    group, and no KV block is left held anywhere."""
    import os
    import signal

    prompts, expected = workload
    cfg = cluster_config(tiny_model_dir, transport="tcp", n_decode=2, extra={
        "pools.prefill.tensor_parallel": 2, "pools.decode.tensor_parallel": 2, "kv_cache.num_blocks": 256,
        "pools.prefill.resources.num_cpus": 0.25, "pools.decode.resources.num_cpus": 0.25})
    c = ClusterThread(cfg)
    try:
        c.cluster.backend.routing.stream_idle_s = 5.0
        c.cluster.manager.interval_s = 0.3
        backend, factory = c.cluster.backend, c.cluster.factory
        victim = backend.pools.decode[0]
        rank1 = factory.rank_groups[victim.actor_id][1][0][0]
        rank1_pid = ray._private.state.actors(rank1._actor_id.hex())["Pid"]
        results: dict[int, list[int]] = {}
        runner = threading.Thread(target=lambda: results.update(_generate_all(c.address, prompts * 2)))
        runner.start()
        end = time.monotonic() + 60
        while ray.get(victim.client.handle.stats.remote(), timeout=10)["running_requests"] < 2:
            assert time.monotonic() < end, "the victim never had requests decoding"
            time.sleep(0.005)
        os.kill(rank1_pid, signal.SIGKILL)
        runner.join(150)
        assert not runner.is_alive(), "requests hung"
        assert [results[i] for i in range(2 * N)] == expected * 2
        end = time.monotonic() + 90               # the pool manager replaces the whole group
        while victim.actor_id in factory.rank_groups or \
                sum(1 for g in factory.rank_groups if g.startswith("decode")) < 2 or \
                not all(v.healthy for v in backend.pools.decode):
            assert time.monotonic() < end, "the lost tensor-parallel actor was not replaced"
            time.sleep(0.2)
        stats = wait_blocks_free(c.address, timeout=20)
        assert all(a.kv_blocks_used == 0 for a in stats.actors), stats
        assert list(generate(c.address, "after the fault", max_tokens=4, temperature=0.0))[-1].finish_reason
    finally:
        c.stop()
