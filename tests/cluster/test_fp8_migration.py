"""fp8 KV (the default codec), or an int8 KV cache, and a decode actor killed mid-stream: every stream,
migrated ones included, is the one the same cluster gives without the fault. With the codec, the migrated
requests recompute their prompt through it (engine/kv_cache/prompt_kv.py), so they go on from the KV they
began with; with a quantized cache every query reads K/V as stored, wherever it was computed."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest
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


@pytest.mark.parametrize("codec, extra", [("fp8", {}), ("none", {"kv_cache.dtype": "int8"})],
                         ids=["fp8-codec", "int8-cache"])
def test_streams_survive_a_decode_kill_unchanged(ray_local, tiny_model_dir, codec, extra):
    """The fp8 transfer codec (prompts recomputed through it), and an int8 cache (blocks stored and shipped
    quantized; every query reads them as stored)."""
    prompts, _ = prompts_and_params(N, seed=7, max_len=200)
    c = ClusterThread(cluster_config(tiny_model_dir, "grpc", codec, 1, 2, local_prefill_tokens=0, extra=extra))
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
        differ = {i: next((n for n, (a, b) in enumerate(zip(results[i], reference[i])) if a != b), None)
                  for i in range(N) if results.get(i) != reference[i]}
        assert not differ, f"streams changed by the kill (first differing token): {differ}"
        assert len(reference) == N and all(len(t) == MAX_TOKENS for t in reference.values())
        stats = wait_blocks_free(c.address, timeout=30)
        assert all(a.kv_blocks_used == 0 for a in stats.actors), stats
    finally:
        c.stop()
