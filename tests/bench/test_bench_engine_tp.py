"""Smoke test of `bench.engine --tp`: degrees 1 and 2 run on `tiny` and every figure is reported.

No timing assertions: the figures are for the model (docs/sizing.md), not a goal of this test.
"""
from __future__ import annotations

import argparse
import math

from bench.engine import tensor_parallel
from bench.engine.suite import Plan, Progress


def test_tp_bench_reports_time_speedup_prediction_and_allreduce_per_degree():
    plan = Plan(prefill_lens=(48,), prefill_repeats=1, decode_batches=(1, 3), decode_context=20, decode_steps=2,
                decode_repeats=1)
    args = argparse.Namespace(model="tiny", dtype="float32", quick=True, attention="eager", weight_layout="row-major",
                              threads=2, tp="1,2")
    result = tensor_parallel.run(args, plan, Progress())
    assert set(result["tp"]) == {"1", "2"}
    one, two = result["tp"]["1"], result["tp"]["2"]
    assert (one["ranks"], one["threads_per_rank"], two["ranks"], two["threads_per_rank"]) == (1, 2, 2, 1)
    for r in (one, two):
        assert set(r["prefill"]) == {"48"} and set(r["decode"]) == {"1", "3"}
        for point in [*r["prefill"].values(), *r["decode"].values()]:
            assert all(math.isfinite(point[k]) and point[k] > 0
                       for k in ("s", "speedup", "device_s", "device_speedup", "predicted_speedup"))
    # degree 1's own points are its one-device baseline (2 threads); degree 2's is degree 1 on 1 thread
    assert all(p["device_s"] == p["s"] for p in [*one["prefill"].values(), *one["decode"].values()])
    assert all(p["device_s"] != one["decode"][key]["s"] for key, p in two["decode"].items())
    assert all(p["allreduce_s"] == 0 for p in [*one["prefill"].values(), *one["decode"].values()])
    assert all(p["allreduce_s"] > 0 for p in [*two["prefill"].values(), *two["decode"].values()])
    text = tensor_parallel.render_text(result)
    assert "planner's speed-up" in text and "one device" in text and "all-reduce / step" in text
    assert len(text.splitlines()) == 3 + 6
