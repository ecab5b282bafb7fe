"""The profile as the planner reads it: interpolation between measured points, saturated prefill."""
from __future__ import annotations

import pytest
from profile_support import COSTS, synthetic

from deploy.planner import SLO, Limits, Workload, plan
from engine.performance import MeasuredPerformance as Profile

LIMITS = Limits(decode_kv_blocks=100_000, block_size=16, max_batch_size=256)


def test_interpolation_reproduces_measured_points():
    p = Profile(synthetic())
    assert p.decode_step_seconds(16, 1024) == pytest.approx(0.01 + 0.016 + 1e-6 * 16 * 1024)
    assert p.decode_step_seconds(10, 1024) == pytest.approx(0.01 + 0.010 + 1e-6 * 10 * 1024)   # between points
    assert p.decode_step_seconds(10, 1536) == pytest.approx(0.01 + 0.010 + 1e-6 * 10 * 1536)   # between contexts
    assert p.prefill_seconds(700) == pytest.approx(COSTS.prefill_flops(700) / 1e10)


def test_saturated_prefill_sets_capacity():
    data = synthetic()
    t_single = COSTS.prefill_flops(512) / 1e10
    data["prefill"]["points"].append({"prompt_len": 512, "batch": 8, "seconds": 4 * t_single,
                                      "flops": 8 * COSTS.prefill_flops(512), "flops_per_s": 2e10})
    p = Profile(data)
    assert p.prefill_seconds(512) == pytest.approx(t_single)                  # TTFT side: one prompt
    assert p.prefill_capacity(512) == pytest.approx(8 * 512 / (4 * t_single))  # throughput side: the batch
    result = plan(p, Workload(512, 128, 4.0), SLO(3.0, 0.05), LIMITS)
    assert result.prefill["capacity_tokens_per_s"] == pytest.approx(2 * 512 / t_single)
