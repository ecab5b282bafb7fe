"""The ``routing`` section: how the router picks actors for a request."""
from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, field_validator

from deploy.config.base import Float, Int, Section


class RoutingSection(Section):
    """How the router picks actors for a request."""

    mode: Literal["disaggregated", "auto", "colocated"] = Field(
        "disaggregated", description="Where each prompt is prefilled: disaggregated = on a prefill actor "
        "(except prompts under local_prefill_tokens); auto = per request, remote prefill + KV transfer or "
        "chunked prefill on the decode actor, whichever the live profiles say keeps both `slo` targets with "
        "the most headroom (router/placement/auto.py); colocated = every prompt on its decode actor.")
    role_flips: Literal["off", "manual", "auto"] = Field(
        "off", description="manual: start the prefill and decode actors as role-flippable actors (one engine, any "
        "role; deploy/actor.py) that PoolManager.flip switches prefill <-> decode <-> colocated at run time; "
        "auto: also let the autoscaler flip them, at a fixed actor count, when the measured load calls for "
        "another split (with hysteresis, deploy/role_balance.py). Flippable actors use the decode pool's KV cache.")
    local_prefill_tokens: Int = Field(
        0, ge=0, description="Prompts with fewer tokens than this left after the prefill actor's or the "
        "decode actor's cached prefix prefill on the decode actor itself (no KV transfer); 0 = off.")
    decode_prefix_reuse: bool = Field(
        True, description="Ask the decode actor for its cached prefix of the prompt: it pins those blocks "
        "and the transfer ships only the rest (false: every transfer ships the whole prompt).")
    long_request_tokens: Optional[Int] = Field(
        None, gt=0, description="Requests whose prompt + max_tokens exceed this go to "
        "pools.long_context (which must then be configured).")
    max_queue: Int = Field(1024, ge=1, description="Requests waiting in the router before "
                           "new ones get RESOURCE_EXHAUSTED.")
    max_queue_wait_s: Float = Field(30.0, gt=0, description="Longest admission wait (first come, first "
                                    "served) of a request without a client deadline; then RESOURCE_EXHAUSTED.")
    max_prefill_backlog_tokens: Optional[Int] = Field(
        32768, gt=0, description="A request waits in admission while every prefill actor has more "
        "prompt tokens queued than this (an idle actor always takes one); null = unbounded.")
    prefill_policy: Literal["prefix_vs_queue", "prefix_then_load"] = Field(
        "prefix_vs_queue", description="prefix_vs_queue: least uncached prompt tokens + prompt tokens queued "
        "there; prefix_then_load: longest cached prefix, then fewest queued prompt tokens "
        "(router/placement/policies.py).")
    decode_policy: Literal["kv_aware", "most_free_blocks"] = Field(
        "kv_aware", description="Admit where prompt + max_tokens fit; kv_aware: fewest prompt blocks to ship "
        "(cached prefix) + a weight per running request, then most free blocks; most_free_blocks: most free.")
    kv_events_interval_s: Float = Field(
        0.2, ge=0.01, le=60, description="How often the router pulls every actor's prefix-cache events (each "
        "actor is also pulled when its prefill or request ends); at least 0.01 s, each pull asks every actor.")

    @field_validator("role_flips", mode="before")
    @classmethod
    def _yaml_off(cls, value: object) -> object:
        """YAML reads a bare `off` as false (and `on` as true)."""
        if value is False:
            return "off"
        if value is True:
            return "manual"
        return value
