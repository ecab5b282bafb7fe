"""Colocated worker: prefills and decodes every request itself (continuous batching).

It is the colocated baseline at equal resources, and the base that `DecodeWorker`
builds on: a decode actor prefills locally every job that names no KV transfer
(short prompts, migrated requests).

Lifecycle of one request on this worker (each loop step: schedule → run → stream):

    submit(DecodeJob) ─► engine queue (WAITING) ─► prefill in chunks ─► RUNNING, one event per
    step with new tokens ─► finish (stop / length) or abort ─► the engine frees every block
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from engine import Engine, RequestOutput, SamplingParams
from engine.events import output_event
from engine.loop import EngineLoop
from proto.pdserve.v1 import generation_pb2, worker_pb2 as wpb

log = logging.getLogger(f"pdserve.{__name__}")

IDLE_WAIT_S = 0.05      # no batch: sleep until a command (or a finished transfer) wakes the loop


def error_event(code: grpc.StatusCode, message: str, retryable: bool = False) -> wpb.DecodeEvent:
    """The last event of a request that failed on this actor."""
    return wpb.DecodeEvent(error=wpb.DecodeError(code=code.value[0], message=message, retryable=retryable))


@dataclass(slots=True)
class Stream:
    """One request's event sink on this worker."""

    job: wpb.DecodeJob
    emit: Callable[[wpb.DecodeEvent], None]
    registered: float
    adopted: float | None = None         # when it joined the batch (KV adopted, or queued for local prefill)
    stepped: bool = False                # its first decode step has run
    remaining: int = 1                   # sequences not finished yet (n, or best_of)
    timed: bool = False                  # its first event (which carries this actor's stages) is out
    stages: wpb.ActorStages | None = None    # the KV handoff's stages, for the first event (decode actor)

    def __post_init__(self) -> None:
        self.remaining = self.job.params.best_of or self.job.params.n or 1


class ColocatedWorker:
    """Plain class (unit-testable without Ray); `decode_worker.actor` wraps it."""

    role = "colocated"
    endpoint = ""                        # no KV receiver

    def __init__(self, engine: Engine, actor_id: str = "colocated-0"):
        self.engine = engine
        self.actor_id = actor_id
        self._streams: dict[str, Stream] = {}         # request_id -> its stream, until the last event
        self.loop = EngineLoop(f"{actor_id}-loop", self._step)

    # ---- called from any thread ----------------------------------------
    def start(self) -> None:
        self.loop.start()

    def stop(self) -> None:
        self.loop.stop()

    def submit(self, job: wpb.DecodeJob, emit: Callable[[wpb.DecodeEvent], None]) -> None:
        stream = Stream(job, emit, time.monotonic())      # received: the timeline's queue starts
        self.loop.call(lambda: self._register(stream))

    def abort(self, request_id: str) -> None:
        self.loop.call(lambda: self._abort(request_id))

    # ---- loop thread ----------------------------------------------------
    def _register(self, s: Stream) -> None:
        rid = s.job.request_id
        if rid in self._streams or rid in self.engine.requests:
            s.emit(error_event(grpc.StatusCode.ALREADY_EXISTS,
                               f"request_id {rid!r} is already running on {self.actor_id}"))
            return
        self._streams[rid] = s
        try:
            self._accept(s, SamplingParams.from_proto(s.job.params))
        except ValueError as e:              # nothing was queued: the request is refused as it stands
            del self._streams[rid]
            s.emit(error_event(grpc.StatusCode.INVALID_ARGUMENT, str(e)))

    def _accept(self, s: Stream, params: SamplingParams) -> None:
        """Queue the job's prompt for prefill here; raises ValueError naming a bad field."""
        job = s.job
        if job.transfer_id:
            raise ValueError(f"transfer_id: {self.role} actor {self.actor_id} receives no KV")
        self.engine.add_request(list(job.prompt_token_ids), params, request_id=job.request_id,
                                resume_output_ids=list(job.resume_output_ids),
                                resume_text_chars=job.resume_text_chars, prompt_kv_lossy=job.prompt_kv_lossy)
        s.adopted = s.registered

    def _abort(self, request_id: str) -> None:
        """Drop the request wherever it is; its stream gets a final "abort" event."""
        s = self._streams.pop(request_id, None)
        if s is not None:
            self._drop(request_id)
            s.emit(wpb.DecodeEvent(finish_reason=generation_pb2.FINISH_REASON_ABORT))

    def _drop(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def _fail(self, request_id: str, event: wpb.DecodeEvent) -> None:
        """End the request here with `event` (an error)."""
        s = self._streams.pop(request_id, None)
        self._drop(request_id)
        if s is not None:
            s.emit(event)

    def _step(self) -> float:
        step_start = time.monotonic()
        outs = self.engine.step()                # schedule → run
        step_done = time.monotonic()
        for out in outs:
            self._stream(out, step_start, step_done)
        return 0.0 if self.engine.has_unfinished() else IDLE_WAIT_S

    def _stream(self, out: RequestOutput, step_start: float | None = None, step_done: float | None = None) -> None:
        """Send one step's output of one sequence to its request's stream (the last sequence's finish ends it)."""
        s = self._streams.get(out.request_id)
        if s is None:
            return
        event = output_event(out)
        if not s.timed:                          # the request's first event: this actor's stages up to it
            s.timed = True
            event.stages.CopyFrom(s.stages or self._prefill_stages(s, out, step_done or time.monotonic()))
        if step_start is not None and not s.stepped:
            s.stepped = True
            event.decode_queue_s = max(step_start - (s.adopted or step_start), 0.0)
        if out.finish_reason:
            s.remaining -= 1
            if s.remaining == 0:             # every sequence has finished: the stream ends here
                del self._streams[out.request_id]
        s.emit(event)

    def _prefill_stages(self, s: Stream, out: RequestOutput, step_done: float) -> wpb.ActorStages:
        """Queue, compute and sampling of a prompt prefilled here, up to its first token."""
        scheduled = min(out.first_scheduled_time or s.registered, step_done)
        run_done = min(max(self.engine.last_run_done, scheduled), step_done)
        return wpb.ActorStages(queue_s=max(scheduled - s.registered, 0.0), compute_s=run_done - scheduled,
                               sampling_s=step_done - run_done)

    def evict(self, reason: str) -> int:
        """Loop thread: end every open request with a retryable UNAVAILABLE error, so the router
        migrates it (recomputes prompt + streamed tokens elsewhere); returns how many. Used when
        the actor must give up its work (a role flip that ran out of time)."""
        request_ids = list(self._streams)
        for rid in request_ids:
            self._fail(rid, error_event(grpc.StatusCode.UNAVAILABLE, f"{self.actor_id}: {reason}", retryable=True))
        return len(request_ids)

    # ---- load report ----------------------------------------------------
    def stats(self) -> dict:
        bm = self.engine.block_manager
        sched = self.engine.scheduler
        return {"actor_id": self.actor_id, "role": self.role, "kv_blocks_total": bm.num_blocks,
                "kv_blocks_used": bm.num_used_blocks, "queued_requests": self.num_queued(),
                "running_requests": len(sched.running)}

    def num_queued(self) -> int:
        return self.engine.scheduler.num_queued

    def cached_prefix(self, query: wpb.PrefixQuery) -> wpb.PrefixHits:
        """How many leading blocks of the query's prompt this actor's prefix cache holds (any thread)."""
        return wpb.PrefixHits(num_cached_blocks=self.engine.cached_prefix_blocks(list(query.block_hashes)))
