"""The token streams of a decode or colocated worker: one per request, from its job to its last event.

Both workers hold a `TokenStreams` and run it on their engine loop's thread: a job opens a
stream, each engine step's outputs become events on their requests' streams, and a finish, abort,
error or eviction closes it. Freeing what the engine holds for a request is the worker's `drop`.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from engine import Engine, RequestOutput, SamplingParams
from engine.output.events import output_event
from proto.pdserve.v1 import generation_pb2, worker_pb2 as wpb

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


class TokenStreams:
    """The open streams of one worker, by request id (loop thread only)."""

    def __init__(self, engine: Engine, actor_id: str, drop: Callable[[str], None]):
        """drop(request_id): free whatever the worker and its engine hold for the request."""
        self.engine, self.actor_id, self.drop = engine, actor_id, drop
        self._open: dict[str, Stream] = {}         # request_id -> its stream, until the last event

    def __len__(self) -> int:
        return len(self._open)

    def get(self, request_id: str) -> Stream | None:
        return self._open.get(request_id)

    def open(self, s: Stream, accept: Callable[[Stream, SamplingParams], None]) -> None:
        """Open `s` and hand it to `accept`, which queues its job (raising ValueError naming a bad field);
        a duplicate request id or a refused job gets its error event and leaves nothing open."""
        rid = s.job.request_id
        if rid in self._open or rid in self.engine.requests:
            s.emit(error_event(grpc.StatusCode.ALREADY_EXISTS,
                               f"request_id {rid!r} is already running on {self.actor_id}"))
            return
        self._open[rid] = s
        try:
            accept(s, SamplingParams.from_proto(s.job.params))
        except ValueError as e:              # nothing was queued: the request is refused as it stands
            del self._open[rid]
            s.emit(error_event(grpc.StatusCode.INVALID_ARGUMENT, str(e)))

    def forget(self, request_id: str) -> None:
        """Close the stream without an event (its caller emits one itself)."""
        del self._open[request_id]

    def abort(self, request_id: str) -> None:
        """Drop the request wherever it is; its stream gets a final "abort" event."""
        s = self._open.pop(request_id, None)
        if s is not None:
            self.drop(request_id)
            s.emit(wpb.DecodeEvent(finish_reason=generation_pb2.FINISH_REASON_ABORT))

    def fail(self, request_id: str, event: wpb.DecodeEvent) -> None:
        """End the request here with `event` (an error)."""
        s = self._open.pop(request_id, None)
        self.drop(request_id)
        if s is not None:
            s.emit(event)

    def evict(self, reason: str) -> int:
        """End every open request with a retryable UNAVAILABLE error, so the router migrates it
        (recomputes prompt + streamed tokens elsewhere); returns how many."""
        request_ids = list(self._open)
        for rid in request_ids:
            self.fail(rid, error_event(grpc.StatusCode.UNAVAILABLE, f"{self.actor_id}: {reason}", retryable=True))
        return len(request_ids)

    def step(self) -> float:
        """One engine step (schedule → run), its outputs streamed; returns how long the loop may idle."""
        step_start = time.monotonic()
        outs = self.engine.step()
        step_done = time.monotonic()
        for out in outs:
            self.stream(out, step_start, step_done)
        return 0.0 if self.engine.has_unfinished() else IDLE_WAIT_S

    def stream(self, out: RequestOutput, step_start: float | None = None, step_done: float | None = None) -> None:
        """Send one step's output of one sequence to its request's stream (the last sequence's finish ends it)."""
        s = self._open.get(out.request_id)
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
                del self._open[out.request_id]
        s.emit(event)

    def _prefill_stages(self, s: Stream, out: RequestOutput, step_done: float) -> wpb.ActorStages:
        """Queue, compute and sampling of a prompt prefilled here, up to its first token."""
        scheduled = min(out.first_scheduled_time or s.registered, step_done)
        run_done = min(max(self.engine.last_run_done, scheduled), step_done)
        return wpb.ActorStages(queue_s=max(scheduled - s.registered, 0.0), compute_s=run_done - scheduled,
                               sampling_s=step_done - run_done)


def worker_stats(engine: Engine, actor_id: str, role: str, num_queued: int) -> dict:
    """A decode or colocated worker's load report: its KV blocks and requests, and the speculative
    tokens it verified and accepted since it started."""
    bm = engine.block_manager
    spec = engine.speculator
    return {"actor_id": actor_id, "role": role, "kv_blocks_total": bm.num_blocks,
            "kv_blocks_used": bm.num_used_blocks, "queued_requests": num_queued,
            "running_requests": len(engine.scheduler.running), "kv_tiers": engine.tier_stats(),
            "spec_proposed_tokens": spec.num_proposed if spec is not None else 0,
            "spec_accepted_tokens": spec.num_accepted if spec is not None else 0}
