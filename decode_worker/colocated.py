"""Colocated worker: prefills and decodes every request itself (continuous batching).

It is the colocated baseline at equal resources; its local-prefill path (`prefill_locally`) is
also the decode worker's for every job that names no KV transfer (short prompts, migrated requests).

Lifecycle of one request on this worker (each loop step: schedule → run → stream):

    submit(DecodeJob) ─► engine queue (WAITING) ─► prefill in chunks ─► RUNNING, one event per
    step with new tokens ─► finish (stop / length) or abort ─► the engine frees every block
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

from decode_worker.streams import Stream, TokenStreams, worker_stats
from engine import Engine, SamplingParams
from engine.scheduling.loop import EngineLoop
from proto.pdserve.v1 import worker_pb2 as wpb

log = logging.getLogger(f"pdserve.{__name__}")


def prefill_locally(engine: Engine, s: Stream, params: SamplingParams) -> None:
    """Queue the job's prompt (and any output it resumes) for prefill on this engine; raises ValueError
    naming a bad field."""
    job = s.job
    engine.add_request(list(job.prompt_token_ids), params, request_id=job.request_id,
                       resume_output_ids=list(job.resume_output_ids), resume_text_chars=job.resume_text_chars,
                       prompt_kv_lossy=job.prompt_kv_lossy)
    s.adopted = s.registered


class ColocatedWorker:
    """Plain class (unit-testable without Ray); `deploy.actor.ServingActor` wraps it."""

    role = "colocated"
    endpoint = ""                        # no KV receiver

    def __init__(self, engine: Engine, actor_id: str = "colocated-0"):
        self.engine = engine
        self.actor_id = actor_id
        self.streams = TokenStreams(engine, actor_id, drop=engine.abort)
        self.loop = EngineLoop(f"{actor_id}-loop", self.streams.step)

    # ---- called from any thread ----------------------------------------
    def start(self) -> None:
        self.loop.start()

    def stop(self) -> None:
        self.loop.stop()

    def submit(self, job: wpb.DecodeJob, emit: Callable[[wpb.DecodeEvent], None]) -> None:
        stream = Stream(job, emit, time.monotonic())      # received: the timeline's queue starts
        self.loop.call(lambda: self.streams.open(stream, self._accept))

    def abort(self, request_id: str) -> None:
        self.loop.call(lambda: self.streams.abort(request_id))

    # ---- loop thread ----------------------------------------------------
    def _accept(self, s: Stream, params: SamplingParams) -> None:
        if s.job.transfer_id:
            raise ValueError(f"transfer_id: {self.role} actor {self.actor_id} receives no KV")
        prefill_locally(self.engine, s, params)

    def evict(self, reason: str) -> int:
        """Loop thread: end every open request with a retryable error, so the router migrates it; returns
        how many. Used when the actor must give up its work (a role flip that ran out of time)."""
        return self.streams.evict(reason)

    # ---- load report ----------------------------------------------------
    def stats(self) -> dict:
        return worker_stats(self.engine, self.actor_id, self.role, self.num_queued())

    def num_queued(self) -> int:
        return self.engine.scheduler.num_queued

    def cached_prefix(self, query: wpb.PrefixQuery) -> wpb.PrefixHits:
        """How many leading blocks of the query's prompt this actor's prefix cache holds (any thread)."""
        return wpb.PrefixHits(num_cached_blocks=self.engine.cached_prefix_blocks(list(query.block_hashes)))
