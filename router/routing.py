"""`RoutingSettings` (config `routing`, read by the dispatcher, its attempts and the placer) and `RoutingMode`."""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class RoutingMode(Enum):
    """Where each prompt is prefilled (`routing.mode`)."""

    DISAGGREGATED = "disaggregated"   # on a prefill actor, except prompts under `local_prefill_tokens`
    AUTO = "auto"                     # per request, by router.placement.auto over the live profile
    COLOCATED = "colocated"           # every prompt on its decode actor


@dataclass(slots=True)
class RoutingSettings:
    """The router's routing knobs; ``mode`` may be given by name (config), it is kept as a `RoutingMode`."""

    local_prefill_tokens: int = 0
    long_request_tokens: int | None = None
    max_queue: int = 1024
    max_attempts: int = 3
    transfer_deadline_s: float = 30.0
    stream_idle_s: float = 60.0          # no prefill result and no token for this long: the actor is stuck
    max_queue_wait_s: float = 30.0       # longest admission wait of a request without a client deadline
    max_prefill_backlog_tokens: int | None = 32768   # a request waits while every prefill actor has more queued
    decode_prefix_reuse: bool = True     # the decode actor pins its cached prefix; the transfer ships the rest
    prefill_policy: str = "prefix_vs_queue"   # router.placement.policies.PREFILL_POLICIES
    decode_policy: str = "kv_aware"           # router.placement.policies.DECODE_POLICIES
    kv_events_interval_s: float = 0.2         # the KV event poller's period
    mode: RoutingMode = RoutingMode.DISAGGREGATED
    ttft_slo_s: float = 1.0              # the SLOs auto placement keeps (config `slo`)
    tpot_slo_s: float = 0.1

    def __post_init__(self) -> None:
        self.mode = RoutingMode(self.mode)
