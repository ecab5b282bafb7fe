"""`Attempt`: one try of a request on its decode actor (the dispatcher retries and migrates around it).

One attempt, as `Attempt.chunks` runs it:

    place      prefill actor (`Placer.pick_prefill`), local or remote (`Placer.prefill_locally`), and the
               decode actor's cached prefix (pinned there, skipped by the prefill)
    send       open the decode stream first (`DecodeJob`: the actor waits for the KV, or prefills it
               itself), then `PrefillJob` on the prefill actor ships the KV straight to that decode actor
    merge      two racing tasks, the stream's next read and the `PrefillResult`; their events pass an
               `EventGate` (held / deferred / released) and go out as chunks; once the PrefillResult is
               in (or the prefill is local) the stream is read in the attempt's own task, one await a step
    end        the request finished, or the attempt raised: `RetryPrefill` (prefill side failed),
               `DecodeLost` (decode actor gone), `BackendError` (the request failed); unfinished, it
               is aborted on both actors

After a migration (``state.emitted`` not empty) the decode actor recomputes prompt + emitted tokens
locally and continues.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

import grpc

from proto.pdserve.v1 import worker_pb2 as wpb
from router.actor_protocol import ActorUnavailable
from router.backend import BackendError, GenerationChunk, GenerationInput, Usage
from router.placement.live_profile import LiveProfile
from router.placement.placer import Placer
from router.placement.policies import usable_cached_tokens
from router.pools import DecodeView, PrefillView
from router.routing import RoutingMode, RoutingSettings
from router.timing import Timing

STATUS_NAME = {code.value[0]: code.name for code in grpc.StatusCode}
SUSPECT_SIDES = (wpb.TRANSFER_SIDE_RECEIVER, wpb.TRANSFER_SIDE_TRANSPORT)
LOSSLESS_CODECS = ("none", "fp8_cache", "int8_cache")     # the kv_transfer codecs that are not lossy
T = TypeVar("T")


class RetryPrefill(Exception):
    """The prefill side failed; try again on another prefill actor."""

    def __init__(self, message: str, receiver_suspect: bool = False):
        super().__init__(message)
        self.receiver_suspect = receiver_suspect    # the transport failed: is the decode actor alive?


class DecodeLost(Exception):
    """The decode actor died under the request; continue on another one."""


@dataclass(slots=True)
class RequestState:
    """One request's disaggregation state at the router, across its attempts."""

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
    local_tokens: int = 0                # prompt tokens this attempt prefills on its decode actor, until its first
    batch_at_start: int = 0              # requests running on its decode actor when the attempt began
    recorded: bool = False               # in the finished requests (and the live profile) already
    prompt_kv_lossy: bool = False        # the attempt that streamed `emitted` decoded from transferred KV
    usage: Usage | None = None           # the finished request's counts (its last chunk's)

    @property
    def attempt_id(self) -> str:
        """The request's id on the actors: unique per dispatch and per attempt, so a late abort of a
        failed attempt, or of a cancelled request whose id the client reuses at once, never hits
        the request that replaced it (client ids may contain any separator: the nonce decides)."""
        return f"{self.inp.request_id}~{self.nonce}.{self.num_failures}"


class EventGate:
    """Orders one attempt's decode events against its `PrefillResult`. The rules:

    1. Held: while ``holding`` (a remote prefill of a request that asked for prompt logprobs, which
       come in the PrefillResult and lead the stream), every event read waits.
    2. Deferred: an event that would finish the request's last open sequence while the PrefillResult
       is still out waits, with every event after it in its batch (the request's last chunk carries
       usage and timing, which need the PrefillResult).
    3. Released: when the PrefillResult arrives, the waiting events go out first, in arrival order,
       before any event read after it.

    Events are never dropped or reordered. Held and deferred events never wait together: nothing is
    deferred while events are held, since held events are not looked at.
    """

    def __init__(self, holding: bool) -> None:
        self.holding = holding
        self._waiting: list[wpb.DecodeEvent] = []

    @property
    def pending(self) -> bool:
        """Events wait for the PrefillResult (held or deferred)."""
        return self.holding or bool(self._waiting)

    def read(self, events: list[wpb.DecodeEvent]) -> list[wpb.DecodeEvent]:
        """Events just read from the stream: those that may go out now (none while holding)."""
        if self.holding:
            self._waiting.extend(events)
            return []
        return events

    def defer(self, events: list[wpb.DecodeEvent]) -> None:
        """These events (from a last finish on) wait for the PrefillResult."""
        self._waiting = events

    def release(self) -> list[wpb.DecodeEvent]:
        """The PrefillResult arrived: every waiting event, in order; nothing is held from now on."""
        self.holding = False
        events, self._waiting = self._waiting, []
        return events


