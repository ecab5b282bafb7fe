"""`Dispatcher`: the router's `Backend` over the prefill and decode actor pools.

One request, as dispatched here:

    admission: reserve KV blocks on a decode actor (wait in a bounded queue if none fits; among those
        with room, `routing.decode_policy` weighs cached prefix and running batch: router.dispatch)
      → pick a prefill actor (`routing.prefill_policy`: cached prefix against queued prompt tokens)
      → open the decode stream first (`DecodeJob`: the actor waits for the KV), then
        `PrefillJob` on the prefill actor ships the KV straight to that decode actor
      → decode events stream back as chunks; the `PrefillResult` adds timings

Failures, each one an attempt (at most `routing.max_attempts`):

    prefill actor unavailable, or its KV transfer failed (PrefillResult.retryable)
        → prefill again on another prefill actor; when the receiving side failed and the
          decode actor does not answer, the reservation moves to another decode actor first
    the KV never reached the decode actor (DecodeEvent.error.retryable) → prefill again
    decode actor lost mid-stream → migrate: another decode actor recomputes the prompt and
        the tokens already streamed, and continues (the client sees one stream)

Decode-side prefix reuse: before the jobs go out, the decode actor is asked how many leading
prompt blocks its own prefix cache holds; the DecodeJob pins them and the PrefillJob skips
them (only the rest is shipped). Placement (`_local_prefill`, by ``mode``): "disaggregated"
prefills short uncached prompts (`local_prefill_tokens`: fewer tokens than that left after the
prefill actor's or the decode actor's cached prefix) on the decode actor; "auto" decides per
request between remote prefill + transfer and chunked prefill on the decode actor with
`router.auto_placement` over the live profile (`router.live_profile`), and records in `placements`
whether each prompt needed a prefill actor (with none in the pool, `shadow` prices one) for the
autoscaler's role balance; "colocated" prefills every request on its decode actor. Migrated
requests are always prefilled by the decode actor. Cancellation aborts the request on both actors.
The actors are reached only through `router.actor_client` (deploy implements it with Ray).

What each actor has cached, for placement, comes only from its own cache events: `kv_index`
(router.kv_index), fed by `kv_poller` (router.kv_event_poller: a periodic pull, `run()`, plus a
poke of each actor whose prefill or request just ended).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import uuid
from collections import deque
from dataclasses import dataclass, field

import grpc

from engine.block_manager import blocks_needed, prompt_block_hashes
from engine.latency import time_per_output_token
from proto.pdserve.v1 import generation_pb2, worker_pb2 as wpb
from router.actor_client import ActorUnavailable
from router.admission import AdmissionQueue
from router.backend import ActorStats, Backend, BackendError, GenerationChunk, GenerationInput, Timing, Usage
from router.dispatch import pick_prefill, usable_cached_tokens
from router.kv_event_poller import KVEventPoller
from router.kv_index import KVIndex
from router.live_profile import LiveProfile
from router.auto_placement import Choice, DecodeState, Placement, PlacementInputs, PrefillState, ShadowPrefill, place
from router.pools import DecodeView, Pools, PrefillView
from router.timeline import Timeline

log = logging.getLogger(f"pdserve.{__name__}")

FINISH_REASON = {generation_pb2.FINISH_REASON_STOP: "stop", generation_pb2.FINISH_REASON_LENGTH: "length",
                 generation_pb2.FINISH_REASON_ABORT: "abort"}
STATUS_NAME = {code.value[0]: code.name for code in grpc.StatusCode}
SUSPECT_SIDES = (wpb.TRANSFER_SIDE_RECEIVER, wpb.TRANSFER_SIDE_TRANSPORT)
PREFIX_QUERY_TIMEOUT_S = 1.0      # longest wait for a decode actor's count of its cached prompt blocks


@dataclass(slots=True)
class RoutingSettings:
    local_prefill_tokens: int = 0
    long_request_tokens: int | None = None
    max_queue: int = 1024
    max_attempts: int = 3
    transfer_deadline_s: float = 30.0
    stream_idle_s: float = 60.0          # no prefill result and no token for this long: the actor is stuck
    max_queue_wait_s: float = 30.0       # longest admission wait of a request without a client deadline
    max_prefill_backlog_tokens: int | None = 32768   # a request waits while every prefill actor has more queued
    decode_prefix_reuse: bool = True     # the decode actor pins its cached prefix; the transfer ships the rest
    prefill_policy: str = "prefix_vs_queue"   # router.dispatch.PREFILL_POLICIES
    decode_policy: str = "kv_aware"           # router.dispatch.DECODE_POLICIES
    kv_events_interval_s: float = 0.2         # the KV event poller's period
    mode: str = "disaggregated"          # "disaggregated" | "auto" (router.auto_placement) | "colocated" (all local)
    ttft_slo_s: float = 1.0              # the SLOs auto placement keeps (config `slo`)
    tpot_slo_s: float = 0.1


class _Retry(Exception):
    """The prefill side failed; try again on another prefill actor."""

    def __init__(self, message: str, receiver_suspect: bool = False):
        super().__init__(message)
        self.receiver_suspect = receiver_suspect    # the transport failed: is the decode actor alive?


class _DecodeLost(Exception):
    """The decode actor died under the request; continue on another one."""


@dataclass(slots=True)
class _Dispatch:
    """One request's disaggregation state at the router."""

    inp: GenerationInput
    pool: list[DecodeView]               # the decode pool it is served from
    need_blocks: int                     # KV blocks reserved for prompt + max_tokens
    hashes: list[bytes]                  # chained hashes of the prompt's full blocks
    started: float
    timing: Timing = field(default_factory=Timing)
    view: DecodeView | None = None       # the decode actor holding the reservation
    excluded: set[str] = field(default_factory=set)    # prefill actors that failed it
    lost: set[str] = field(default_factory=set)        # decode actors that died under it
    emitted: list[int] = field(default_factory=list)   # tokens the client already has
    emitted_chars: int = 0                             # ... and how many characters of their text
    num_failures: int = 0
    first_token_at: float | None = None
    admitted: float = 0.0                # timeline: the admission wait ended
    sent_at: float | None = None         # ... this attempt's jobs went to the actors
    prefill_stages: wpb.ActorStages | None = None   # ... the actors' own stages (this attempt)
    decode_stages: wpb.ActorStages | None = None
    nonce: str = field(default_factory=lambda: uuid.uuid4().hex[:16])   # this dispatch, among all of its id
    placement: Placement | None = None   # routing.mode auto: this attempt's decision
    local_tokens: int = 0                # prompt tokens this attempt prefills on its decode actor, until its first
    batch_at_start: int = 0              # requests running on its decode actor when the attempt began
    recorded: bool = False               # in `completed` (and the live profile) already
    prompt_kv_lossy: bool = False        # the attempt that streamed `emitted` decoded from transferred KV

    @property
    def attempt_id(self) -> str:
        """The request's id on the actors: unique per dispatch and per attempt, so a late abort of a
        failed attempt, or of a cancelled request whose id the client reuses at once, never hits
        the request that replaced it (client ids may contain any separator: the nonce decides)."""
        return f"{self.inp.request_id}~{self.nonce}.{self.num_failures}"


