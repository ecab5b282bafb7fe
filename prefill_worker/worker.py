"""Prefill worker: batched, chunked prefill that ships each request's KV to a decode actor.

Lifecycle of one request on this worker (each loop step: schedule → run → send KV):

    submit(PrefillJob) ──► engine queue (WAITING) ──schedule/run──► each sequence's first token sampled
    (PREFILLED, blocks held)
    ──► sender.send(KVPiece(kv_cache[:, blocks[job.skip_blocks:]] + Handoff), job.kv_endpoint)
    ──► handle DONE/FAILED ──► engine.release (blocks stay in the prefix cache)
    ──► on_done(PrefillResult)

Layer-wise streaming (``layerwise``, the default): the send starts during the forward pass.
The engine's layer hook (engine/runner/layer_hook.py) names, after each layer, the blocks of every
request in the step that became final for that layer (each chunk's full blocks; the prompt's
tail at its last chunk); each becomes one piece, ``send(layers=(l, l + 1), blocks=...)``,
encoded and sent on the sender's threads while layer l + 1 computes. A stream keeps, per
layer, how far along the request's block list it has sent (a clean loop over that list: a
piece starts where the last one of its layer ended). The last layer's last block is held
back: it goes out once the first tokens are sampled, with the Handoff, so the receiver
reports DONE only when every cell and the first tokens arrived. Each piece pins the blocks
it reads (a reference of the stream's own, dropped when the request's pieces all ended), so
a preempted or aborted request's blocks are not reused under a piece in flight; a request
recomputed after preemption into other blocks is sent again from its first block. A failed
piece fails the transfer (the receiver frees what it reserved): the request's prefill stops
and it reports FAILED (retryable) once its pieces ended. A request with max_tokens 1
(nothing to decode) is not streamed.

With n > 1 (best_of) the prompt is prefilled once and its KV shipped once; the
handoff carries every sequence's first token (with its logprobs), and the
decode actor forks the sequences over the blocks it received. Prompt logprobs
go back to the router in the PrefillResult. A request whose every sequence
finishes at its first token (EOS, max_tokens == 1) is reported without a
transfer (a streamed one completes its transfer, whose handoff says so: the decode
side frees it). `job.skip_blocks` leading prompt blocks are never shipped, streamed
or not: the decode actor holds them in its own prefix cache (it pinned them).
abort() drops the request wherever it is; pieces in flight complete or fail on
their own and its blocks are released then. ``transfer_s`` is the send's time
after the first tokens were sampled (what the handoff adds to the TTFT).
"""
from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from engine import Engine, SamplingParams
from engine.output.events import output_event
from engine.runner.layer_hook import LayerDone
from engine.scheduling.loop import EngineLoop, on_event_loop
from engine.scheduling.request import RequestOutput
from kv_transfer import FailedSide, KVPiece, KVSender, SendHandle, TransferStatus
from proto.pdserve.v1 import worker_pb2 as wpb

log = logging.getLogger(f"pdserve.{__name__}")

IDLE_WAIT_S = 0.05      # nothing to do: sleep until a command or a finished send wakes the loop (or this long)

TRANSFER_SIDE = {FailedSide.SENDER: wpb.TRANSFER_SIDE_SENDER, FailedSide.RECEIVER: wpb.TRANSFER_SIDE_RECEIVER,
                 FailedSide.TRANSPORT: wpb.TRANSFER_SIDE_TRANSPORT}


@dataclass(slots=True)
class _Stream:
    """A request's KV going out piece by piece while it is prefilled."""

    deadline_at: float                   # time.monotonic(): the whole transfer's deadline, from its first piece
    sent: list[int]                      # per layer: entries [0, sent[l]) of the block list handed to the sender
    table: list[int] = field(default_factory=list)    # the block ids those entries held (a recompute may move them)
    pinned: list[int] = field(default_factory=list)   # block ids the stream holds a reference on


@dataclass(slots=True)
class _Pending:
    job: wpb.PrefillJob
    on_done: Callable[[wpb.PrefillResult], None]
    submitted: float
    handles: list[SendHandle] = field(default_factory=list)
    done_at: list[float] = field(default_factory=list)    # time.monotonic() as each handle ended
    stream: _Stream | None = None
    result: wpb.PrefillResult | None = None
    sampled: float = 0.0                 # its first tokens were sampled (the handoff's send starts)

    def failed(self) -> SendHandle | None:
        return next((h for h in self.handles if h.done() and h.status is not TransferStatus.DONE), None)

    def all_done(self) -> bool:
        return all(h.done() for h in self.handles)


