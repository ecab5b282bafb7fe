"""Decode worker: adopts KV blocks written by the receiver and decodes with continuous batching.

Lifecycle of one request on this worker:

    submit(job) ─► WAITING_FOR_KV (job.transfer_id registered)
        receiver DONE  ─► engine.adopt(blocks, first token) ─► joins the running batch
        receiver FAILED/EXPIRED, or no KV by the deadline ─► error event (router re-dispatches)
    running ─► one event per step with new tokens ─► finish (stop/length) or abort
        ─► the engine frees every block the request held

A job without a transfer_id is prefilled here (conditional disaggregation).
KV that arrives for a request nobody waits for (aborted, or not yet registered)
is parked for `orphan_lease_s` and then freed: no block outlives its request.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from engine import Engine, RequestOutput, SamplingParams
from engine.loop import EngineLoop
from kv_transfer import KVReceiver, TransferResult, TransferStatus, handoff_from_result

log = logging.getLogger(f"pdserve.{__name__}")

IDLE_WAIT_S = 0.05      # no batch: sleep until a command or a finished transfer wakes the loop


@dataclass(slots=True)
class DecodeJob:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    transfer_id: str | None = None       # None: prefill locally
    num_cached_tokens: int = 0           # prompt tokens the prefill actor had cached
    kv_timeout_s: float = 30.0
    resume_output_ids: list[int] = field(default_factory=list)   # migrated: tokens already streamed


@dataclass(slots=True)
class DecodeEvent:
    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    error_code: str = ""                 # gRPC status name when the request failed here
    error: str = ""
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    decode_queue_s: float = 0.0


@dataclass(slots=True)
class _Job:
    job: DecodeJob
    emit: Callable[[DecodeEvent], None]
    registered: float
    adopted: float = 0.0
    first_step: bool = True


class DecodeWorker:
    """Plain class (unit-testable without Ray); `decode_worker.actor` wraps it."""

    def __init__(self, engine: Engine, make_receiver: Callable[[Callable], KVReceiver] | None,
                 actor_id: str = "decode-0", orphan_lease_s: float = 10.0, role: str = "decode"):
        """make_receiver(on_complete) builds the KV receiver; its completions wake the loop."""
        self.engine = engine
        self.actor_id = actor_id
        self.role = role                  # "decode", or "colocated" when it prefills everything itself
        self.orphan_lease_s = orphan_lease_s
        self._waiting_kv: dict[str, _Job] = {}        # transfer_id -> job
        self._orphans: dict[str, tuple[TransferResult, float]] = {}
        self._running: dict[str, _Job] = {}           # request_id -> job
        self.loop = EngineLoop(f"{actor_id}-loop", self._step)
        self.receiver = make_receiver(lambda _result: self.loop.wake()) if make_receiver else None

    @property
    def endpoint(self) -> str:
        return self.receiver.endpoint if self.receiver else ""

    # ---- called from any thread ----------------------------------------
    def start(self) -> None:
        self.loop.start()

    def stop(self) -> None:
        self.loop.stop()
        if self.receiver:
            self.receiver.close()

    def submit(self, job: DecodeJob, emit: Callable[[DecodeEvent], None]) -> None:
        self.loop.call(lambda: self._register(_Job(job, emit, time.monotonic())))

    def abort(self, request_id: str) -> None:
        self.loop.call(lambda: self._abort(request_id))

    # ---- loop thread ----------------------------------------------------
    def _register(self, j: _Job) -> None:
        job = j.job
        if job.request_id in self._running or job.request_id in self.engine.requests:
            j.emit(DecodeEvent(job.request_id, [], "", error_code="ALREADY_EXISTS",
                               error=f"request_id {job.request_id!r} is already running on {self.actor_id}"))
            return
        if job.transfer_id is None:
            try:
                self.engine.add_request(job.prompt_token_ids, job.params, request_id=job.request_id,
                                        resume_output_ids=job.resume_output_ids)
            except ValueError as e:
                j.emit(DecodeEvent(job.request_id, [], "", error_code="INVALID_ARGUMENT", error=str(e)))
                return
            j.adopted = j.registered
            self._running[job.request_id] = j
            return
        self._waiting_kv[job.transfer_id] = j
        orphan = self._orphans.pop(job.transfer_id, None)
        if orphan is not None:
            self._on_transfer(orphan[0])

    def _abort(self, request_id: str) -> None:
        """Drop the request wherever it is; its stream gets a final "abort" event."""
        aborted = []
        for tid, j in list(self._waiting_kv.items()):
            if j.job.request_id == request_id:
                del self._waiting_kv[tid]
                if self.receiver:
                    self.receiver.cancel(transfer_id=tid)
                aborted.append(j)
        j = self._running.pop(request_id, None)
        if j is not None:
            self.engine.abort(request_id)
            aborted.append(j)
        for j in aborted:
            j.emit(DecodeEvent(request_id, [], "", finish_reason="abort"))

    def _on_transfer(self, result: TransferResult) -> None:
        j = self._waiting_kv.pop(result.transfer_id, None)
        if j is None:
            if result.status is TransferStatus.DONE:      # nobody waits (yet): park under a lease
                self._orphans[result.transfer_id] = (result, time.monotonic())
            return
        rid = j.job.request_id
        if result.status is not TransferStatus.DONE:
            j.emit(DecodeEvent(rid, [], "", error_code="UNAVAILABLE",
                               error=f"KV transfer {result.transfer_id} {result.status.value}: {result.error}"))
            return
        handoff = handoff_from_result(result)       # the typed prefill -> decode message
        try:
            if handoff.num_tokens != len(j.job.prompt_token_ids):
                raise ValueError(f"KV for {handoff.num_tokens} tokens, prompt has {len(j.job.prompt_token_ids)}")
            out = self.engine.adopt(rid, j.job.prompt_token_ids, handoff.first_token_id, j.job.params,
                                    list(handoff.block_ids), j.job.num_cached_tokens)
        except ValueError as e:
            self.engine.block_manager.free(result.dst_block_ids)
            j.emit(DecodeEvent(rid, [], "", error_code="INTERNAL", error=f"cannot adopt KV: {e}"))
            return
        j.adopted = time.monotonic()
        if out.finish_reason is None:
            self._running[rid] = j
        self._emit(j, out)

    def _emit(self, j: _Job, out: RequestOutput, step_start: float | None = None) -> None:
        queue_s = 0.0
        if step_start is not None and j.first_step:
            j.first_step = False
            queue_s = max(step_start - j.adopted, 0.0)
        j.emit(DecodeEvent(out.request_id, out.new_token_ids, out.text_delta, out.finish_reason,
                           num_prompt_tokens=out.num_prompt_tokens, num_cached_tokens=out.num_cached_tokens,
                           num_output_tokens=out.num_output_tokens, decode_queue_s=queue_s))

    def _step(self) -> bool:
        if self.receiver is not None:
            for result in self.receiver.poll():
                self._on_transfer(result)
        self._expire(time.monotonic())
        step_start = time.monotonic()
        for out in self.engine.step():
            j = self._running.get(out.request_id)
            if j is None:
                continue
            if out.finish_reason:
                del self._running[out.request_id]
            self._emit(j, out, step_start)
        return 0.0 if self.engine.has_unfinished() else IDLE_WAIT_S

    def _expire(self, now: float) -> None:
        for tid, j in list(self._waiting_kv.items()):
            if now - j.registered > j.job.kv_timeout_s:
                del self._waiting_kv[tid]
                if self.receiver:
                    self.receiver.cancel(transfer_id=tid)
                j.emit(DecodeEvent(j.job.request_id, [], "", error_code="DEADLINE_EXCEEDED",
                                   error=f"KV for transfer {tid} did not arrive within {j.job.kv_timeout_s:.1f}s"))
        for tid, (result, parked) in list(self._orphans.items()):
            if now - parked > self.orphan_lease_s:
                del self._orphans[tid]
                self.engine.block_manager.free(result.dst_block_ids)
                log.info("freed %d blocks of unclaimed transfer %s", len(result.dst_block_ids), tid)

    # ---- load report ----------------------------------------------------
    def stats(self) -> dict:
        bm = self.engine.block_manager
        return {"actor_id": self.actor_id, "role": self.role, "kv_blocks_total": bm.num_blocks,
                "kv_blocks_used": bm.num_used_blocks, "queued_requests": len(self._waiting_kv)
                + len(self.engine.scheduler.waiting), "running_requests": len(self.engine.scheduler.running)}
