"""Prefill worker: batched, chunked prefill that ships each request's KV to a decode actor.

Lifecycle of one request on this worker:

    submit(job) ──► engine queue (WAITING) ──schedule/run──► first token sampled (PREFILLED,
    blocks held) ──► sender.send(kv_cache[:, blocks] → job.dest) ──► handle DONE/FAILED
    ──► engine.release (blocks stay in the prefix cache) ──► on_done(PrefillResult)

A request that finishes at its first token (EOS, max_tokens == 1) is reported
without a transfer. abort() drops the request wherever it is; a transfer in
flight completes or fails on its own and its blocks are released then.
"""
from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from engine import Engine, SamplingParams
from engine.loop import EngineLoop
from kv_transfer import KVSender, SendHandle, TransferStatus

log = logging.getLogger(f"pdserve.{__name__}")

IDLE_WAIT_S = 0.05      # nothing to do: sleep until a command arrives (or this long)
SEND_POLL_S = 0.002     # only transfers in flight: check their handles this often


@dataclass(slots=True)
class PrefillJob:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    dest: str                          # the decode actor's KV receiver endpoint
    transfer_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    deadline_s: float = 30.0           # for the KV transfer


@dataclass(slots=True)
class PrefillResult:
    request_id: str
    transfer_id: str
    status: str                        # "sent" | "finished" | "failed" | "aborted"
    first_token_id: int = -1
    finish_reason: str | None = None   # set when the request ended at its first token
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str = ""
    failed_side: str = ""              # "sender" | "receiver" | "transport" when failed
    queue_s: float = 0.0
    prefill_s: float = 0.0
    transfer_s: float = 0.0
    kv_bytes: int = 0                  # KV shipped, in the model dtype
    wire_bytes: int = 0                # what the codec put on the wire


@dataclass(slots=True)
class _Pending:
    job: PrefillJob
    on_done: Callable[[PrefillResult], None]
    submitted: float
    handle: SendHandle | None = None
    result: PrefillResult | None = None
    kv_bytes: int = 0


class PrefillWorker:
    """Plain class (unit-testable without Ray); `prefill_worker.actor` wraps it."""

    def __init__(self, engine: Engine, sender: KVSender, actor_id: str = "prefill-0"):
        self.engine = engine
        self.sender = sender
        self.actor_id = actor_id
        self._pending: dict[str, _Pending] = {}
        self._sending: dict[str, _Pending] = {}
        self.loop = EngineLoop(f"{actor_id}-loop", self._step)

    # ---- called from any thread ----------------------------------------
    def start(self) -> None:
        self.loop.start()

    def stop(self) -> None:
        self.loop.stop()
        self.sender.close()

    def submit(self, job: PrefillJob, on_done: Callable[[PrefillResult], None]) -> None:
        self.loop.call(lambda: self._admit(_Pending(job, on_done, time.monotonic())))

    def abort(self, request_id: str) -> None:
        self.loop.call(lambda: self._abort(request_id))

    # ---- loop thread ----------------------------------------------------
    def _admit(self, p: _Pending) -> None:
        rid = p.job.request_id
        try:
            self.engine.add_request(p.job.prompt_token_ids, p.job.params, request_id=rid, prefill_only=True)
        except ValueError as e:
            p.on_done(PrefillResult(rid, p.job.transfer_id, "failed", error=str(e), failed_side="sender"))
            return
        self._pending[rid] = p

    def _abort(self, request_id: str) -> None:
        p = self._pending.pop(request_id, None)
        if p is None:
            return
        if request_id in self._sending:          # blocks are released when the send ends
            return
        self.engine.abort(request_id)
        p.on_done(PrefillResult(request_id, p.job.transfer_id, "aborted"))

    def _step(self) -> bool:
        for out in self.engine.step():
            p = self._pending.get(out.request_id)
            if p is None:
                continue
            req_first = out.new_token_ids[0]
            done = time.monotonic()
            scheduled = out.first_scheduled_time or done
            result = PrefillResult(out.request_id, p.job.transfer_id, "sent", req_first, None,
                                   out.num_prompt_tokens, out.num_cached_tokens,
                                   queue_s=scheduled - p.submitted, prefill_s=done - scheduled)
            if out.finish_reason:                # ended at the first token: nothing to ship
                result.status, result.finish_reason = "finished", out.finish_reason
                del self._pending[out.request_id]
                p.on_done(result)
                continue
            p.result = result
            cache = self.engine.kv_cache
            p.kv_bytes = len(out.block_ids) * cache[:, 0].numel() * cache.element_size()
            p.handle = self.sender.send(out.request_id, self.engine.kv_cache, out.block_ids, p.job.dest,
                                        transfer_id=p.job.transfer_id, deadline_s=p.job.deadline_s,
                                        num_tokens=out.num_prompt_tokens, first_token_id=req_first)
            self._sending[out.request_id] = p
        self._reap_sends()
        if self.engine.has_unfinished():
            return 0.0
        return SEND_POLL_S if self._sending else IDLE_WAIT_S

    def _reap_sends(self) -> None:
        for rid, p in list(self._sending.items()):
            if not p.handle.done():
                continue
            del self._sending[rid]
            self.engine.release(rid)
            result = p.result
            result.transfer_s = p.handle.elapsed_s
            result.wire_bytes = p.handle.wire_bytes
            result.kv_bytes = p.kv_bytes
            if p.handle.status is not TransferStatus.DONE:
                result.status = "failed"
                result.error = p.handle.error or p.handle.status.value
                result.failed_side = p.handle.failed_side.value
                log.warning("KV transfer %s of %s failed (%s side): %s", p.job.transfer_id, rid,
                            result.failed_side, result.error)
            if self._pending.pop(rid, None) is None:
                result.status = "aborted"
            p.on_done(result)

    # ---- load report ----------------------------------------------------
    def stats(self) -> dict:
        bm = self.engine.block_manager
        sched = self.engine.scheduler
        return {"actor_id": self.actor_id, "role": "prefill", "kv_blocks_total": bm.num_blocks,
                "kv_blocks_used": bm.num_used_blocks, "queued_requests": len(sched.waiting),
                "running_requests": len(sched.running) + len(self._sending)}
