"""Prefill worker: batched, chunked prefill that ships each request's KV to a decode actor.

Lifecycle of one request on this worker (each loop step: schedule → run → send KV):

    submit(PrefillJob) ──► engine queue (WAITING) ──schedule/run──► each sequence's first token sampled
    (PREFILLED, blocks held) ──► sender.send(kv_cache[:, blocks[job.skip_blocks:]] + Handoff → job.kv_endpoint)
    ──► handle DONE/FAILED ──► engine.release (blocks stay in the prefix cache) ──► on_done(PrefillResult)

With n > 1 (best_of) the prompt is prefilled once and its KV shipped once; the
handoff carries every sequence's first token (with its logprobs), and the
decode actor forks the sequences over the blocks it received. Prompt logprobs
go back to the router in the PrefillResult. A request whose every sequence
finishes at its first token (EOS, max_tokens == 1) is reported without a
transfer. `job.skip_blocks` leading prompt blocks are not shipped: the decode
actor holds them in its own prefix cache (it pinned them). abort() drops the
request wherever it is; a transfer in flight completes or fails on its own and its blocks are released then.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from engine import Engine, SamplingParams
from engine.events import output_event
from engine.loop import EngineLoop
from engine.request import RequestOutput
from kv_transfer import FailedSide, KVSender, SendHandle, TransferStatus
from proto.pdserve.v1 import worker_pb2 as wpb

log = logging.getLogger(f"pdserve.{__name__}")

IDLE_WAIT_S = 0.05      # nothing to do: sleep until a command or a finished send wakes the loop (or this long)

TRANSFER_SIDE = {FailedSide.SENDER: wpb.TRANSFER_SIDE_SENDER, FailedSide.RECEIVER: wpb.TRANSFER_SIDE_RECEIVER,
                 FailedSide.TRANSPORT: wpb.TRANSFER_SIDE_TRANSPORT}


@dataclass(slots=True)
class _Pending:
    job: wpb.PrefillJob
    on_done: Callable[[wpb.PrefillResult], None]
    submitted: float
    handle: SendHandle | None = None
    result: wpb.PrefillResult | None = None
    sampled: float = 0.0                 # its first tokens were sampled (the KV send starts)


class PrefillWorker:
    """Plain class (unit-testable without Ray); `prefill_worker.actor` wraps it."""

    def __init__(self, engine: Engine, sender: KVSender, actor_id: str = "prefill-0"):
        self.engine = engine
        self.sender = sender
        self.actor_id = actor_id
        self._pending: dict[str, _Pending] = {}      # request_id -> job, until its result is out
        self._sending: dict[str, _Pending] = {}      # request_id -> job whose KV is on the wire
        self.loop = EngineLoop(f"{actor_id}-loop", self._step)

    # ---- called from any thread ----------------------------------------
    def start(self) -> None:
        self.loop.start()

    def stop(self) -> None:
        self.loop.stop()
        self.sender.close()

    def submit(self, job: wpb.PrefillJob, on_done: Callable[[wpb.PrefillResult], None]) -> None:
        pending = _Pending(job, on_done, time.monotonic())     # received: the timeline's prefill queue starts
        self.loop.call(lambda: self._admit(pending))

    def abort(self, request_id: str) -> None:
        self.loop.call(lambda: self._abort(request_id))

    # ---- loop thread ----------------------------------------------------
    def _admit(self, p: _Pending) -> None:
        job = p.job
        try:
            params = SamplingParams.from_proto(job.params)
            most = (len(job.prompt_token_ids) - 1) // self.engine.block_size
            if job.skip_blocks > most:
                raise ValueError(f"skip_blocks: {job.skip_blocks} > {most}, the most a prompt of "
                                 f"{len(job.prompt_token_ids)} tokens may skip (its last token's block is shipped)")
            self.engine.add_request(list(job.prompt_token_ids), params, request_id=job.request_id,
                                    prefill_only=True)
        except ValueError as e:          # the request itself is bad: another actor would refuse it too
            p.on_done(wpb.PrefillResult(request_id=job.request_id, transfer_id=job.transfer_id,
                                        status=wpb.PREFILL_STATUS_FAILED, error=str(e),
                                        failed_side=wpb.TRANSFER_SIDE_SENDER, retryable=False))
            return
        self._pending[job.request_id] = p

    def _abort(self, request_id: str) -> None:
        p = self._pending.pop(request_id, None)
        if p is None:
            return
        if request_id in self._sending:          # blocks are released when the send ends
            return
        self.engine.abort(request_id)
        p.on_done(wpb.PrefillResult(request_id=request_id, transfer_id=p.job.transfer_id,
                                    status=wpb.PREFILL_STATUS_ABORTED))

    def _step(self) -> float:
        firsts: dict[str, list[RequestOutput]] = {}      # request_id -> its sequences' first tokens
        for out in self.engine.step():           # schedule → run
            if out.request_id in self._pending:
                firsts.setdefault(out.request_id, []).append(out)
        for rid, outs in firsts.items():
            self._send_kv(self._pending[rid], sorted(outs, key=lambda o: o.index))
        self._reap_sends()
        return 0.0 if self.engine.has_unfinished() else IDLE_WAIT_S

    def _send_kv(self, p: _Pending, outs: list[RequestOutput]) -> None:
        """Every sequence's first token is sampled: ship the prompt's KV with them (the handoff), or
        report a request whose every sequence ended at its first token."""
        done = time.monotonic()
        head = outs[0]
        scheduled = head.first_scheduled_time or done
        run_done = min(max(self.engine.last_run_done, scheduled), done)
        firsts = [output_event(out) for out in outs]
        stages = wpb.ActorStages(queue_s=scheduled - p.submitted, compute_s=run_done - scheduled,
                                 sampling_s=done - run_done)
        result = wpb.PrefillResult(request_id=head.request_id, transfer_id=p.job.transfer_id,
                                   status=wpb.PREFILL_STATUS_SENT, first_tokens=firsts,
                                   num_prompt_tokens=head.num_prompt_tokens, num_cached_tokens=head.num_cached_tokens,
                                   queue_s=scheduled - p.submitted, prefill_s=done - scheduled, stages=stages)
        if head.prompt_logprobs:
            result.prompt_logprobs.extend(head.prompt_logprobs)
            del firsts[0].prompt_logprobs[:]     # the router has them from the result
        if all(out.finish_reason for out in outs):      # nothing to ship
            result.status = wpb.PREFILL_STATUS_FINISHED
            del self._pending[head.request_id]
            p.on_done(result)
            return
        skip = p.job.skip_blocks                 # the decode actor holds (pinned) the prompt's first blocks
        block_ids = next(out.block_ids for out in outs if out.prefilled)[skip:]
        cache = self.engine.kv_cache
        result.kv_bytes = len(block_ids) * cache[:, 0].numel() * cache.element_size()
        result.num_skipped_blocks = skip
        p.result, p.sampled = result, done
        handoff = wpb.Handoff(first_tokens=firsts, num_skipped_blocks=skip).SerializeToString()
        p.handle = self.sender.send(head.request_id, cache, block_ids, p.job.kv_endpoint,
                                    transfer_id=p.job.transfer_id, deadline_s=p.job.transfer_deadline_s,
                                    num_tokens=head.num_prompt_tokens, first_token_id=head.new_token_ids[0],
                                    handoff=handoff)
        self._sending[head.request_id] = p
        p.handle.add_done_callback(lambda _handle: self.loop.wake())     # reaped at once, never polled

    def _reap_sends(self) -> None:
        for rid, p in list(self._sending.items()):
            if not p.handle.done():
                continue
            del self._sending[rid]
            self.engine.release(rid)
            result = p.result
            result.transfer_s = p.handle.elapsed_s
            result.wire_bytes = p.handle.wire_bytes
            _send_stages(result.stages, p.handle, p.sampled)
            if p.handle.status is not TransferStatus.DONE:
                result.status = wpb.PREFILL_STATUS_FAILED
                result.error = p.handle.error or p.handle.status.value
                result.failed_side = TRANSFER_SIDE.get(p.handle.failed_side, wpb.TRANSFER_SIDE_UNSPECIFIED)
                result.retryable = True          # the transfer, not the request, failed
                log.warning("KV transfer %s of %s failed (%s side): %s", p.job.transfer_id, rid,
                            p.handle.failed_side.value, result.error)
            if self._pending.pop(rid, None) is None:
                result.status = wpb.PREFILL_STATUS_ABORTED
            p.on_done(result)

    # ---- load report ----------------------------------------------------
    def stats(self) -> dict:
        bm = self.engine.block_manager
        sched = self.engine.scheduler
        return {"actor_id": self.actor_id, "role": "prefill", "kv_blocks_total": bm.num_blocks,
                "kv_blocks_used": bm.num_used_blocks, "queued_requests": len(sched.waiting),
                "running_requests": len(sched.running) + len(self._sending)}


def _send_stages(stages: wpb.ActorStages, handle: SendHandle, sampled: float) -> None:
    """The KV send's stages from the handle's stamps (`sampled`: when the first token was)."""
    if not handle.chunk_at:              # failed before a chunk was ready
        return
    first, last = handle.chunk_at[0], handle.chunk_at[-1]
    stages.kv_encode_s = first - sampled
    stages.kv_send_s = last - first
    stages.kv_chunks = len(handle.chunk_at)
    stages.kv_chunk_s.extend(t - sampled for t in handle.chunk_at)
    stages.kv_send_total_s = handle.elapsed_s