COUNTS_CANCELS = hasattr(asyncio.Task, "uncancel")     # Python >= 3.11 counts cancel requests; 3.10 does not


class IdleLimit:
    """Bounds each read of one stream at `idle_s`, as ``asyncio.timeout(idle_s)`` around it would, with one
    timer per idle period instead of one per read (a read a step is the per-token path): the timer is armed
    at the first read's deadline; when it fires it re-arms at the deadline of the read in progress, or, when
    that read has waited `idle_s`, cancels it and the read raises `DecodeLost`. Between reads it sleeps.
    """

    def __init__(self, idle_s: float, what: str) -> None:
        self.idle_s, self.what = idle_s, what
        self._loop = asyncio.get_running_loop()
        self._timer: asyncio.TimerHandle | None = None
        self._reading: asyncio.Task | None = None     # the task awaiting a read
        self._since = 0.0                             # ... since when
        self._expired = False

    async def read(self, read: Callable[[], Awaitable[T]]) -> T:
        """``await read()``; `DecodeLost` when it waited `idle_s`."""
        task = asyncio.current_task(self._loop)      # (given the loop: a third of the lookup's cost)
        self._since = self._loop.time()
        if self._timer is None:
            self._timer = self._loop.call_at(self._since + self.idle_s, self._check)
        self._reading, self._expired = task, False
        counted = COUNTS_CANCELS
        cancelling = task.cancelling() if counted else 0
        try:
            return await read()
        except asyncio.CancelledError:
            if self._expired and (not counted or task.uncancel() <= cancelling):   # ours, and no one else's
                raise DecodeLost(f"{self.what} sent nothing for {self.idle_s:.0f}s") from None
            raise
        finally:
            self._reading = None

    def _check(self) -> None:
        self._timer = None
        if self._reading is None:
            return                                    # between reads: the next read arms it again
        due = self._since + self.idle_s
        if self._loop.time() >= due:
            self._expired = True
            self._reading.cancel()
        else:
            self._timer = self._loop.call_at(due, self._check)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class Attempt:
    """One try of `state` on decode actor ``state.view`` (module docstring).

    Args:
        state: the request's state (read and updated: stages, timing, exclusions).
        placer: placement decisions for this attempt.
        live: the live profile (local prefill backlog, measured rates).
        routing: the routing settings (deadlines, idle limit, prefix reuse).
        codec: the KV wire codec ("none" and a quantized cache's stored cells, "fp8_cache" / "int8_cache", are
            lossless).
        metrics: None, or an object with kv_transfer(seconds, kv_bytes, wire_bytes, codec), transfer_failed(),
            local_prefill() and prefix_hit_tokens(n) (router.metrics.Metrics).
        prefill_ended: awaited once each prefill call ends (the dispatcher polls that actor's cache events
            and wakes the admission queue).
    """

    def __init__(self, state: RequestState, placer: Placer, live: LiveProfile, routing: RoutingSettings,
                 codec: str, metrics, prefill_ended: Callable[[PrefillView], Awaitable[None]]) -> None:
        self.state, self.placer, self.live, self.routing = state, placer, live, routing
        self.codec, self.metrics, self.prefill_ended = codec, metrics, prefill_ended

    async def chunks(self) -> AsyncIterator[GenerationChunk]:
        """The attempt's chunks, up to the request's last; raises `RetryPrefill`, `DecodeLost` or `BackendError`."""
        d, placer = self.state, self.placer
        inp, view, rid = d.inp, d.view, d.attempt_id
        prompt = inp.prompt_token_ids
        block_size = placer.block_size
        pview, cached = placer.pick_prefill(d.hashes, len(prompt), d.excluded)
        uncached = len(prompt) - usable_cached_tokens(cached, len(prompt), block_size)
        local = bool(d.emitted)
        if not local:
            local, placement = placer.prefill_locally(view, pview, cached, d.hashes, len(prompt),
                                                      inp.params.max_tokens, d.pool)
            if placement is not None:
                d.timing.placement = placement     # the request's log line carries the last attempt's decision
        decode_cached = 0                    # leading prompt blocks the decode actor holds: not shipped
        if not local and self.routing.decode_prefix_reuse:
            decode_cached = await placer.decode_cached_blocks(view, d.hashes, len(prompt))
            if self.routing.mode is RoutingMode.DISAGGREGATED:
                local = len(prompt) - decode_cached * block_size < self.routing.local_prefill_tokens
        if local:
            decode_cached = 0
        transfer_id = "" if local else uuid.uuid4().hex
        if not d.emitted:           # a migration recomputes the prompt as the KV its stream began from
            d.prompt_kv_lossy = not local and self.codec not in LOSSLESS_CODECS
        d.batch_at_start = view.running
        if local:
            d.local_tokens = placer.local_tokens(view, d.hashes, len(prompt) + len(d.emitted))
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
        gate = EventGate(holding=not local and inp.params.prompt_logprobs is not None)
        prompt_logprobs = None
        read_task = None            # the stream's next read as a task, while the PrefillResult is awaited too
        idle_limit = IdleLimit(self.routing.stream_idle_s, f"decode actor {view.actor_id}")
        stream_open = True
        d.sent_at = time.monotonic()
        try:
            while True:
                events: list[wpb.DecodeEvent] = []
                got, read = None, False
                if prefill_task is None and read_task is None:
                    if not stream_open:
                        raise BackendError("INTERNAL", f"decode stream of {rid} ended without a finish")
                    got, read = await idle_limit.read(stream.read), True     # the stream alone: read in this task
                else:
                    if read_task is None and stream_open:
                        read_task = asyncio.ensure_future(stream.read())
                    waiting = {task for task in (read_task, prefill_task) if task is not None}
                    done, _ = await asyncio.wait(waiting, timeout=self.routing.stream_idle_s,
                                                 return_when=asyncio.FIRST_COMPLETED)
                    if not done:
                        idle = f"sent nothing for {self.routing.stream_idle_s:.0f}s"
                        if prefill_task is not None:
                            raise RetryPrefill(f"prefill actor {pview.actor_id} {idle}")
                        raise DecodeLost(f"decode actor {view.actor_id} {idle}")
                    if prefill_task in done:
                        result = prefill_task.result()
                        prefill_task = None
                        chunks = self._on_prefill(result, pview, usage)
                        if chunks:                       # every sequence ended at its first token: no decode
                            finished = True
                            for chunk in chunks:
                                yield chunk
                            return
                        if gate.holding:
                            prompt_logprobs = list(result.prompt_logprobs)
                        events = gate.release()
                    if read_task in done:
                        got, read, read_task = read_task.result(), True, None
                if read:
                    if got is not None:
                        events.extend(gate.read(got))
                    else:
                        stream_open = False
                        if not (gate.pending or events):
                            # held, deferred or just-released events may still finish it: checked once they are out
                            raise BackendError("INTERNAL", f"decode stream of {rid} ended without a finish")
                for i, ev in enumerate(events):
                    last = bool(ev.finish_reason) and num_open == 1
                    if last and prefill_task is not None:
                        gate.defer(events[i:])
                        break
                    if d.decode_stages is None and ev.HasField("stages"):
                        d.decode_stages = ev.stages
                        if d.local_tokens:
                            self._local_done(ev.stages.compute_s)
                        elif d.prefill_stages is not None and d.first_token_at is None:
                            self.live.remote_first_token(time.monotonic() - d.sent_at, actor_seconds(d))
                    chunk = chunk_of(ev, d.timing, usage, last)
                    if prompt_logprobs is not None:
                        chunk.prompt_logprobs, prompt_logprobs = prompt_logprobs, None
                    if chunk.finish_reason is not None:
                        num_open -= 1
                    finished = num_open == 0
                    yield chunk
                    if finished:
                        return
        except ActorUnavailable as e:
            raise DecodeLost(f"decode actor {view.actor_id}: {e}") from None
        except RetryPrefill:
            if not local and len(placer.pools.prefill) > len(d.excluded) + 1:
                d.excluded.add(pview.actor_id)       # try a different prefill actor next
            raise
        finally:
            idle_limit.close()
            if d.local_tokens:
                self._local_done(None)
            if read_task is not None:
                read_task.cancel()
            stream.cancel()
            if prefill_task is not None:
                prefill_task.cancel()
            if not finished:
                view.client.abort(rid)
                if not local:
                    pview.client.abort(rid)

    def _local_done(self, compute_s: float | None) -> None:
        """The attempt's local prefill ended (its first event, or the attempt ended without one)."""
        d = self.state
        self.live.local_ended(d.view.actor_id, d.local_tokens, compute_s)
        d.local_tokens = 0

    async def _prefill(self, pview: PrefillView, job: wpb.PrefillJob, uncached: int) -> wpb.PrefillResult:
        try:
            return await pview.client.prefill(job)
        except ActorUnavailable as e:
            return wpb.PrefillResult(request_id=job.request_id, transfer_id=job.transfer_id,
                                     status=wpb.PREFILL_STATUS_FAILED, error=str(e),
                                     failed_side=wpb.TRANSFER_SIDE_SENDER, retryable=True)
        finally:
            pview.queued_tokens -= uncached
            await self.prefill_ended(pview)

    def _on_prefill(self, result: wpb.PrefillResult, pview: PrefillView, usage: Usage) -> list[GenerationChunk]:
        """Account the prefill; the chunks of every sequence when all ended at their first token."""
        d = self.state
        if result.status in (wpb.PREFILL_STATUS_FAILED, wpb.PREFILL_STATUS_ABORTED):
            d.view.client.abort(result.request_id)
            if result.status == wpb.PREFILL_STATUS_FAILED:
                if self.metrics:
                    self.metrics.transfer_failed()
                if not result.retryable:         # the request itself was refused: no actor would take it
                    raise BackendError("INVALID_ARGUMENT", result.error)
            raise RetryPrefill(f"prefill actor {pview.actor_id}: {result.error or 'aborted'}",
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
        chunks = [chunk_of(ev, t, usage, i == len(result.first_tokens) - 1) for i, ev in enumerate(result.first_tokens)]
        if result.prompt_logprobs:
            chunks[0].prompt_logprobs = list(result.prompt_logprobs)
        return chunks


def chunk_of(ev: wpb.DecodeEvent, timing: Timing, usage: Usage, last: bool) -> GenerationChunk:
    """One sequence's event as a chunk; `last`: it finishes the request's last open sequence (the chunk
    then carries usage and timing). Raises `RetryPrefill` when the KV never arrived, else `BackendError`
    for an event's error."""
    if ev.error.code:
        if ev.error.retryable:               # the KV never arrived: prefill again
            raise RetryPrefill(ev.error.message, receiver_suspect=True)
        raise BackendError(STATUS_NAME.get(ev.error.code, "INTERNAL"), ev.error.message)
    if ev.decode_queue_s:
        timing.decode_queue_s = ev.decode_queue_s
    token_ids = ev.token_ids[:]              # (a list; half the cost of list() on a repeated field)
    usage.completion_tokens += len(token_ids)
    # (positional, in GenerationChunk's field order: one is built per token)
    chunk = GenerationChunk(token_ids, ev.text, None, None, None, ev.index,
                            list(ev.logprobs) if ev.logprobs else None,
                            list(ev.prompt_logprobs) if ev.prompt_logprobs else None)
    if ev.finish_reason:
        chunk.finish_reason = ev.finish_reason
        which = ev.WhichOneof("matched_stop")
        chunk.matched_stop = getattr(ev, which) if which else None
        if not usage.cached_prompt_tokens:
            usage.cached_prompt_tokens = ev.num_cached_tokens
        usage.spec_proposed_tokens += ev.num_spec_proposed_tokens
        usage.spec_accepted_tokens += ev.num_spec_accepted_tokens
        if last:
            chunk.usage, chunk.timing = usage, timing
    return chunk


def actor_seconds(d: RequestState) -> float:
    """The stages the actors reported up to a remote request's first token (prefill queue and compute,
    KV send, decode adoption); the rest of the router's window is overhead."""
    seconds = 0.0
    for stages in (d.prefill_stages, d.decode_stages):
        if stages is not None:
            seconds += stages.queue_s + stages.compute_s + stages.sampling_s + stages.kv_send_total_s + \
                stages.adopt_s
    return seconds
