"""The ``slo`` section: the latency targets the planner and autoscaler size the pools for."""
from __future__ import annotations

from pydantic import Field

from deploy.config.base import Float, Section


class SLOSection(Section):
    """Latency targets the planner and autoscaler size the pools for."""

    ttft_p99_ms: Float = Field(1000.0, gt=0, description="p99 time to first token, ms.")
    tpot_p99_ms: Float = Field(100.0, gt=0, description="p99 time per output token, ms.")
