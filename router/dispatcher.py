"""`Dispatcher`: the router's `Backend` over the prefill and decode actor pools.

One request, as dispatched here:

    admission: reserve KV blocks on a decode actor (wait in a bounded queue if none fits; among those
        with room, `routing.decode_policy` weighs cached prefix and running batch: router.placement)
      → attempts (`router.attempt.Attempt`): pick a prefill actor, open the decode stream, ship the KV
        from the prefill actor straight to the decode actor, stream the decode events back as chunks

Failures, each one an attempt (at most `routing.max_attempts`):

    prefill actor unavailable, or its KV transfer failed (PrefillResult.retryable)
        → prefill again on another prefill actor; when the receiving side failed and the
          decode actor does not answer, the reservation moves to another decode actor first
    the KV never reached the decode actor (DecodeEvent.error.retryable) → prefill again
    decode actor lost mid-stream → migrate: another decode actor recomputes the prompt and
        the tokens already streamed, and continues (the client sees one stream)

Where each attempt runs (remote prefill or local on the decode actor, by `routing.mode`) is the
`router.placement.Placer`'s decision. Cancellation aborts the request on both actors. The actors are
reached only through `router.actor_protocol` (deploy implements it with Ray). What each actor has cached
comes only from its own cache events: `kv_index`, fed by `kv_poller` (a periodic pull, plus a poke of
each actor whose prefill or request just ended).

What deploy (pool manager, autoscaler) uses, and nothing else:

    add_actors(pool, views) / remove_actor(pool, view) / pools_changed()   the pools change
    views(pool) / num_waiting / forget_actor(actor_id)                     read-only state
    recent_finished(window_s) / recent_placements(window_s)                `FinishedRequest`, `PlacementRecord`
    poll_kv_events()                                                       the KV event poller's loop
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass

from engine.kv_cache.block_manager import blocks_needed, prompt_block_hashes
from engine.latency import time_per_output_token
from router.admission import AdmissionQueue
from router.attempt import Attempt, DecodeLost, RequestState, RetryPrefill
from router.backend import ActorStats, Backend, BackendError, GenerationChunk, GenerationInput
from router.placement import KVEventPoller, KVIndex, LiveProfile, Placer, PlacementRecord
from router.placement.kv_index import TIER_IDS
from router.pools import DecodeView, Pools, PrefillView
from router.routing import RoutingSettings
from router.timing import Timeline

log = logging.getLogger(f"pdserve.{__name__}")

MAX_FINISHED_RECORDS = 4096
TIER_PRICING_PROMPT_TOKENS = 1024     # tier hits are priced against recomputing a block of a prompt this long


@dataclass(frozen=True, slots=True)
class FinishedRequest:
    """One finished request, as the autoscaler observes it."""

    at: float                    # time.monotonic() it finished
    num_prompt_tokens: int
    num_output_tokens: int
    ttft_s: float                # from its arrival at the dispatcher
    tpot_s: float


class Dispatcher(Backend):
    """The router's `Backend` over `pools` (module docstring).

    Args:
        pools: the actor views by pool (deploy builds them; they change through `add_actors` / `remove_actor`).
        tokenizer, max_model_len, generation_defaults: as `Backend` (generation_defaults: the model's
            generation_config.json sampling defaults for unset fields).
        block_size: tokens per KV block.
        routing: the routing settings.
        codec: the KV wire codec.
        metrics: None, or an object with kv_transfer(seconds, kv_bytes, wire_bytes, codec), transfer_failed(),
            local_prefill(), prefix_hit_tokens(n) and, in auto mode, placement(choice) (router.metrics.Metrics).
        live: the cluster's live performance model, which placement and the autoscaler ask (deploy builds it on
            the measured profile; else generic figures).
    """

    def __init__(self, pools: Pools, tokenizer, max_model_len: int, block_size: int, routing: RoutingSettings,
                 codec: str = "none", metrics=None, generation_defaults: dict | None = None,
                 live: LiveProfile | None = None):
        self.pools = pools
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.generation_defaults = dict(generation_defaults or {})
        self.block_size = block_size
        self.routing = routing
        self.admission = AdmissionQueue(routing.max_queue)
        self.codec = codec
        self.metrics = metrics
        self.kv_index = KVIndex()
        self.kv_poller = KVEventPoller(pools, self.kv_index, routing.kv_events_interval_s)
        self.live = live or LiveProfile(block_size=block_size)
        self.placer = Placer(pools, routing, block_size, self.kv_index, self.live, metrics)
        self.finished: deque[FinishedRequest] = deque(maxlen=MAX_FINISHED_RECORDS)

    async def ready(self) -> bool:
        """Some decode actor can take requests (one down while it restarts is not an outage)."""
        return any(v.accepting for v in self.pools.decode)

    async def stats(self, timeout_s: float = 2.0) -> list[ActorStats]:
        """Every actor's load; an actor that does not answer within `timeout_s` is left out."""
        results = await asyncio.gather(*(asyncio.wait_for(v.client.stats(), timeout_s) for v in self.pools.all()),
                                       return_exceptions=True)
        stats = [r for r in results if isinstance(r, ActorStats)]
        self._price_tiers(stats)
        return stats

    def _price_tiers(self, stats: list[ActorStats]) -> None:
        """The KV index prices a tier hit from the actors' measured onboarding against the measured prefill
        rate (a block of a typical prompt)."""
        recompute_s = self.live.prefill_seconds(TIER_PRICING_PROMPT_TOKENS) * self.block_size / \
            TIER_PRICING_PROMPT_TOKENS
        for s in stats:
            for tier in s.kv_tiers:
                if tier.get("onboard_s_per_block"):
                    self.kv_index.measure_tier(TIER_IDS[tier["kind"]], tier["onboard_s_per_block"], recompute_s)

    # ---- the face deploy uses --------------------------------------------
    async def add_actors(self, pool: str, views: list) -> None:
        """New actors of `pool` take traffic from now on."""
        self.pools.get(pool).extend(views)
        await self.admission.notify()

    def remove_actor(self, pool: str, view) -> bool:
        """`view` takes no more traffic of `pool` (its in-flight requests go on); False if it was not there."""
        views = self.pools.get(pool)
        if view not in views:
            return False
        views.remove(view)
        return True

    async def pools_changed(self) -> None:
        """Something about the actors changed (health, a view back, one gone): waiting requests check again."""
        await self.admission.notify()

    def views(self, pool: str | None = None) -> list:
        """The views of `pool` (of every pool when None), as a new list."""
        return list(self.pools.all() if pool is None else self.pools.get(pool))

    @property
    def num_waiting(self) -> int:
        """Requests waiting for admission."""
        return self.admission.num_waiting

    def forget_actor(self, actor_id: str) -> None:
        """The actor left the decode pool (flipped, replaced or removed): drop its live-profile state."""
        self.live.forget(actor_id)

    def recent_finished(self, window_s: float, now: float | None = None) -> list[FinishedRequest]:
        """The requests that finished in the last `window_s` seconds, oldest first."""
        now = time.monotonic() if now is None else now
        return [r for r in list(self.finished) if now - r.at <= window_s]

    def recent_placements(self, window_s: float, now: float | None = None) -> list[PlacementRecord]:
        """Mode auto: the placements of the last `window_s` seconds, oldest first (none in other modes)."""
        return self.placer.recent_placements(window_s, now)

    async def poll_kv_events(self) -> None:
        """Pull every actor's cache events into the index until cancelled."""
        await self.kv_poller.run()

    # ---- one request ----------------------------------------------------
    def _decode_pool(self, total_tokens: int) -> list[DecodeView]:
        limit = self.routing.long_request_tokens
        if self.pools.long_context and limit is not None and total_tokens > limit:
            return self.pools.long_context
        return self.pools.decode

    # ---- one request ----------------------------------------------------
    async def generate(self, inp: GenerationInput) -> AsyncIterator[GenerationChunk]:
        """Admit, then attempt until the request finished, retrying and migrating (module docstring)."""
        prompt = inp.prompt_token_ids
        total = len(prompt) + inp.params.max_tokens
        need = blocks_needed(len(prompt), inp.params.max_tokens, inp.params.num_sequences, self.block_size)
        pool = self._decode_pool(total)
        largest = max((v.kv_blocks_total for v in pool), default=0)
        if need > largest:
            raise BackendError("RESOURCE_EXHAUSTED", f"request needs {need} KV blocks ({total} tokens); "
                               f"the largest decode actor holds {largest}")
        if inp.params.seed is None:      # a server-chosen seed: a migrated request redraws the same tokens
            inp.params.seed = random.getrandbits(63)
        d = RequestState(inp, pool, need, prompt_block_hashes(prompt, self.block_size), time.monotonic())
        d.view = await self._admit(d)
        d.admitted = time.monotonic()
        d.timing.queue_s = d.admitted - d.started
        try:
            while True:
                try:
                    # closed at once when the client goes away at a yield (not left to the garbage collector)
                    async with contextlib.aclosing(self._attempt(d).chunks()) as chunks:
                        async for chunk in chunks:
                            if chunk.token_ids and not d.emitted:
                                d.first_token_at = time.monotonic()
                            d.emitted.extend(chunk.token_ids)
                            d.emitted_chars += len(chunk.text)
                            if chunk.timing is not None:      # the request's last chunk: the servicer
                                chunk.timing.timeline = self._timeline(d)     # closes us at its yield,
                                d.usage = chunk.usage
                                self._succeeded(d)                            # so record before it
                            yield chunk
                    self._succeeded(d)
                    return
                except RetryPrefill as e:
                    self._check_deadline(d, e)
                    d.num_failures += 1
                    log.warning("request %s: prefill/transfer attempt %d failed: %s", inp.request_id,
                                d.num_failures, e)
                    if e.receiver_suspect:       # the decode side refused or lost the KV
                        self._decode_failed(d.view)
                        if not await self._alive(d.view):
                            await self._switch_decode(d, f"decode actor {d.view.actor_id} is unreachable")
                        else:
                            await self._try_other_decode(d)
                except DecodeLost as e:
                    self._check_deadline(d, e)
                    d.num_failures += 1
                    self._decode_failed(d.view)
                    if d.emitted and inp.params.num_sequences > 1:
                        raise BackendError("UNAVAILABLE", f"{e}; a request with several sequences (n, best_of) is "
                                           "not migrated once it has streamed tokens") from None
                    log.warning("request %s: decode actor lost after %d tokens (%s); migrating",
                                inp.request_id, len(d.emitted), e)
                    await self._switch_decode(d, str(e))
                if d.num_failures >= self.routing.max_attempts:
                    raise BackendError("UNAVAILABLE", f"request failed {d.num_failures} times (prefill, KV "
                                       "transfer or decode actor); giving up")
        finally:
            if d.view is not None:
                self.kv_poller.poke(d.view)      # what the request left cached there
                await self.admission.release(d.view, need)

    def _admission_wait_s(self, d: RequestState) -> float:
        """How long the request may wait for decode room: until the client's deadline, at most
        routing.max_queue_wait_s."""
        timeout = self.routing.max_queue_wait_s
        if d.inp.deadline is not None:
            timeout = min(timeout, max(d.inp.deadline - time.monotonic(), 0.0))
        return timeout

    async def _admit(self, d: RequestState) -> DecodeView:
        """A decode reservation, FIFO; RESOURCE_EXHAUSTED at once when the queue is full, or when the
        wait (client deadline, else routing.max_queue_wait_s) runs out."""
        timeout = self._admission_wait_s(d)
        num_prompt_tokens = len(d.inp.prompt_token_ids)
        view = await self.admission.acquire(d.pool, d.need_blocks, timeout,
                                            ready=lambda: self.placer.prefill_has_room(d.hashes, num_prompt_tokens),
                                            **self.placer.decode_choice(d.hashes))
        if view is None:
            raise BackendError("RESOURCE_EXHAUSTED", f"no room for {d.need_blocks} KV blocks on a decode actor "
                               f"and {num_prompt_tokens} prompt tokens in a prefill backlog: the admission queue is "
                               f"full ({self.routing.max_queue}) or {timeout:.1f}s passed; retry later")
        return view

    async def _switch_decode(self, d: RequestState, why: str) -> None:
        """Move the request's KV reservation to another decode actor (the old one is gone)."""
        old = d.view
        old.healthy = False             # the pool manager restores it once the actor is back
        d.lost.add(old.actor_id)
        d.view = None                   # released here; nothing left to release if no one takes it
        await self.admission.release(old, d.need_blocks)
        # another actor may be full now: wait for its room at the head of the queue, as long as a new request
        # would wait; with no other actor to wait for (none that could ever hold the request), fail at once
        others = any(v.accepting and v.actor_id not in d.lost and v.kv_blocks_total >= d.need_blocks
                     for v in d.pool)
        d.view = await self.admission.acquire(d.pool, d.need_blocks, self._admission_wait_s(d) if others else 0.0,
                                              exclude=d.lost, first=True, **self.placer.decode_choice(d.hashes))
        if d.view is None:
            raise BackendError("UNAVAILABLE", f"{why}; no other decode actor can take the request" +
                               ("" if not others else " (none had room in time)"))

    @staticmethod
    def _check_deadline(d: RequestState, e: Exception) -> None:
        """DEADLINE_EXCEEDED when the client's deadline has passed: an attempt that failed on a timeout the deadline
        set (the KV wait, the transfer's) is the client's, not the actors', so nothing is retried or blamed."""
        if d.inp.deadline is not None and time.monotonic() >= d.inp.deadline:
            raise BackendError("DEADLINE_EXCEEDED", f"the request's deadline passed ({e})") from None

    def _decode_failed(self, view: DecodeView) -> None:
        seconds = view.failed()
        if seconds:
            log.warning("decode actor %s quarantined for %.0fs after %d failed requests in a row", view.actor_id,
                        seconds, view.num_failures)

    async def _try_other_decode(self, d: RequestState) -> None:
        """The decode actor is alive but failed the request: retry on another one when one has room
        now (else stay: a single decode actor is retried rather than given up on)."""
        other = await self.admission.acquire(d.pool, d.need_blocks, 0.0, exclude={*d.lost, d.view.actor_id},
                                             first=True, **self.placer.decode_choice(d.hashes))
        if other is not None:
            old, d.view = d.view, other
            await self.admission.release(old, d.need_blocks)

    async def _alive(self, view: DecodeView, timeout: float = 2.0) -> bool:
        try:
            await asyncio.wait_for(view.client.info(), timeout)
            return True
        except Exception:
            return False

    @staticmethod
    def _timeline(d: RequestState) -> Timeline:
        """The path to the first token: the router's own stages, the actors' stages of the last attempt,
        and the transit between them (the router's window less the actors' stages). Earlier failed
        attempts count in ``dispatch_s``; the servicer adds intake and closes it on its TTFT."""
        first = d.first_token_at or time.monotonic()
        sent = d.sent_at or first
        tl = Timeline(router_queue_s=d.admitted - d.started, dispatch_s=sent - d.admitted)
        tl.add_stages(d.prefill_stages)
        tl.add_stages(d.decode_stages)
        tl.fit_window(first - sent)
        return tl

    def _succeeded(self, d: RequestState) -> None:
        """Once per request: the decode actor served it; the finished request is recorded."""
        if not d.recorded:
            d.recorded = True
            d.view.succeeded()
            self._record(d)

    def _record(self, d: RequestState) -> None:
        now = time.monotonic()
        ttft = (d.first_token_at or now) - d.started
        tpot = time_per_output_token(ttft, now - d.started, len(d.emitted))
        num_prompt = len(d.inp.prompt_token_ids)
        self.finished.append(FinishedRequest(now, num_prompt, len(d.emitted), ttft, tpot))
        spec = (d.usage.spec_proposed_tokens, d.usage.spec_accepted_tokens) if d.usage is not None else (0, 0)
        self.live.finished((d.batch_at_start + d.view.running) / 2, tpot, len(d.emitted),
                           num_prompt + len(d.emitted) / 2, d.view.actor_id, *spec)

    def _attempt(self, d: RequestState) -> Attempt:
        return Attempt(d, self.placer, self.live, self.routing, self.codec, self.metrics, self._prefill_ended)

    async def _prefill_ended(self, pview: PrefillView) -> None:
        self.kv_poller.poke(pview)           # the blocks it just cached
        await self.admission.notify()        # a backlog drained: the head of the queue may fit now

