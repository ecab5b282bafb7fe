"""`Placer`: where each attempt of a request runs, from the router's views, its `KVIndex` and the live profile.

The dispatcher and its attempts ask it, in this order:

    admission   prefill_has_room()   mode disaggregated: some prefill actor can queue the prompt within
                                     `routing.max_prefill_backlog_tokens` (the request waits otherwise)
                decode_choice()      what `routing.decode_policy` weighs besides room: the index's cached prefix
    prefill     pick_prefill()       `routing.prefill_policy` over the index's answer
    where       prefill_locally()    on the decode actor or on a prefill actor: mode colocated always local;
                                     disaggregated by the uncached prompt (`local_prefill_tokens`); auto by
                                     `router.placement.auto` over the live profile
    reuse       decode_cached_blocks()   the decode actor's own count of the prompt blocks it holds

In mode auto every decision is also kept as a `PlacementRecord` (whether the prompt needed a prefill
actor) for the autoscaler's role balance; with no prefill actor in the pool, `shadow` prices one.
"""
from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass

from proto.pdserve.v1 import worker_pb2 as wpb
from router.actor_protocol import ActorUnavailable
from router.placement.auto import Choice, DecodeState, Placement, PlacementInputs, PrefillState, ShadowPrefill, place
from router.placement.kv_index import KVIndex
from router.placement.live_profile import LiveProfile
from router.placement.policies import pick_prefill, usable_cached_tokens
from router.pools import DecodeView, Pools, PrefillView
from router.routing import RoutingMode, RoutingSettings

PREFIX_QUERY_TIMEOUT_S = 1.0      # longest wait for a decode actor's count of its cached prompt blocks
MAX_PLACEMENT_RECORDS = 4096


@dataclass(frozen=True, slots=True)
class PlacementRecord:
    """One auto placement, as the autoscaler's role balance weighs it."""

    at: float                    # time.monotonic() of the decision
    num_prompt_tokens: int       # prompt tokens it computes (those its decode actor lacks; at least 1)
    needs_prefill_actor: bool    # `Placement.needs_prefill_actor`