class PrefillWorker:
    """Plain class (unit-testable without Ray); `deploy.actor.ServingActor` wraps it."""

    def __init__(self, engine: Engine, sender: KVSender, actor_id: str = "prefill-0", layerwise: bool = True):
        self.engine = engine
        self.sender = sender
        self.actor_id = actor_id
        self.layerwise = layerwise
        self._pending: dict[str, _Pending] = {}      # request_id -> job, until its result is out
        self._sending: dict[str, _Pending] = {}      # request_id -> job whose KV is on the wire (no more compute)
        self._streaming: dict[str, _Pending] = {}    # request_id -> job being prefilled and streamed
        self.loop = EngineLoop(f"{actor_id}-loop", self._step)
        if layerwise:
            engine.layer_hook = self._on_layer

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

    async def prefill(self, job: wpb.PrefillJob, observe: Callable[[wpb.PrefillResult], None] | None = None,
                      bridge: Callable[[Callable], Callable] | None = None) -> wpb.PrefillResult:
        """`submit` from an event loop and await the result; a cancelled caller aborts the job.
        `observe` (on the caller's loop) sees every result, also one that lands after a cancel.
        `bridge(fn)`: how the loop thread's result reaches the caller (default: `on_event_loop`)."""
        fut = asyncio.get_running_loop().create_future()
        bridge = bridge or functools.partial(on_event_loop, fut.get_loop())

        def done(result: wpb.PrefillResult) -> None:
            if observe is not None:
                observe(result)
            if not fut.done():
                fut.set_result(result)
        self.submit(job, bridge(done))
        try:
            return await fut
        except asyncio.CancelledError:
            self.abort(job.request_id)
            raise

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
        if self.layerwise and params.max_tokens > 1:
            self._streaming[job.request_id] = p

    def _abort(self, request_id: str) -> None:
        p = self._pending.pop(request_id, None)
        if p is None:
            return
        if request_id in self._sending:          # blocks are released when the send ends
            return
        self.engine.abort(request_id)
        if self._streaming.pop(request_id, None) is not None and p.handles:
            self._sending[request_id] = p        # pieces in flight: reported (aborted) once they end
            return
        p.on_done(wpb.PrefillResult(request_id=request_id, transfer_id=p.job.transfer_id,
                                    status=wpb.PREFILL_STATUS_ABORTED))

    def _step(self) -> float:
        firsts: dict[str, list[RequestOutput]] = {}      # request_id -> its sequences' first tokens
        for out in self.engine.step():           # schedule → run (→ pieces streamed per layer)
            if out.request_id in self._pending:
                firsts.setdefault(out.request_id, []).append(out)
        for rid, outs in firsts.items():
            self._send_kv(self._pending[rid], sorted(outs, key=lambda o: o.index))
        self._stop_failed_streams()
        self._reap_sends()
        return 0.0 if self.engine.has_unfinished() else IDLE_WAIT_S

    def _on_layer(self, done: LayerDone) -> None:
        """Layer `done.layer` of this step is written: send each streamed request's newly final blocks."""
        num_layers = self.engine.config.num_hidden_layers
        for final in done.blocks:
            req = final.request
            p = self._streaming.get(req.request_id)
            if p is None or p.failed() is not None:
                continue
            s, skip = p.stream, p.job.skip_blocks    # blocks [0, skip): the decode actor holds them
            if s is None:
                s = p.stream = _Stream(time.monotonic() + p.job.transfer_deadline_s, [skip] * num_layers)
            if done.layer == 0:
                table = req.block_table
                if table[:len(s.table)] != s.table:      # recomputed (after a preemption) into other blocks
                    s.sent = [skip] * num_layers
                s.table = table[:final.end_block]
            end = final.end_block
            if final.prompt_done and done.layer == num_layers - 1:
                end -= 1                         # the last cell goes with the handoff
            start = s.sent[done.layer]
            if end <= start:
                continue
            if done.layer == 0:
                self.engine.block_manager.share(s.table[start:end])
                s.pinned.extend(s.table[start:end])
            self._send_piece(p, (done.layer, done.layer + 1), (start, end), done.ready)
            s.sent[done.layer] = end

    def _send_piece(self, p: _Pending, layers: tuple[int, int], blocks: tuple[int, int], ready=None,
                    first_token_id: int = -1, handoff: bytes = b"") -> None:
        """`blocks`: a range of the prompt's block list; the transfer's list starts after the skipped blocks."""
        num_tokens, skip = len(p.job.prompt_token_ids), p.job.skip_blocks
        num_blocks = -(-num_tokens // self.engine.block_size) - skip
        # the transfer's whole block list (the stream's table covers every entry a piece of this step
        # reads); entries past those computed so far are placeholders this piece never reads
        table = p.stream.table[skip:]
        block_ids = table + table[-1:] * (num_blocks - len(table))
        piece = KVPiece(p.job.request_id, self.engine.kv_cache, block_ids, transfer_id=p.job.transfer_id,
                        layers=layers, blocks=(blocks[0] - skip, blocks[1] - skip),
                        deadline_s=max(p.stream.deadline_at - time.monotonic(), 1e-3),
                        num_tokens=num_tokens, first_token_id=first_token_id, handoff=handoff, ready=ready)
        handle = self.sender.send(piece, p.job.kv_endpoint)
        self._watch(p, handle)

    def _watch(self, p: _Pending, handle: SendHandle) -> None:
        p.handles.append(handle)

        def ended(_handle: SendHandle) -> None:
            p.done_at.append(time.monotonic())
            self.loop.wake()                     # reaped at once, never polled
        handle.add_done_callback(ended)

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
        streamed = self._streaming.pop(head.request_id, None) is not None and p.stream is not None
        if all(out.finish_reason for out in outs) and not streamed:      # nothing to ship
            result.status = wpb.PREFILL_STATUS_FINISHED
            del self._pending[head.request_id]
            p.on_done(result)
            return
        skip = p.job.skip_blocks                 # the decode actor holds (pinned) the prompt's first blocks
        if all(out.finish_reason for out in outs):
            result.status = wpb.PREFILL_STATUS_FINISHED     # its transfer ends all the same (see the docstring)
            block_ids = p.stream.table[skip:]    # the engine dropped the request; the stream pins its blocks
        else:
            block_ids = next(out.block_ids for out in outs if out.prefilled)[skip:]
        cache = self.engine.kv_cache
        result.kv_bytes = len(block_ids) * self.engine.kv_bytes_per_block
        result.num_skipped_blocks = skip
        p.result, p.sampled = result, done
        handoff = wpb.Handoff(first_tokens=firsts, num_skipped_blocks=skip).SerializeToString()
        self._sending[head.request_id] = p
        if not streamed:
            piece = KVPiece(head.request_id, cache, block_ids, transfer_id=p.job.transfer_id,
                            deadline_s=p.job.transfer_deadline_s, num_tokens=head.num_prompt_tokens,
                            first_token_id=head.new_token_ids[0], handoff=handoff)
            handle = self.sender.send(piece, p.job.kv_endpoint)
            self._watch(p, handle)
            return
        if p.failed() is not None:               # the transfer failed already: reported once its pieces end
            return
        s = p.stream
        block_ids, num_blocks = s.table, len(s.table)
        for layer, start in enumerate(s.sent):   # what the stream has not sent: the last layer's last block
            if start < num_blocks:
                if layer == 0:
                    self.engine.block_manager.share(block_ids[start:])
                    s.pinned.extend(block_ids[start:])
                self._send_piece(p, (layer, layer + 1), (start, num_blocks), first_token_id=head.new_token_ids[0],
                                 handoff=handoff)
                s.sent[layer] = num_blocks

    def _stop_failed_streams(self) -> None:
        """A piece failed: the transfer is lost, so stop prefilling the request (reported once its pieces end)."""
        for rid, p in list(self._streaming.items()):
            if p.failed() is not None:
                del self._streaming[rid]
                self.engine.abort(rid)
                self._sending[rid] = p

    def _reap_sends(self) -> None:
        for rid, p in list(self._sending.items()):
            if not p.all_done():
                continue
            del self._sending[rid]
            self.engine.release(rid)
            if p.stream is not None:
                self.engine.block_manager.free(p.stream.pinned)
                p.stream.pinned = []
            result = p.result or wpb.PrefillResult(request_id=rid, transfer_id=p.job.transfer_id)
            result.wire_bytes = sum(h.wire_bytes for h in p.handles)
            if p.sampled:
                result.transfer_s = max(max(p.done_at) - p.sampled, 0.0)
                _send_stages(result.stages, p.handles, p.sampled, max(p.done_at))
            failed = p.failed()
            if failed is not None:
                result.status = wpb.PREFILL_STATUS_FAILED
                result.error = failed.error or failed.status.value
                result.failed_side = TRANSFER_SIDE.get(failed.failed_side, wpb.TRANSFER_SIDE_UNSPECIFIED)
                result.retryable = True          # the transfer, not the request, failed
                log.warning("KV transfer %s of %s failed (%s side): %s", p.job.transfer_id, rid,
                            failed.failed_side.value, result.error)
            if self._pending.pop(rid, None) is None:
                result.status = wpb.PREFILL_STATUS_ABORTED
            p.on_done(result)

    # ---- load report ----------------------------------------------------
    def stats(self) -> dict:
        bm = self.engine.block_manager
        sched = self.engine.scheduler
        return {"actor_id": self.actor_id, "role": "prefill", "kv_blocks_total": bm.num_blocks,
                "kv_blocks_used": bm.num_used_blocks, "queued_requests": len(sched.waiting),
                "running_requests": len(sched.running) + len(self._sending), "kv_tiers": self.engine.tier_stats()}


def _send_stages(stages: wpb.ActorStages, handles: list[SendHandle], sampled: float, done: float) -> None:
    """The KV send's stages from the handles' stamps (`sampled`: when the first tokens were; `done`: the
    last handle ended). Chunks streamed during prefill stamp before `sampled` (negative kv_chunk_s);
    kv_encode_s and kv_send_s cover the chunks after it, the handoff's."""
    chunk_at = sorted(t for h in handles for t in h.chunk_at)
    if not chunk_at:                     # failed before a chunk was ready
        return
    after = [t for t in chunk_at if t >= sampled] or chunk_at[-1:]
    stages.kv_encode_s = max(after[0] - sampled, 0.0)
    stages.kv_send_s = max(after[-1] - max(after[0], sampled), 0.0)
    stages.kv_chunks = len(chunk_at)
    stages.kv_chunk_s.extend(t - sampled for t in chunk_at)
    stages.kv_send_total_s = max(done - sampled, 0.0)
