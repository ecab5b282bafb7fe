"""Router metrics: the servicer reports each finished request; hooks and the stats poll feed gauges."""
from __future__ import annotations

import asyncio
import logging

from prometheus_client.parser import text_string_to_metric_families

from proto.pdserve.v1 import generation_pb2 as pb
from router import ActorStats, generate
from router.metrics import Metrics, poll_stats


def samples(metrics: Metrics) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(metrics.exposition().decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_request_finished_feeds_histograms(serve, caplog):
    caplog.set_level(logging.INFO, logger="pdserve.router")
    metrics = Metrics()
    running = serve(metrics=metrics)
    list(generate(running.address, "abcdef", request_id="m1", max_tokens=5, timeout=10))
    s = samples(metrics)
    assert s[("pdserve_requests_total", (("finish_reason", "length"),))] == 1
    for name in ("ttft", "e2e", "queue", "tpot"):
        assert s[(f"pdserve_{name}_seconds_count", ())] == 1
    assert s[("pdserve_itl_seconds_count", ())] == 4          # 5 token messages → 4 gaps
    assert s[("pdserve_queue_seconds_sum", ())] == 0.001      # the fake backend's queue_s
    finished = next(r for r in caplog.records if getattr(r, "event", "") == "request_finished")
    f = finished.fields
    assert f["tpot_s"] > 0 and f["ttft_s"] <= f["e2e_s"] and f["finish_reason"] == "length"
    assert {"queue_s", "prefill_s", "kv_transfer_s", "decode_queue_s", "completion_tokens"} <= set(f)


def test_hooks_and_stats_poll():
    metrics = Metrics()
    metrics.kv_transfer(0.01, 4096, 1100, "fp8")
    metrics.kv_transfer(0.02, 4096, 1100, "fp8")
    metrics.transfer_failed()
    metrics.local_prefill()
    metrics.prefix_hit_tokens(32)
    metrics.prefix_hit_tokens(0)
    metrics.request_finished("cancelled", ttft_s=None, e2e_s=0.0, queue_s=0.0, num_output_tokens=0)

    class Backend:
        calls = 0

        async def stats(self):
            Backend.calls += 1
            if Backend.calls == 1:
                return [ActorStats("prefill-0", pb.ACTOR_ROLE_PREFILL, 64, 3, 0, 0),
                        ActorStats("decode-0", pb.ACTOR_ROLE_DECODE, 64, 7, 0, 1)]
            return [ActorStats("decode-0", pb.ACTOR_ROLE_DECODE, 64, 5, 0, 1)]

    async def poll_twice():
        task = asyncio.ensure_future(poll_stats(Backend(), metrics, interval_s=0.01))
        while Backend.calls < 3:
            await asyncio.sleep(0.005)
        task.cancel()

    asyncio.run(poll_twice())
    s = samples(metrics)
    assert s[("pdserve_kv_transfer_bytes_total", (("codec", "fp8"),))] == 8192
    assert s[("pdserve_kv_wire_bytes_total", ())] == 2200
    assert s[("pdserve_kv_transfer_seconds_count", ())] == 2
    assert s[("pdserve_transfer_failures_total", ())] == 1
    assert s[("pdserve_local_prefills_total", ())] == 1
    assert s[("pdserve_prefix_cache_hit_tokens_total", ())] == 32
    assert s[("pdserve_requests_total", (("finish_reason", "cancelled"),))] == 1
    assert s[("pdserve_ttft_seconds_count", ())] == 0
    assert s[("pdserve_kv_blocks_used", (("actor", "decode-0"), ("role", "decode")))] == 5
    assert ("pdserve_kv_blocks_used", (("actor", "prefill-0"), ("role", "prefill"))) not in s  # left the pool


def test_grafana_dashboard_queries_only_exported_metrics():
    import json
    import os
    import re
    path = os.path.join(os.path.dirname(__file__), "..", "..", "deploy", "grafana-dashboard.json")
    with open(path) as f:
        dashboard = json.load(f)
    exprs = " ".join(t["expr"] for p in dashboard["panels"] for t in p.get("targets", []))
    used = set(re.findall(r"pdserve_[a-z0-9_]+", exprs))
    metrics = Metrics()
    metrics.request_finished("stop", ttft_s=0.1, e2e_s=0.2, queue_s=0.0, num_output_tokens=3, itl_s=[0.05])
    metrics.kv_transfer(0.01, 10, 5, "fp8")
    metrics.blocks_used("decode-0", "decode", 1, 8)
    exported = {name for name, _ in samples(metrics)}
    assert used and used <= exported, used - exported


def test_tier_metrics_follow_the_actors_reports():
    metrics = Metrics()

    def report(offload: int, hits: int, enabled: bool = True) -> ActorStats:
        tier = {"kind": "disk", "enabled": enabled, "num_blocks": 3, "num_bytes": 300, "capacity_bytes": 1000,
                "num_lookups": 10, "num_hits": hits, "hit_rate": hits / 10, "offload_bytes": offload,
                "onboard_bytes": 100 * hits, "onboard_bytes_per_s": 5e6, "onboard_s_per_block": 2e-5,
                "num_corrupt": 1, "num_dropped_offloads": 2}
        return ActorStats("decode-0", pb.ACTOR_ROLE_DECODE, 64, 5, 0, 1, kv_tiers=[tier])

    metrics.observe_stats([report(400, 4)])
    metrics.observe_stats([report(1000, 6, enabled=False)])
    s = samples(metrics)
    key = (("actor", "decode-0"), ("tier", "disk"))
    assert s[("pdserve_kv_tier_offload_bytes_total", key)] == 1000
    assert s[("pdserve_kv_tier_onboard_bytes_total", key)] == 600
    assert s[("pdserve_kv_tier_hits_total", key)] == 6 and s[("pdserve_kv_tier_lookups_total", key)] == 10
    assert s[("pdserve_kv_tier_dropped_offloads_total", key)] == 2
    assert s[("pdserve_kv_tier_corrupt_blocks_total", key)] == 1
    assert s[("pdserve_kv_tier_blocks", key)] == 3 and s[("pdserve_kv_tier_bytes", key)] == 300
    assert s[("pdserve_kv_tier_enabled", key)] == 0
    assert s[("pdserve_kv_tier_onboard_bandwidth_bytes_per_second", key)] == 5e6
    metrics.observe_stats([])                                        # the actor left: its gauges go
    assert ("pdserve_kv_tier_blocks", key) not in samples(metrics)
