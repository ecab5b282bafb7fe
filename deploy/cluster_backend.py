"""`ClusterBackend`: the router's Backend over Ray prefill and decode actor pools.

One request, as dispatched here:

    admission (reserve KV blocks on a decode actor; wait in a bounded queue if none fits)
      → pick a prefill actor (longest cached prefix, then least queued prompt tokens)
      → decode.generate(job) stream opened first (the job waits for its KV), then
        prefill.prefill(job) ships the KV straight to that decode actor
      → decode events stream back as chunks; the prefill result adds timings
    A failed prefill or transfer is retried on another prefill actor (bounded);
    short uncached prompts (`local_prefill_tokens`) are prefilled by the decode
    actor itself. Cancellation aborts the request on both actors.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from dataclasses import dataclass

import grpc
import ray

from decode_worker.stream_service import DecodeStreamClient, events_from_wire
from decode_worker.worker import DecodeEvent, DecodeJob
from engine.block_manager import prompt_block_hashes
from prefill_worker.worker import PrefillJob, PrefillResult
from router.backend import ActorStats, Backend, BackendError, GenerationChunk, GenerationInput, Timing, Usage
from router.dispatch import AdmissionQueue, DecodeView, PrefillView, pick_prefill

log = logging.getLogger(f"pdserve.{__name__}")


@dataclass(slots=True)
class RoutingSettings:
    local_prefill_tokens: int = 0
    long_request_tokens: int | None = None
    max_queue: int = 1024
    max_attempts: int = 3
    transfer_deadline_s: float = 30.0
    stream_idle_s: float = 60.0          # no prefill result and no token for this long: the actor is stuck


class _Retry(Exception):
    """The prefill side failed; try again on another prefill actor."""

    def __init__(self, message: str, receiver_suspect: bool = False):
        super().__init__(message)
        self.receiver_suspect = receiver_suspect    # the transport failed: is the decode actor alive?


class _DecodeLost(Exception):
    """The decode actor died under the request; continue on another one."""


class ClusterBackend(Backend):
    def __init__(self, prefill: list[PrefillView], decode: list[DecodeView], tokenizer, max_model_len: int,
                 block_size: int, routing: RoutingSettings, long_decode: list[DecodeView] | None = None,
                 codec: str = "none", metrics=None, stream_token: str = ""):
        """metrics: None, or an object with kv_transfer(seconds, kv_bytes, wire_bytes, codec),
        transfer_failed(), local_prefill() and prefix_hit_tokens(n) (router.metrics.Metrics)."""
        self.prefill = prefill
        self.decode = decode
        self.long_decode = long_decode or []
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.routing = routing
        self.admission = AdmissionQueue(routing.max_queue)
        self.codec = codec
        self.metrics = metrics
        self.streams = DecodeStreamClient(stream_token)
        # finished requests for the autoscaler: (end, prompt_tokens, output_tokens, ttft_s, tpot_s)
        self.completed: deque[tuple[float, int, int, float, float]] = deque(maxlen=4096)

    async def ready(self) -> bool:
        return bool(self.decode) and all(v.healthy for v in self.decode)

    async def stats(self) -> list[ActorStats]:
        views = [*self.prefill, *self.decode, *self.long_decode]
        results = await asyncio.gather(*(v.handle.stats.remote() for v in views), return_exceptions=True)
        return [ActorStats(**r) for r in results if isinstance(r, dict)]

    def _decode_pool(self, total_tokens: int) -> list[DecodeView]:
        limit = self.routing.long_request_tokens
        if self.long_decode and limit is not None and total_tokens > limit:
            return self.long_decode
        return self.decode

    async def generate(self, inp: GenerationInput):
        start = time.monotonic()
        prompt = inp.prompt_token_ids
        total = len(prompt) + inp.params.max_tokens
        need = -(-total // self.block_size)
        pool = self._decode_pool(total)
        if not pool or need > max(v.kv_blocks_total for v in pool):
            raise BackendError("RESOURCE_EXHAUSTED", f"request needs {need} KV blocks ({total} tokens); "
                               f"the largest decode actor holds {max((v.kv_blocks_total for v in pool), default=0)}")
        view = await self._admit(pool, need, inp)
        hashes = prompt_block_hashes(prompt, self.block_size)
        timing = Timing(queue_s=time.monotonic() - start)
        excluded: set[str] = set()          # prefill actors that failed this request
        lost: set[str] = set()              # decode actors that died under it
        emitted: list[int] = []             # tokens the client already has
        failures = 0
        first: float | None = None          # when the first token went out (autoscaler stats)
        try:
            while True:
                try:
                    async for chunk in self._attempt(inp, view, hashes, timing, excluded, emitted, failures):
                        if chunk.token_ids and not emitted:
                            first = time.monotonic()
                        emitted.extend(chunk.token_ids)
                        yield chunk
                    self._record(start, first, len(prompt), len(emitted))
                    return
                except _Retry as e:
                    failures += 1
                    log.warning("request %s: prefill/transfer attempt %d failed: %s", inp.request_id, failures, e)
                    if e.receiver_suspect and not await self._alive(view):
                        dead = view.actor_id
                        view = await self._switch_decode(view, pool, need, lost, inp)
                        if view is None:
                            raise BackendError("UNAVAILABLE", f"decode actor {dead} is unreachable and no "
                                               "other decode actor can take the request") from None
                except _DecodeLost as e:
                    failures += 1
                    log.warning("request %s: decode actor lost after %d tokens (%s); migrating",
                                inp.request_id, len(emitted), e)
                    view = await self._switch_decode(view, pool, need, lost, inp)
                    if view is None:
                        raise BackendError("UNAVAILABLE", f"{e}; no other decode actor can take the "
                                           "request") from None
                if failures >= self.routing.max_attempts:
                    raise BackendError("UNAVAILABLE", f"request failed {failures} times (prefill, KV transfer or "
                                       "decode actor); giving up")
        finally:
            if view is not None:
                await self.admission.release(view, need)

    def _record(self, start: float, first: float | None, num_prompt: int, num_output: int) -> None:
        now = time.monotonic()
        first = first or now
        tpot = (now - first) / (num_output - 1) if num_output > 1 else 0.0
        self.completed.append((now, num_prompt, num_output, first - start, tpot))

    async def _alive(self, view: DecodeView, timeout: float = 2.0) -> bool:
        try:
            await asyncio.wait_for(view.handle.info.remote(), timeout)
            return True
        except Exception:
            return False

    async def _switch_decode(self, view: DecodeView, pool: list[DecodeView], need: int, lost: set[str],
                             inp: GenerationInput) -> DecodeView | None:
        """Move the request's KV reservation to another decode actor (the old one is gone); None if none can."""
        view.healthy = False             # the pool manager restores it once the actor is back
        lost.add(view.actor_id)
        await self.admission.release(view, need)
        timeout = 0.0 if inp.deadline is None else max(inp.deadline - time.monotonic(), 0.0)
        return await self.admission.acquire(pool, need, timeout, exclude=lost)

    async def _admit(self, pool: list[DecodeView], need: int, inp: GenerationInput) -> DecodeView:
        timeout = None if inp.deadline is None else max(inp.deadline - time.monotonic(), 0.0)
        view = await self.admission.acquire(pool, need, timeout)
        if view is None:
            raise BackendError("RESOURCE_EXHAUSTED", f"no decode actor has room for {need} KV blocks and "
                               f"the admission queue is full ({self.routing.max_queue}) or the deadline passed")
        return view

    async def _attempt(self, inp: GenerationInput, view: DecodeView, hashes: list[bytes], timing: Timing,
                       excluded: set[str], resume: list[int], attempt: int):
        """One try on one decode actor. `resume`: tokens already streamed (after a migration the
        new decode actor recomputes prompt + resume locally and continues).

        Each attempt has its own id on the actors, so a late abort of a failed attempt can
        never hit the retry that replaced it."""
        prompt = inp.prompt_token_ids
        rid = inp.request_id if attempt == 0 else f"{inp.request_id}#{attempt}"
        pview, cached = pick_prefill(self.prefill, hashes, excluded)
        uncached = len(prompt) - cached * self.block_size
        local = bool(resume) or pview is None or uncached < self.routing.local_prefill_tokens
        transfer_id = None if local else uuid.uuid4().hex
        deadline_s = self.routing.transfer_deadline_s
        if inp.deadline is not None:         # the client's deadline bounds every remote step
            deadline_s = max(min(deadline_s, inp.deadline - time.monotonic()), 0.05)
        djob = DecodeJob(rid, prompt, inp.params, transfer_id, 0, deadline_s, list(resume))
        call = self.streams.open(view.stream_endpoint, djob)
        pref_task = None
        if local and self.metrics:
            self.metrics.local_prefill()
        if not local:
            pview.queued_tokens += uncached
            pjob = PrefillJob(rid, prompt, inp.params, view.endpoint, transfer_id, deadline_s)
            pref_task = asyncio.ensure_future(self._prefill(pview, pjob, uncached))
        usage = Usage(len(prompt), len(resume), 0)
        finished = False
        events = call.__aiter__()
        next_task = asyncio.ensure_future(events.__anext__())
        try:
            while True:
                waiting = {next_task} | ({pref_task} if pref_task is not None else set())
                done, _ = await asyncio.wait(waiting, timeout=self.routing.stream_idle_s,
                                             return_when=asyncio.FIRST_COMPLETED)
                if not done:
                    if pref_task is not None:
                        raise _Retry(f"prefill actor {pview.actor_id} sent nothing for "
                                     f"{self.routing.stream_idle_s:.0f}s")
                    raise _DecodeLost(f"decode actor {view.actor_id} sent nothing for "
                                      f"{self.routing.stream_idle_s:.0f}s")
                if pref_task in done:
                    result: PrefillResult = pref_task.result()
                    pref_task = None
                    chunk = self._on_prefill(result, pview, hashes, timing, usage, view)
                    if chunk is not None:            # ended at its first token: no decode needed
                        finished = True
                        yield chunk
                        return
                if next_task in done:
                    try:
                        batch = events_from_wire(next_task.result())
                    except StopAsyncIteration:
                        raise BackendError("INTERNAL", f"decode stream of {rid} ended without a finish")
                    for ev in batch:
                        chunk = self._on_event(ev, timing, usage)
                        if chunk.finish_reason:
                            finished = True
                        yield chunk
                        if finished:
                            return
                    next_task = asyncio.ensure_future(events.__anext__())
        except grpc.aio.AioRpcError as e:
            raise _DecodeLost(f"decode actor {view.actor_id}: {e.code().name} {e.details()}") from None
        except _Retry:
            if not local and len(self.prefill) > len(excluded) + 1:
                excluded.add(pview.actor_id)       # try a different prefill actor next
            raise
        finally:
            next_task.cancel()
            call.cancel()
            if pref_task is not None:
                pref_task.cancel()
            if not finished:
                view.handle.abort.remote(rid)
                if not local:
                    pview.handle.abort.remote(rid)

    async def close(self) -> None:
        await self.streams.close()

    async def _prefill(self, pview: PrefillView, job: PrefillJob, uncached: int) -> PrefillResult:
        try:
            return await pview.handle.prefill.remote(job)
        except ray.exceptions.RayError as e:
            return PrefillResult(job.request_id, job.transfer_id, "failed", error=str(e), failed_side="sender")
        finally:
            pview.queued_tokens -= uncached

    def _on_prefill(self, result: PrefillResult, pview: PrefillView, hashes: list[bytes], timing: Timing,
                    usage: Usage, view: DecodeView) -> GenerationChunk | None:
        if result.status in ("failed", "aborted"):
            view.handle.abort.remote(result.request_id)
            if self.metrics and result.status == "failed":
                self.metrics.transfer_failed()
            raise _Retry(f"prefill actor {pview.actor_id}: {result.error or result.status}",
                         receiver_suspect=result.failed_side in ("transport", "receiver"))
        pview.remember(hashes)
        if self.metrics:
            self.metrics.prefix_hit_tokens(result.num_cached_tokens)
            if result.status == "sent":
                self.metrics.kv_transfer(result.transfer_s, result.kv_bytes, result.wire_bytes, self.codec)
        timing.queue_s += result.queue_s
        timing.prefill_s = result.prefill_s
        timing.kv_transfer_s = result.transfer_s
        usage.cached_prompt_tokens = result.num_cached_tokens
        if result.status == "finished":
            view.handle.abort.remote(result.request_id)
            usage.completion_tokens = 1
            text = self.tokenizer.decode([result.first_token_id])
            return GenerationChunk([result.first_token_id], text, result.finish_reason, usage, timing)
        return None

    def _on_event(self, ev: DecodeEvent, timing: Timing, usage: Usage) -> GenerationChunk:
        if ev.error_code:
            if ev.error_code in ("UNAVAILABLE", "DEADLINE_EXCEEDED") and "KV" in ev.error:
                raise _Retry(ev.error)
            raise BackendError(ev.error_code, ev.error)
        if ev.decode_queue_s:
            timing.decode_queue_s = ev.decode_queue_s
        usage.completion_tokens += len(ev.token_ids)
        if ev.finish_reason:
            if not usage.cached_prompt_tokens:
                usage.cached_prompt_tokens = ev.num_cached_tokens
            return GenerationChunk(ev.token_ids, ev.text, ev.finish_reason, usage, timing)
        return GenerationChunk(ev.token_ids, ev.text, None)

    def pool(self, name: str) -> list:
        return {"prefill": self.prefill, "decode": self.decode, "long_context": self.long_decode}[name]
