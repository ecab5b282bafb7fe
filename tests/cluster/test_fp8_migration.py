"""fp8 KV (the default codec), or an int8 KV cache, and a decode actor killed mid-stream: every stream,
migrated ones included, is the one the same cluster gives without the fault. With the codec, the migrated
requests recompute their prompt through it (engine/kv_cache/prompt_kv.py), so they go on from the KV they
began with; with a quantized cache every query reads K/V as stored, wherever it was computed."""
from __future__ import annotations

import os
import signal
import time

import pytest
import ray

from cluster_helpers import cluster_config, join_streams, prompts_and_params, start_greedy_streams, wait_blocks_free
from cluster_support import ClusterThread

N = 10
MAX_TOKENS = 48


@pytest.mark.parametrize("codec, extra", [("fp8", {}), ("none", {"kv_cache.dtype": "int8"})],
                         ids=["fp8-codec", "int8-cache"])
def test_streams_survive_a_decode_kill_unchanged(ray_local, tiny_model_dir, codec, extra):
    """The fp8 transfer codec (prompts recomputed through it), and an int8 cache (blocks stored and shipped
    quantized; every query reads them as stored)."""
    prompts, _ = prompts_and_params(N, seed=7, max_len=200)
    c = ClusterThread(cluster_config(tiny_model_dir, "grpc", codec, 1, 2, local_prefill_tokens=0, extra=extra))
    try:
        c.cluster.backend.routing.stream_idle_s = 5.0
        threads, reference = start_greedy_streams(c.address, prompts, MAX_TOKENS)
        join_streams(threads)
        victim = c.cluster.backend.pools.decode[0]
        pid = ray.get(victim.client.handle.info.remote(), timeout=30)["pid"]
        threads, results = start_greedy_streams(c.address, prompts, MAX_TOKENS)
        end = time.monotonic() + 60
        while ray.get(victim.client.handle.stats.remote(), timeout=10)["running_requests"] < 2:
            assert time.monotonic() < end, "decode-0 never had requests in flight"
            time.sleep(0.005)
        os.kill(pid, signal.SIGKILL)
        join_streams(threads)
        differ = {i: next((n for n, (a, b) in enumerate(zip(results[i], reference[i])) if a != b), None)
                  for i in range(N) if results.get(i) != reference[i]}
        assert not differ, f"streams changed by the kill (first differing token): {differ}"
        assert len(reference) == N and all(len(t) == MAX_TOKENS for t in reference.values())
        stats = wait_blocks_free(c.address, timeout=30)
        assert all(a.kv_blocks_used == 0 for a in stats.actors), stats
    finally:
        c.stop()
