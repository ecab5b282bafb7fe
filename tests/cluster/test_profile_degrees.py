"""`pdserve profile --tp 1,2` on Ray actors: each pool measured by one actor of one rank, then by one actor
of two rank actors (fractional CPUs, gloo); the degree-2 points go under "degrees" and every rank group is
gone afterwards."""
from __future__ import annotations

import time

from ray.util import placement_group_table
from ray._private import state      # deploy/placement.py reads actor states the same way (no dashboard)

from deploy.config import load_config
from deploy.profiler import profile_cluster
from engine.performance import MeasuredPerformance

POINTS = {"prefill": [{"kind": "prefill", "prompt_len": 24, "batch": 1, "repeats": 1}],
          "decode": [{"kind": "decode", "batch": 2, "context": 32, "repeats": 1}]}


def test_profile_cluster_measures_each_degree_on_rank_groups(ray_local, tiny_model_dir):
    cfg = load_config(None, {
        "model.name": tiny_model_dir, "model.dtype": "float32", "kv_cache.num_blocks": 64,
        "kv_transfer.transport": "grpc", "kv_transfer.compression": "none",
        **{f"pools.{pool}.resources.{k}": v for pool in ("prefill", "decode")
           for k, v in (("num_cpus", 0.25), ("torch_threads", 1))}})
    data = profile_cluster(cfg, POINTS, progress=False, degrees=(1, 2))
    assert data["source"] == "actors" and MeasuredPerformance(data).degrees("decode") == [1, 2]
    for pool in ("prefill", "decode"):
        (one,), (two,) = data[pool]["points"], data["degrees"]["2"][pool]["points"]
        keys = ("prompt_len", "batch", "context")                   # the same measurement at each degree
        assert {k: one.get(k) for k in keys} == {k: two.get(k) for k in keys}
        assert two["seconds"] > 0

    def released() -> bool:
        ranks = [a for a in state.actors().values() if a.get("Name", "").endswith("-rank1")]
        return all(g["state"] == "REMOVED" for g in placement_group_table().values()) and \
            len(ranks) >= 2 and all(a["State"] == "DEAD" for a in ranks)     # one per pool here, all gone
    end = time.monotonic() + 30
    while not released() and time.monotonic() < end:
        time.sleep(0.1)
    assert released()