class Dispatcher(Backend):
    def __init__(self, pools: Pools, tokenizer, max_model_len: int, block_size: int, routing: RoutingSettings,
                 codec: str = "none", metrics=None, generation_defaults: dict | None = None,
                 live: LiveProfile | None = None):
        """metrics: None, or an object with kv_transfer(seconds, kv_bytes, wire_bytes, codec),
        transfer_failed(), local_prefill(), prefix_hit_tokens(n) and, in auto mode, placement(choice)
        (router.metrics.Metrics). generation_defaults: the model's generation_config.json sampling
        defaults (unset fields). live: the actors' live profile (seeded by deploy; else generic figures)."""
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
        # finished requests for the autoscaler: (end, prompt_tokens, output_tokens, ttft_s, tpot_s)
        self.completed: deque[tuple[float, int, int, float, float]] = deque(maxlen=4096)
        # mode auto, every placement, for the autoscaler's role balance: (time, prompt tokens it computes,
        # whether it needed a prefill actor); without one, `shadow` prices the remote option
        self.placements: deque[tuple[float, int, bool]] = deque(maxlen=4096)
        self.shadow = ShadowPrefill()

    async def ready(self) -> bool:
        """Some decode actor can take requests (one down while it restarts is not an outage)."""
        return any(v.healthy and not v.draining for v in self.pools.decode)

    async def stats(self, timeout_s: float = 2.0) -> list[ActorStats]:
        """Every actor's load; an actor that does not answer within `timeout_s` is left out."""
        results = await asyncio.gather(*(asyncio.wait_for(v.client.stats(), timeout_s) for v in self.pools.all()),
                                       return_exceptions=True)
        return [r for r in results if isinstance(r, ActorStats)]

    def _decode_pool(self, total_tokens: int) -> list[DecodeView]:
        limit = self.routing.long_request_tokens
        if self.pools.long_context and limit is not None and total_tokens > limit:
            return self.pools.long_context
        return self.pools.decode

    # ---- one request ----------------------------------------------------
    async def generate(self, inp: GenerationInput):
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
        d = _Dispatch(inp, pool, need, prompt_block_hashes(prompt, self.block_size), time.monotonic())
        d.view = await self._admit(d)
        d.admitted = time.monotonic()
        d.timing.queue_s = d.admitted - d.started
        try:
            while True:
                try:
                    # closed at once when the client goes away at a yield (not left to the garbage collector)
                    async with contextlib.aclosing(self._attempt(d)) as chunks:
                        async for chunk in chunks:
                            if chunk.token_ids and not d.emitted:
                                d.first_token_at = time.monotonic()
                            d.emitted.extend(chunk.token_ids)
                            d.emitted_chars += len(chunk.text)
                            if chunk.timing is not None:      # the request's last chunk: the servicer
                                chunk.timing.timeline = self._timeline(d)     # closes us at its yield,
                                self._succeeded(d)                            # so record before it
                            yield chunk
                    self._succeeded(d)
                    return
                except _Retry as e:
                    d.num_failures += 1
                    log.warning("request %s: prefill/transfer attempt %d failed: %s", inp.request_id,
                                d.num_failures, e)
                    if e.receiver_suspect:       # the decode side refused or lost the KV
                        self._decode_failed(d.view)
                        if not await self._alive(d.view):
                            await self._switch_decode(d, f"decode actor {d.view.actor_id} is unreachable")
                        else:
                            await self._try_other_decode(d)
                except _DecodeLost as e:
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

    async def _admit(self, d: _Dispatch) -> DecodeView:
        """A decode reservation, FIFO; RESOURCE_EXHAUSTED at once when the queue is full, or when the
        wait (client deadline, else routing.max_queue_wait_s) runs out."""
        timeout = self.routing.max_queue_wait_s
        if d.inp.deadline is not None:
            timeout = min(timeout, max(d.inp.deadline - time.monotonic(), 0.0))
        num_prompt_tokens = len(d.inp.prompt_token_ids)
        view = await self.admission.acquire(d.pool, d.need_blocks, timeout,
                                            ready=lambda: self._prefill_has_room(d.hashes, num_prompt_tokens),
                                            **self._decode_choice(d))
        if view is None:
            raise BackendError("RESOURCE_EXHAUSTED", f"no room for {d.need_blocks} KV blocks on a decode actor "
                               f"and {num_prompt_tokens} prompt tokens in a prefill backlog: the admission queue is "
                               f"full ({self.routing.max_queue}) or {timeout:.1f}s passed; retry later")
        return view

    def _prefill_has_room(self, hashes: list[bytes], num_prompt_tokens: int) -> bool:
        """Some healthy prefill actor can queue this prompt within routing.max_prefill_backlog_tokens
        (an idle one always can); true when prefill is local or unbounded, and in modes auto (a full
        backlog sends the prompt to its decode actor) and colocated."""
        limit = self.routing.max_prefill_backlog_tokens
        if self.routing.mode != "disaggregated" or limit is None or \
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

    def _pick_prefill(self, d: _Dispatch) -> tuple[PrefillView | None, int]:
        """This attempt's prefill actor (routing.prefill_policy over the index) and its cached prefix in blocks."""
        return pick_prefill(self.pools.prefill, d.hashes, len(d.inp.prompt_token_ids), self.block_size,
                            self.kv_index, d.excluded, self.routing.prefill_policy)

    def _decode_choice(self, d: _Dispatch) -> dict:
        """What the decode policy weighs besides room: the index's cached prefix per actor."""
        return dict(cached=lambda: self.kv_index.prefix_by_actor(d.hashes), num_prompt_blocks=len(d.hashes),
                    policy=self.routing.decode_policy)

    async def _switch_decode(self, d: _Dispatch, why: str) -> None:
        """Move the request's KV reservation to another decode actor (the old one is gone)."""
        old = d.view
        old.healthy = False             # the pool manager restores it once the actor is back
        d.lost.add(old.actor_id)
        d.view = None                   # released here; nothing left to release if no one takes it
        await self.admission.release(old, d.need_blocks)
        timeout = 0.0 if d.inp.deadline is None else max(d.inp.deadline - time.monotonic(), 0.0)
        d.view = await self.admission.acquire(d.pool, d.need_blocks, timeout, exclude=d.lost, first=True,
                                              **self._decode_choice(d))
        if d.view is None:
            raise BackendError("UNAVAILABLE", f"{why}; no other decode actor can take the request")

    def _decode_failed(self, view: DecodeView) -> None:
        seconds = view.failed()
        if seconds:
            log.warning("decode actor %s quarantined for %.0fs after %d failed requests in a row", view.actor_id,
                        seconds, view.num_failures)

    async def _try_other_decode(self, d: _Dispatch) -> None:
        """The decode actor is alive but failed the request: retry on another one when one has room
        now (else stay: a single decode actor is retried rather than given up on)."""
        other = await self.admission.acquire(d.pool, d.need_blocks, 0.0, exclude={*d.lost, d.view.actor_id},
                                             first=True, **self._decode_choice(d))
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
    def _timeline(d: _Dispatch) -> Timeline:
        """The path to the first token: the router's own stages, the actors' stages of the last attempt,
        and the transit between them (the router's window less the actors' stages). Earlier failed
        attempts count in ``dispatch_s``; the servicer adds intake and closes it on its TTFT."""
        first = d.first_token_at or time.monotonic()
        sent = d.sent_at or first
        tl = Timeline(router_queue_s=d.admitted - d.started, dispatch_s=sent - d.admitted)
        tl.add_actor(d.prefill_stages)
        tl.add_actor(d.decode_stages)
        tl.fit_window(first - sent)
        return tl

    def _succeeded(self, d: _Dispatch) -> None:
        """Once per request: the decode actor served it; the finished request is recorded."""
        if not d.recorded:
            d.recorded = True
            d.view.succeeded()
            self._record(d)

    def _record(self, d: _Dispatch) -> None:
        now = time.monotonic()
        ttft = (d.first_token_at or now) - d.started
        tpot = time_per_output_token(ttft, now - d.started, len(d.emitted))
        self.completed.append((now, len(d.inp.prompt_token_ids), len(d.emitted), ttft, tpot))
        self.live.finished((d.batch_at_start + d.view.running) / 2, tpot, len(d.emitted))

    def _local_prefill(self, d: _Dispatch, view: DecodeView, pview: PrefillView | None, cached: int) -> bool:
        """Whether this attempt prefills on its decode actor: always in mode colocated, on a colocated
        actor and without a prefill actor; by the prompt's uncached length in mode disaggregated
        (`local_prefill_tokens`); by `router.auto_placement` in mode auto (logged, counted in metrics)."""
        mode, num_prompt = self.routing.mode, len(d.inp.prompt_token_ids)
        if mode == "colocated" or not view.endpoint or (pview is None and mode != "auto"):
            return True              # (a decode-pool actor without a KV receiver is colocated: it prefills all)
        if mode != "auto":
            uncached = num_prompt - usable_cached_tokens(cached, num_prompt, self.block_size)
            return uncached < self.routing.local_prefill_tokens
        live, now, shadow = self.live, time.monotonic(), pview is None
        if shadow:                   # no prefill actor: would one have helped? (router.auto_placement)
            prefill = self.shadow.state(now, live.prefill_tokens_per_s)
        else:
            prefill = PrefillState(pview.actor_id, pview.queued_tokens, cached * self.block_size)
        decode = DecodeState(view.actor_id, max(view.running - 1, 0), live.local_backlog(view.actor_id),
                             self.kv_index.prefix_blocks(view.actor_id, d.hashes) * self.block_size)
        d.placement = place(PlacementInputs(
            num_prompt, max(live.output_tokens or d.inp.params.max_tokens, 1.0), self.routing.ttft_slo_s,
            self.routing.tpot_slo_s, decode, live.decode_profile(), prefill, live.prefill_profile(), live.link()),
            shadow=shadow, all_decode_running=self._all_decode_running(d, decode.running))
        d.timing.placement = d.placement          # the request's log line carries the last attempt's decision
        needs = d.placement.needs_prefill_actor
        self.placements.append((now, max(num_prompt - decode.cached_tokens, 1), needs))
        if shadow and needs:
            self.shadow.take(max(num_prompt - prefill.cached_tokens, 1), now, live.prefill_tokens_per_s)
        if self.metrics:
            self.metrics.placement(d.placement.choice.value)
        return d.placement.choice is Choice.LOCAL

    def _all_decode_running(self, d: _Dispatch, running: int) -> int:
        """A decode actor's batch were the prefill actors decoding too: spread over both pools' actors."""
        num_decode = sum(1 for v in d.pool if v.healthy and not v.draining)
        num_prefill = sum(1 for v in self.pools.prefill if v.healthy and not v.draining)
        return round(running * num_decode / max(num_decode + num_prefill, 1)) if num_decode else running

    def _local_done(self, d: _Dispatch, compute_s: float | None) -> None:
        """The attempt's local prefill ended (its first event, or the attempt ended without one)."""
        self.live.local_ended(d.view.actor_id, d.local_tokens, compute_s)
        d.local_tokens = 0

    # ---- one attempt ----------------------------------------------------
    async def _attempt(self, d: _Dispatch):
        """One try on decode actor `d.view`. After a migration (`d.emitted` not empty) the
        decode actor recomputes prompt + emitted tokens locally and continues."""
        inp, view, rid = d.inp, d.view, d.attempt_id
        prompt = inp.prompt_token_ids
        pview, cached = self._pick_prefill(d)
        uncached = len(prompt) - usable_cached_tokens(cached, len(prompt), self.block_size)
        local = bool(d.emitted) or self._local_prefill(d, view, pview, cached)
        decode_cached = 0                    # leading prompt blocks the decode actor holds: not shipped
        if not local and self.routing.decode_prefix_reuse:
            decode_cached = await self._decode_cached_blocks(view, d.hashes, len(prompt))
            if self.routing.mode == "disaggregated":
                local = len(prompt) - decode_cached * self.block_size < self.routing.local_prefill_tokens
        if local:
            decode_cached = 0
        transfer_id = "" if local else uuid.uuid4().hex
        if not d.emitted:           # a migration recomputes the prompt as the KV its stream began from
            d.prompt_kv_lossy = not local and self.codec != "none"
        d.batch_at_start = view.running
        if local:
            total = len(prompt) + len(d.emitted)
            cached_tokens = self.kv_index.prefix_blocks(view.actor_id, d.hashes) * self.block_size
            d.local_tokens = max(total - cached_tokens, 1)
            self.live.local_started(view.actor_id, d.local_tokens)
        d.sent_at = d.prefill_stages = d.decode_stages = None
        # The transfer's deadline runs from when the send starts (prefill queueing does not eat it); the
        # decode actor waits for the transfer to begin as long as the router waits for the prefill.
        deadline_s, kv_wait_s = self.routing.transfer_deadline_s, self.routing.stream_idle_s
        if inp.deadline is not None:         # the client's deadline bounds every remote step
            remaining = inp.deadline - time.monotonic()
            deadline_s, kv_wait_s = max(min(deadline_s, remaining), 0.05), max(remaining, 0.05)
        params = inp.params.to_proto()
        stream = view.client.open_stream(wpb.DecodeJob(
            request_id=rid, prompt_token_ids=prompt, params=params, transfer_id=transfer_id,
            kv_timeout_s=kv_wait_s, resume_output_ids=d.emitted, resume_text_chars=d.emitted_chars,
            num_cached_blocks=decode_cached, prompt_kv_lossy=bool(d.emitted) and d.prompt_kv_lossy))
        prefill_task = None
        if local and self.metrics:
            self.metrics.local_prefill()
        if not local:
            pview.queued_tokens += uncached
            job = wpb.PrefillJob(request_id=rid, prompt_token_ids=prompt, params=params, kv_endpoint=view.endpoint,
                                 transfer_id=transfer_id, transfer_deadline_s=deadline_s, skip_blocks=decode_cached)
            prefill_task = asyncio.ensure_future(self._prefill(pview, job, uncached))
        usage = Usage(len(prompt), len(d.emitted), 0)
        finished = False
        num_open = inp.params.num_sequences          # sequences without their finish yet
        # Prompt logprobs come back in the PrefillResult: decode events wait for it, so they lead the stream.
        hold = not local and inp.params.prompt_logprobs is not None
        held: list[wpb.DecodeEvent] = []
        # The request's last finish carries usage and timing, which need the PrefillResult (cached tokens,
        # prefill and transfer times): a finish that outruns it waits for it here.
        deferred: list[wpb.DecodeEvent] = []
        prompt_logprobs = None
        read_task = asyncio.ensure_future(stream.read())
        d.sent_at = time.monotonic()
        try:
            while True:
                waiting = {task for task in (read_task, prefill_task) if task is not None}
                if not waiting:
                    raise BackendError("INTERNAL", f"decode stream of {rid} ended without a finish")
                done, _ = await asyncio.wait(waiting, timeout=self.routing.stream_idle_s,
                                             return_when=asyncio.FIRST_COMPLETED)
                if not done:
                    idle = f"sent nothing for {self.routing.stream_idle_s:.0f}s"
                    if prefill_task is not None:
                        raise _Retry(f"prefill actor {pview.actor_id} {idle}")
                    raise _DecodeLost(f"decode actor {view.actor_id} {idle}")
                events: list[wpb.DecodeEvent] = []
                if prefill_task in done:
                    result = prefill_task.result()
                    prefill_task = None
                    chunks = self._on_prefill(result, pview, d, usage)
                    if chunks:                       # every sequence ended at its first token: no decode
                        finished = True
                        for chunk in chunks:
                            yield chunk
                        return
                    if hold:
                        prompt_logprobs = list(result.prompt_logprobs)
                        hold, events, held = False, held, []
                    events, deferred = deferred + events, []
                if read_task in done:
                    got = read_task.result()
                    read_task = None
                    if got is not None:
                        (held if hold else events).extend(got)
                        read_task = asyncio.ensure_future(stream.read())
                    elif not (hold or deferred or events):
                        # held, deferred or just-released events may still finish it: checked once they are out
                        raise BackendError("INTERNAL", f"decode stream of {rid} ended without a finish")
                for i, ev in enumerate(events):
                    last = bool(ev.finish_reason) and num_open == 1
                    if last and prefill_task is not None:
                        deferred = events[i:]
                        break
                    if d.decode_stages is None and ev.HasField("stages"):
                        d.decode_stages = ev.stages
                        if d.local_tokens:
                            self._local_done(d, ev.stages.compute_s)
                        elif d.prefill_stages is not None and d.first_token_at is None:
                            self.live.remote_first_token(time.monotonic() - d.sent_at, _actor_seconds(d))
                    chunk = self._on_event(ev, d.timing, usage, last)
                    if prompt_logprobs is not None:
                        chunk.prompt_logprobs, prompt_logprobs = prompt_logprobs, None
                    if chunk.finish_reason is not None:
                        num_open -= 1
                    finished = num_open == 0
                    yield chunk
                    if finished:
                        return
        except ActorUnavailable as e:
            raise _DecodeLost(f"decode actor {view.actor_id}: {e}") from None
        except _Retry:
            if not local and len(self.pools.prefill) > len(d.excluded) + 1:
                d.excluded.add(pview.actor_id)       # try a different prefill actor next
            raise
        finally:
            if d.local_tokens:
                self._local_done(d, None)
            if read_task is not None:
                read_task.cancel()
            stream.cancel()
            if prefill_task is not None:
                prefill_task.cancel()
            if not finished:
                view.client.abort(rid)
                if not local:
                    pview.client.abort(rid)

    async def _decode_cached_blocks(self, view: DecodeView, hashes: list[bytes], num_prompt_tokens: int,
                                    timeout_s: float = PREFIX_QUERY_TIMEOUT_S) -> int:
        """How many leading blocks of `hashes` decode actor `view` holds in its prefix cache, as the actor
        itself answers (0 when it does not in time), capped so the block of the prompt's last token is
        always shipped. The one place the router learns it (an index of the actors' cache events can
        answer here instead); the DecodeJob then pins that many and the prefill actor skips them."""
        most = min(len(hashes), (num_prompt_tokens - 1) // self.block_size)
        if most == 0 or not view.endpoint:
            return 0
        try:
            hits = await asyncio.wait_for(view.client.cached_prefix(wpb.PrefixQuery(block_hashes=hashes[:most])),
                                          timeout_s)
        except (ActorUnavailable, asyncio.TimeoutError):
            return 0             # nothing skipped: the stream that follows finds out whether the actor is there
        return min(hits.num_cached_blocks, most)

    async def _prefill(self, pview: PrefillView, job: wpb.PrefillJob, uncached: int) -> wpb.PrefillResult:
        try:
            return await pview.client.prefill(job)
        except ActorUnavailable as e:
            return wpb.PrefillResult(request_id=job.request_id, transfer_id=job.transfer_id,
                                     status=wpb.PREFILL_STATUS_FAILED, error=str(e),
                                     failed_side=wpb.TRANSFER_SIDE_SENDER, retryable=True)
        finally:
            pview.queued_tokens -= uncached
            self.kv_poller.poke(pview)           # the blocks it just cached
            await self.admission.notify()        # a backlog drained: the head of the queue may fit now

    def _on_prefill(self, result: wpb.PrefillResult, pview: PrefillView, d: _Dispatch,
                    usage: Usage) -> list[GenerationChunk]:
        """Account the prefill; the chunks of every sequence when all ended at their first token."""
        if result.status in (wpb.PREFILL_STATUS_FAILED, wpb.PREFILL_STATUS_ABORTED):
            d.view.client.abort(result.request_id)
            if result.status == wpb.PREFILL_STATUS_FAILED:
                if self.metrics:
                    self.metrics.transfer_failed()
                if not result.retryable:         # the request itself was refused: no actor would take it
                    raise BackendError("INVALID_ARGUMENT", result.error)
            raise _Retry(f"prefill actor {pview.actor_id}: {result.error or 'aborted'}",
                         receiver_suspect=result.failed_side in SUSPECT_SIDES)
        self.live.prefill_done(result.num_prompt_tokens - result.num_cached_tokens, result.prefill_s,
                               result.kv_bytes, result.transfer_s, result.num_prompt_tokens)
        if result.HasField("stages"):
            d.prefill_stages = result.stages
        if self.metrics:
            self.metrics.prefix_hit_tokens(result.num_cached_tokens)
            if result.status == wpb.PREFILL_STATUS_SENT:
                self.metrics.kv_transfer(result.transfer_s, result.kv_bytes, result.wire_bytes, self.codec)
        t = d.timing
        t.queue_s += result.queue_s
        t.prefill_s = result.prefill_s
        t.kv_transfer_s = result.transfer_s
        usage.cached_prompt_tokens = result.num_cached_tokens
        if result.status != wpb.PREFILL_STATUS_FINISHED:
            return []
        d.view.client.abort(result.request_id)
        chunks = [self._on_event(ev, t, usage, i == len(result.first_tokens) - 1)
                  for i, ev in enumerate(result.first_tokens)]
        if result.prompt_logprobs:
            chunks[0].prompt_logprobs = list(result.prompt_logprobs)
        return chunks

    def _on_event(self, ev: wpb.DecodeEvent, timing: Timing, usage: Usage, last: bool) -> GenerationChunk:
        """One sequence's event as a chunk; `last`: it finishes the request's last open sequence (the chunk
        then carries usage and timing)."""
        if ev.error.code:
            if ev.error.retryable:               # the KV never arrived: prefill again
                raise _Retry(ev.error.message, receiver_suspect=True)
            raise BackendError(STATUS_NAME.get(ev.error.code, "INTERNAL"), ev.error.message)
        if ev.decode_queue_s:
            timing.decode_queue_s = ev.decode_queue_s
        token_ids = list(ev.token_ids)
        usage.completion_tokens += len(token_ids)
        chunk = GenerationChunk(token_ids, ev.text, None, index=ev.index, logprobs=list(ev.logprobs) or None,
                                prompt_logprobs=list(ev.prompt_logprobs) or None)
        if ev.finish_reason:
            chunk.finish_reason = FINISH_REASON[ev.finish_reason]
            which = ev.WhichOneof("matched_stop")
            chunk.matched_stop = getattr(ev, which) if which else None
            if not usage.cached_prompt_tokens:
                usage.cached_prompt_tokens = ev.num_cached_tokens
            if last:
                chunk.usage, chunk.timing = usage, timing
        return chunk


def _actor_seconds(d: _Dispatch) -> float:
    """The stages the actors reported up to a remote request's first token (prefill queue and compute,
    KV send, decode adoption); the rest of the router's window is overhead."""
    seconds = 0.0
    for stages in (d.prefill_stages, d.decode_stages):
        if stages is not None:
            seconds += stages.queue_s + stages.compute_s + stages.sampling_s + stages.kv_send_total_s + \
                stages.adopt_s
    return seconds
