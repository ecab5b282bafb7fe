"""The ``routing`` section: how the router picks actors for a request."""
from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field

from deploy.config.base import Int, Section


class RoutingSection(Section):
    """How the router picks actors for a request."""

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
    max_queue_wait_s: float = Field(30.0, gt=0, description="Longest admission wait (first come, first "
                                    "served) of a request without a client deadline; then RESOURCE_EXHAUSTED.")
    max_prefill_backlog_tokens: Optional[Int] = Field(
        32768, gt=0, description="A request waits in admission while every prefill actor has more "
        "prompt tokens queued than this (an idle actor always takes one); null = unbounded.")
    prefill_policy: Literal["prefix_vs_queue", "prefix_then_load"] = Field(
        "prefix_vs_queue", description="prefix_vs_queue: least uncached prompt tokens + prompt tokens queued "
        "there; prefix_then_load: longest cached prefix, then fewest queued prompt tokens (router.dispatch).")
    decode_policy: Literal["kv_aware", "most_free_blocks"] = Field(
        "kv_aware", description="Admit where prompt + max_tokens fit; kv_aware: fewest prompt blocks to ship "
        "(cached prefix) + a weight per running request, then most free blocks; most_free_blocks: most free.")
    kv_events_interval_s: float = Field(
        0.2, gt=0, le=60, description="How often the router pulls every actor's prefix-cache events (each "
        "actor is also pulled when its prefill or request ends).")