class Placer:
    """Placement decisions over `pools` (module docstring).

    Args:
        pools: the actor views (read at every decision: actors come and go).
        routing: the routing settings (mode, policies, thresholds, SLOs).
        block_size: tokens per KV block.
        kv_index: what each actor has cached, from its own cache events.
        live: the actors' live profile (mode auto).
        metrics: None, or an object with ``placement(choice)`` (router.metrics.Metrics).
    """

    def __init__(self, pools: Pools, routing: RoutingSettings, block_size: int, kv_index: KVIndex,
                 live: LiveProfile, metrics=None) -> None:
        self.pools, self.routing, self.block_size = pools, routing, block_size
        self.kv_index, self.live, self.metrics = kv_index, live, metrics
        self.shadow = ShadowPrefill()
        self.placements: deque[PlacementRecord] = deque(maxlen=MAX_PLACEMENT_RECORDS)

    def prefill_has_room(self, hashes: list[bytes], num_prompt_tokens: int) -> bool:
        """Some healthy prefill actor can queue this prompt within routing.max_prefill_backlog_tokens
        (an idle one always can); true when prefill is local or unbounded, and in modes auto (a full
        backlog sends the prompt to its decode actor) and colocated."""
        limit = self.routing.max_prefill_backlog_tokens
        if self.routing.mode is not RoutingMode.DISAGGREGATED or limit is None or \
                num_prompt_tokens < self.routing.local_prefill_tokens:
            return True
        healthy = [v for v in self.pools.prefill if v.healthy]
        if not healthy:
            return True          # every attempt prefills locally on its decode actor
        cached = self.kv_index.prefix_by_actor(hashes)

        def backlog(v: PrefillView) -> int:          # its queue once this prompt's uncached tokens join it
            hit = usable_cached_tokens(cached.get(v.actor_id, 0), num_prompt_tokens, self.block_size)
            return v.queued_tokens + num_prompt_tokens - hit
        return any(v.queued_tokens == 0 or backlog(v) <= limit for v in healthy)

    def decode_choice(self, hashes: list[bytes]) -> dict:
        """What the decode policy weighs besides room (keyword arguments of `AdmissionQueue.acquire`)."""
        return dict(cached=lambda: self.kv_index.priced_prefix_by_actor(hashes), num_prompt_blocks=len(hashes),
                    policy=self.routing.decode_policy)

    def pick_prefill(self, hashes: list[bytes], num_prompt_tokens: int,
                     excluded: set[str]) -> tuple[PrefillView | None, int]:
        """The attempt's prefill actor (routing.prefill_policy over the index) and its cached prefix in blocks."""
        return pick_prefill(self.pools.prefill, hashes, num_prompt_tokens, self.block_size, self.kv_index, excluded,
                            self.routing.prefill_policy)

    def prefill_locally(self, view: DecodeView, pview: PrefillView | None, cached: int, hashes: list[bytes],
                        num_prompt_tokens: int, max_tokens: int,
                        pool: list[DecodeView]) -> tuple[bool, Placement | None]:
        """Whether the attempt prefills on its decode actor `view`, and (mode auto) the decision it came from.

        Always in mode colocated, on a colocated actor, and without a prefill actor outside mode auto; by
        the prompt's uncached length in mode disaggregated (`local_prefill_tokens`); by
        `router.placement.auto` in mode auto (recorded, counted in metrics). `cached`: the blocks of the
        prompt prefill actor `pview` holds; `pool`: the decode pool the request is served from.
        """
        mode = self.routing.mode
        if mode is RoutingMode.COLOCATED or not view.endpoint or (pview is None and mode is not RoutingMode.AUTO):
            return True, None        # (a decode-pool actor without a KV receiver is colocated: it prefills all)
        if mode is not RoutingMode.AUTO:
            uncached = num_prompt_tokens - usable_cached_tokens(cached, num_prompt_tokens, self.block_size)
            return uncached < self.routing.local_prefill_tokens, None
        live, now, shadow = self.live, time.monotonic(), pview is None
        output_tokens = max(live.output_tokens or max_tokens, 1.0)
        prefill_profile = live.prefill_profile(num_prompt_tokens)
        if shadow:                   # no prefill actor: would one have helped? (router.placement.auto)
            prefill = self.shadow.state(now, prefill_profile.tokens_per_s)
        else:
            prefill = PrefillState(pview.actor_id, pview.queued_tokens,
                                   self._priced_tokens(pview.actor_id, hashes, cached))
        decode_cached = self.kv_index.prefix_blocks(view.actor_id, hashes)
        decode = DecodeState(view.actor_id, max(view.running - 1, 0), live.local_backlog(view.actor_id),
                             self._priced_tokens(view.actor_id, hashes, decode_cached))
        decode_profile = live.decode_profile(num_prompt_tokens, num_prompt_tokens + output_tokens / 2, view.actor_id)
        placement = place(PlacementInputs(
            num_prompt_tokens, output_tokens, self.routing.ttft_slo_s, self.routing.tpot_slo_s, decode,
            decode_profile, prefill, prefill_profile, live.link()),
            shadow=shadow, all_decode_running=self.all_decode_running(pool, decode.running))
        needs = placement.needs_prefill_actor
        self.placements.append(PlacementRecord(now, max(num_prompt_tokens - decode.cached_tokens, 1), needs))
        if shadow and needs:
            self.shadow.take(max(num_prompt_tokens - prefill.cached_tokens, 1), now, prefill_profile.tokens_per_s)
        if self.metrics:
            self.metrics.placement(placement.choice.value)
        return placement.choice is Choice.LOCAL, placement

    def _priced_tokens(self, actor_id: str, hashes: list[bytes], num_blocks: int) -> int:
        """Tokens a prefix hit of `num_blocks` on the actor saves, less the price of onboarding its tier-held
        blocks (what auto placement weighs)."""
        return round((num_blocks - self.kv_index.onboard_cost(actor_id, hashes, num_blocks)) * self.block_size)

    def all_decode_running(self, pool: list[DecodeView], running: int) -> int:
        """A decode actor's batch were the prefill actors decoding too: spread over both pools' actors."""
        num_decode = sum(1 for v in pool if v.accepting)
        num_prefill = sum(1 for v in self.pools.prefill if v.accepting)
        return round(running * num_decode / max(num_decode + num_prefill, 1)) if num_decode else running

    def local_tokens(self, view: DecodeView, hashes: list[bytes], num_tokens: int) -> int:
        """Tokens decode actor `view` computes to prefill `num_tokens` locally (what it lacks; at least 1)."""
        return max(num_tokens - self.kv_index.prefix_blocks(view.actor_id, hashes) * self.block_size, 1)

    async def decode_cached_blocks(self, view: DecodeView, hashes: list[bytes], num_prompt_tokens: int,
                                   timeout_s: float = PREFIX_QUERY_TIMEOUT_S) -> int:
        """How many leading blocks of `hashes` decode actor `view` holds in its prefix cache, as the actor
        itself answers (0 when it does not in time), capped so the block of the prompt's last token is
        always shipped. The DecodeJob then pins that many and the prefill actor skips them."""
        most = min(len(hashes), (num_prompt_tokens - 1) // self.block_size)
        if most == 0 or not view.endpoint:
            return 0
        try:
            hits = await asyncio.wait_for(view.client.cached_prefix(wpb.PrefixQuery(block_hashes=hashes[:most])),
                                          timeout_s)
        except (ActorUnavailable, asyncio.TimeoutError):
            return 0             # nothing skipped: the stream that follows finds out whether the actor is there
        return min(hits.num_cached_blocks, most)

    def recent_placements(self, window_s: float, now: float | None = None) -> list[PlacementRecord]:
        """The placements of the last `window_s` seconds, oldest first."""
        now = time.monotonic() if now is None else now
        return [p for p in list(self.placements) if now - p.at <= window_s]
