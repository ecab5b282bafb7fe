"""Decode worker: adopts KV blocks written by the receiver and decodes with continuous batching.

Lifecycle of one request on this worker (each loop step: receive KV → schedule → run → stream):

    submit(DecodeJob with transfer_id) ─► engine request WAITING_FOR_KV (validated now); with
        num_cached_blocks it pins that many leading prompt blocks from this actor's own prefix cache
        (the prefill actor skips them; fewer still cached: retryable error, the router asks again)
        receiver DONE  ─► engine.adopt(pinned + received blocks, each sequence's first token from the
        handoff) ─► n sequences share the prompt's blocks and join the running batch
        receiver FAILED/EXPIRED (the transfer's own deadline runs from its first chunk), or no
        transfer begun by the request's kv_deadline ─► retryable error event (the router prefills again)
    running ─► one event per step with new tokens ─► finish (stop/length) or abort
        ─► the engine frees every block the request held (its full blocks, prompt and output,
        stay in the prefix cache, LRU: a later turn of the conversation pins them)

A job without a transfer_id is prefilled here (conditional disaggregation, migration), through
the colocated worker's local-prefill path (`prefill_locally`). KV that arrives for a
request nobody waits for (aborted, or not yet registered) is parked for
`orphan_lease_s` and then freed: no block outlives its request. An unclaimed transfer whose
handoff says every sequence ended at its first token (streamed layer by layer before the
prefill actor knew) is freed at once.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

import grpc
from google.protobuf.message import DecodeError

from decode_worker.colocated import prefill_locally
from decode_worker.streams import Stream, TokenStreams, error_event, worker_stats
from engine import Engine, SamplingParams
from engine.engine import CachedPrefixLost
from engine.scheduling.loop import EngineLoop
from kv_transfer import KVReceiver, TransferResult, TransferStatus
from kv_transfer.codec import get_codec
from proto.pdserve.v1 import worker_pb2 as wpb

log = logging.getLogger(f"pdserve.{__name__}")


class DecodeWorker:
    """Plain class (unit-testable without Ray); `deploy.actor.ServingActor` wraps it."""

    role = "decode"

    def __init__(self, engine: Engine, make_receiver: Callable[[Callable], KVReceiver],
                 actor_id: str = "decode-0", orphan_lease_s: float = 10.0):
        """make_receiver(on_complete) builds the KV receiver; its completions wake the loop."""
        self.engine = engine
        self.actor_id = actor_id
        self.streams = TokenStreams(engine, actor_id, drop=self._drop)
        self.loop = EngineLoop(f"{actor_id}-loop", self._step)
        self.orphan_lease_s = orphan_lease_s
        self._waiting_kv: dict[str, str] = {}                     # transfer_id -> request_id
        self._orphans: dict[str, tuple[TransferResult, float]] = {}   # transfer_id -> (DONE result, parked at)
        self.receiver = make_receiver(lambda _result: self.loop.wake())
        codec = get_codec(self.receiver.codec)
        if codec.lossy:       # a recomputed prompt goes through the codec its KV first came through
            kv_cache = engine.kv_cache
            engine.prompt_kv_roundtrip = lambda index: codec.roundtrip(kv_cache, index)

    @property
    def endpoint(self) -> str:
        return self.receiver.endpoint

    # ---- called from any thread ----------------------------------------
    def start(self) -> None:
        self.loop.start()

    def submit(self, job: wpb.DecodeJob, emit: Callable[[wpb.DecodeEvent], None]) -> None:
        stream = Stream(job, emit, time.monotonic())      # received: the timeline's queue starts
        self.loop.call(lambda: self.streams.open(stream, self._accept))

    def abort(self, request_id: str) -> None:
        self.loop.call(lambda: self.streams.abort(request_id))

    def stats(self) -> dict:
        """The load report, and the KV connections its receiver refused, by reason."""
        received = self.receiver.stats
        return {**worker_stats(self.engine, self.actor_id, self.role, self.num_queued()), "refused_connections": {
            "bad_token": received.auth_failures, "bad_hello": received.bad_hellos,
            "handshake_mismatch": received.handshake_failures}}

    def cached_prefix(self, query: wpb.PrefixQuery) -> wpb.PrefixHits:
        """How many leading blocks of the query's prompt this actor's prefix cache holds (any thread)."""
        return wpb.PrefixHits(num_cached_blocks=self.engine.cached_prefix_blocks(list(query.block_hashes)))

    def stop(self) -> None:
        self.loop.stop()
        self.receiver.close()
        # The loop has stopped: no request can claim KV that arrived (parked, or not yet polled) now.
        done = [r for r in self.receiver.poll() if r.status is TransferStatus.DONE]
        for result in [r for r, _ in self._orphans.values()] + done:
            self.engine.block_manager.free(result.dst_block_ids)
        self._orphans.clear()

    # ---- loop thread ----------------------------------------------------
    def _accept(self, s: Stream, params: SamplingParams) -> None:
        job = s.job
        if not job.transfer_id:
            prefill_locally(self.engine, s, params)
            return
        if job.resume_output_ids:
            raise ValueError("resume_output_ids: a migrated request is prefilled here, not sent a transfer")
        try:
            self.engine.expect_kv(job.request_id, list(job.prompt_token_ids), params, job.transfer_id,
                                  s.registered + job.kv_timeout_s, num_cached_blocks=job.num_cached_blocks)
        except CachedPrefixLost as e:        # nothing is held; the router asks again and prefills again
            self.streams.forget(job.request_id)
            self.receiver.cancel(transfer_id=job.transfer_id)      # its chunks are refused, nothing reserved
            orphan = self._orphans.pop(job.transfer_id, None)      # (or it came first: its blocks go back now)
            if orphan is not None:
                self.engine.block_manager.free(orphan[0].dst_block_ids)
            s.emit(error_event(grpc.StatusCode.UNAVAILABLE, f"cached prefix lost: {e}", retryable=True))
            return
        self._waiting_kv[job.transfer_id] = job.request_id
        orphan = self._orphans.pop(job.transfer_id, None)
        if orphan is not None:
            self._on_transfer(orphan[0])

    def _drop(self, request_id: str) -> None:
        req = self.engine.requests.get(request_id)
        if req is not None and self._waiting_kv.pop(req.kv_transfer_id or "", None) is not None:
            self.receiver.cancel(transfer_id=req.kv_transfer_id)
        self.engine.abort(request_id)

    def evict(self, reason: str) -> int:
        """Loop thread: end every open request with a retryable error, so the router migrates it; returns
        how many. Used when the actor must give up its work (a role flip that ran out of time)."""
        return self.streams.evict(reason)

    def _step(self) -> float:
        self._receive_kv()                       # receive KV → schedule → run → stream
        return self.streams.step()

    def _receive_kv(self) -> None:
        for result in self.receiver.poll():
            try:
                self._on_transfer(result)
            except Exception:            # a bug must not drop the rest of the batch or strand its request
                log.exception("handling KV transfer %s failed", result.transfer_id)
                rid = self._waiting_kv.pop(result.transfer_id, None)
                if rid is not None:
                    self.streams.fail(rid, error_event(grpc.StatusCode.INTERNAL,
                                                       "KV handoff failed; see the actor log"))
        self._expire(time.monotonic())

    def _on_transfer(self, result: TransferResult) -> None:
        rid = self._waiting_kv.pop(result.transfer_id, None)
        if rid is None:
            if result.status is TransferStatus.DONE and _ends_at_first_token(result):
                self.engine.block_manager.free(result.dst_block_ids)      # nothing left to decode
            elif result.status is TransferStatus.DONE:      # nobody waits (yet): park under a lease
                self._orphans[result.transfer_id] = (result, time.monotonic())
            return
        if result.status is not TransferStatus.DONE:
            self.streams.fail(rid, error_event(grpc.StatusCode.UNAVAILABLE, f"KV transfer {result.transfer_id} "
                                        f"{result.status.value}: {result.error}", retryable=True))
            return
        try:
            req = self.engine.requests[rid]
            if result.num_tokens != req.num_prompt_tokens:
                raise ValueError(f"KV for {result.num_tokens} tokens, prompt has {req.num_prompt_tokens}")
            firsts, skipped = _first_tokens(result, req.params.num_sequences)
            if skipped != len(req.block_table):
                raise ValueError(f"the transfer skipped {skipped} prompt blocks; {len(req.block_table)} are "
                                 "pinned here")
            outs = self.engine.adopt(rid, [ev.token_ids[0] for ev in firsts], list(result.dst_block_ids),
                                     first_logprobs=[ev.logprobs[0] if ev.logprobs else None for ev in firsts])
        except Exception as e:               # whatever went wrong, the blocks go back and the request ends
            if not isinstance(e, ValueError):
                log.exception("adopting the KV of %s failed", rid)
            req = self.engine.requests.get(rid)
            owned = req is not None and set(result.dst_block_ids) <= set(req.block_table)
            if not owned:                    # else the request owns them: streams.fail frees them (and its pinned ones)
                self.engine.block_manager.free(result.dst_block_ids)
            self.streams.fail(rid, error_event(grpc.StatusCode.INTERNAL, f"cannot adopt KV: {e}"))
            return
        s = self.streams.get(rid)
        s.adopted = time.monotonic()
        s.stages = wpb.ActorStages(kv_receive_s=result.receive_tail_s, kv_receive_total_s=result.receive_s,
                                   adopt_s=max(s.adopted - result.done_at, 0.0) if result.done_at else 0.0)
        for out in outs:
            self.streams.stream(out)

    def _expire(self, now: float) -> None:
        for tid, rid in list(self._waiting_kv.items()):
            req = self.engine.requests[rid]
            if now > req.kv_deadline and self.receiver.status(tid) is None:    # begun: its own deadline rules
                timeout = self.streams.get(rid).job.kv_timeout_s
                self.streams.fail(rid, error_event(grpc.StatusCode.DEADLINE_EXCEEDED, f"KV transfer {tid} did not "
                                            f"begin within {timeout:.1f}s", retryable=True))
        for tid, (result, parked) in list(self._orphans.items()):
            if now - parked > self.orphan_lease_s:
                del self._orphans[tid]
                self.engine.block_manager.free(result.dst_block_ids)
                log.info("freed %d blocks of unclaimed transfer %s", len(result.dst_block_ids), tid)

    def num_queued(self) -> int:
        return len(self._waiting_kv) + self.engine.scheduler.num_queued


def _ends_at_first_token(result: TransferResult) -> bool:
    """The handoff says every sequence ended at its first token (a layer-wise stream began before the
    prefill actor knew): the router has the whole output from the prefill, nobody decodes it."""
    try:
        firsts = wpb.Handoff.FromString(result.handoff).first_tokens if result.handoff else []
    except DecodeError:
        return False
    return bool(firsts) and all(ev.finish_reason for ev in firsts)


def _first_tokens(result: TransferResult, num_sequences: int) -> tuple[list[wpb.DecodeEvent], int]:
    """Each sequence's first token, as the prefill actor sampled it (the transfer's handoff), and how
    many leading prompt blocks the transfer skipped; raises ValueError when the handoff does not hold
    one token per sequence."""
    skipped = 0
    if not result.handoff:
        firsts = [wpb.DecodeEvent(token_ids=[result.first_token_id])]
    else:
        try:
            handoff = wpb.Handoff.FromString(result.handoff)
        except DecodeError as e:
            raise ValueError(f"unreadable handoff: {e}") from None
        firsts, skipped = list(handoff.first_tokens), handoff.num_skipped_blocks
    if len(firsts) != num_sequences or any(len(ev.token_ids) != 1 for ev in firsts):
        raise ValueError(f"handoff holds {len(firsts)} first tokens for {num_sequences} sequences")
    return sorted(firsts, key=lambda ev: ev.index), skipped
