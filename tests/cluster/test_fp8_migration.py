"""fp8 KV (the default codec) and a decode actor killed mid-stream: every stream, migrated ones
included, is the one the same cluster gives without the fault. The migrated requests recompute
their prompt through the codec (engine/kv_cache/prompt_kv.py), so they go on from the KV they began with."""
from __future__ import annotations

import os
import signal
import threading
import time

import ray

from cluster_helpers import cluster_config, prompts_and_params, wait_blocks_free
from cluster_support import ClusterThread
from router.client import generate

N = 10
MAX_TOKENS = 48


def _run_all(address: str, prompts):
    results: dict[int, list[int]] = {}

    def run(i):
        tokens = []
        for msg in generate(address, token_ids=prompts[i], max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                            timeout=90):
            tokens += msg.token_ids
        results[i] = tokens
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    return threads, results


def _join(threads) -> None:
    end = time.monotonic() + 120
    for t in threads:
        t.join(max(end - time.monotonic(), 0))
    assert not any(t.is_alive() for t in threads), "a request hung"


def test_fp8_streams_survive_a_decode_kill_unchanged(ray_local, tiny_model_dir):
    prompts, _ = prompts_and_params(N, seed=7, max_len=200)
    c = ClusterThread(cluster_config(tiny_model_dir, "grpc", "fp8", 1, 2, local_prefill_tokens=0))
    try:
        c.cluster.backend.routing.stream_idle_s = 5.0
        threads, reference = _run_all(c.address, prompts)
        _join(threads)
        victim = c.cluster.backend.pools.decode[0]
        pid = ray.get(victim.client.handle.info.remote(), timeout=30)["pid"]
        threads, results = _run_all(c.address, prompts)
        end = time.monotonic() + 60
        while ray.get(victim.client.handle.stats.remote(), timeout=10)["running_requests"] < 2:
            assert time.monotonic() < end, "decode-0 never had requests in flight"
            time.sleep(0.005)
        os.kill(pid, signal.SIGKILL)
        _join(threads)
        differ = [i for i in range(N) if results.get(i) != reference[i]]
        assert not differ, f"streams changed by the kill: {differ}"
        assert len(reference) == N and all(len(t) == MAX_TOKENS for t in reference.values())
        stats = wait_blocks_free(c.address, timeout=30)
        assert all(a.kv_blocks_used == 0 for a in stats.actors), stats
    finally:
        c.stop()


def test_int8_cache_streams_survive_a_decode_kill_unchanged(ray_local, tiny_model_dir):
    """kv_cache.dtype int8 (blocks stored and shipped quantized): the same holds."""
    prompts, _ = prompts_and_params(N, seed=8, max_len=200)
    c = ClusterThread(cluster_config(tiny_model_dir, "grpc", "none", 1, 2, local_prefill_tokens=0,
                                     extra={"kv_cache.dtype": "int8"}))
    try:
        c.cluster.backend.routing.stream_idle_s = 5.0
        threads, reference = _run_all(c.address, prompts)
        _join(threads)
        victim = c.cluster.backend.pools.decode[0]
        pid = ray.get(victim.client.handle.info.remote(), timeout=30)["pid"]
        threads, results = _run_all(c.address, prompts)
        end = time.monotonic() + 60
        while ray.get(victim.client.handle.stats.remote(), timeout=10)["running_requests"] < 2:
            assert time.monotonic() < end, "decode-0 never had requests in flight"
            time.sleep(0.005)
        os.kill(pid, signal.SIGKILL)
        _join(threads)
        differ = {i: next(n for n, (a, b) in enumerate(zip(results[i], reference[i])) if a != b)
                  for i in range(N) if results.get(i) != reference[i]}
        assert not differ, f"streams changed by the kill (first differing token): {differ}"
    finally:
        c.stop()
