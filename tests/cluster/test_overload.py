"""Overload: at several times the KV capacity, excess requests get RESOURCE_EXHAUSTED quickly;
admitted ones complete exactly; nothing leaks."""
from __future__ import annotations

import statistics
import threading
import time

import grpc
import pytest

from engine import SamplingParams
from router.client import generate

from cluster_helpers import ClusterThread, cluster_config, prompts_and_params, wait_blocks_free


@pytest.fixture(scope="module")
def small_cluster(ray_local, tiny_model_dir):
    # 48 blocks x 16 tokens per decode actor; each request needs 8 blocks -> 6 running, 4 queued.
    cfg = cluster_config(tiny_model_dir, "grpc", "none", 1, 1, max_queue=4)
    cfg = cfg.model_copy(update={"kv_cache": cfg.kv_cache.model_copy(update={"num_blocks": 48})})
    c = ClusterThread(cfg)
    yield c
    c.stop()


def test_excess_load_is_rejected_fast_and_admitted_requests_finish(small_cluster, reference):
    n = 40                                                     # ~4x what the pool can hold at once
    prompts, _ = prompts_and_params(n, seed=41, max_len=40)
    prompts = [(p * 4)[:60] for p in prompts]
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    expected = reference(prompts, [params] * n)
    results: dict[int, tuple] = {}

    def run(i):
        t0 = time.monotonic()
        try:
            tokens = [t for m in generate(small_cluster.address, token_ids=prompts[i], max_tokens=64,
                                          temperature=0.0, ignore_eos=True, timeout=60) for t in m.token_ids]
            results[i] = ("OK", tokens, time.monotonic() - t0)
        except grpc.RpcError as e:
            results[i] = (e.code().name, e.details(), time.monotonic() - t0)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    codes = [r[0] for r in results.values()]
    assert set(codes) <= {"OK", "RESOURCE_EXHAUSTED"}, codes
    assert codes.count("RESOURCE_EXHAUSTED") > 0 and codes.count("OK") >= 10
    for i, (code, body, _) in results.items():
        if code == "OK":
            assert body == expected[i]
        else:
            assert "queue" in body or "capacity" in body
    rejections = sorted(r[2] for r in results.values() if r[0] != "OK")
    p99 = rejections[min(len(rejections) - 1, int(0.99 * len(rejections)))]
    print(f"overload: {codes.count('OK')} admitted, {len(rejections)} rejected; rejection latency "
          f"p50 {statistics.median(rejections) * 1e3:.1f} ms, p99 {p99 * 1e3:.1f} ms")
    stats = wait_blocks_free(small_cluster.address)
    assert all(a.kv_blocks_used == 0 for a in stats.actors)
