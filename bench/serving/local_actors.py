"""The router's actor protocol (router.actor_protocol) over plain workers in this process (no Ray).

A benchmark builds real prefill and decode workers over the in-process fake transport and hands
the router these clients: every call is what a Ray actor would answer, minus the Ray hop, and
the engines stay reachable for checks (an oracle of what they cache).
"""
from __future__ import annotations

import asyncio
import functools
from dataclasses import dataclass

from decode_worker.worker import DecodeWorker
from engine import Engine, EngineArgs
from engine.scheduling.loop import on_event_loop
from kv_transfer import FakeHub, layout_of, make_receiver, make_sender
from prefill_worker.worker import PrefillWorker
from proto.pdserve.v1 import generation_pb2, kv_events_pb2 as kpb, worker_pb2 as wpb
from router.backend import ActorStats
from router.pools import DecodeView, Pools, PrefillView


class LocalClient:
    """`bridge(fn)`: how a worker's callback reaches the caller's event loop (default: `on_event_loop`;
    the simulator holds them until the simulated step ends)."""

    def __init__(self, worker, bridge=None):
        self.worker = worker
        self.actor_id = worker.actor_id
        self.bridge = bridge

    def abort(self, request_id: str) -> None:
        self.worker.abort(request_id)

    async def info(self) -> dict:
        return {"actor_id": self.actor_id}

    async def stats(self) -> ActorStats:
        return ActorStats.from_report(self.worker.stats())

    async def kv_events(self, request: kpb.KVEventsRequest) -> kpb.KVEventsResponse:
        return self.worker.engine.kv_events.answer(request)


class LocalPrefillClient(LocalClient):
    def __init__(self, worker, bridge=None):
        super().__init__(worker, bridge)
        self.num_prompt_tokens = 0       # over every PrefillResult, as the engine reports it (also those
        self.num_cached_tokens = 0       # the router stopped waiting for: its decode stream finished first)

    def _count(self, result: wpb.PrefillResult) -> None:
        self.num_prompt_tokens += result.num_prompt_tokens
        self.num_cached_tokens += result.num_cached_tokens

    async def prefill(self, job: wpb.PrefillJob) -> wpb.PrefillResult:
        return await self.worker.prefill(job, observe=self._count, bridge=self.bridge)


class LocalDecodeStream:
    """The worker's events for one job, on the caller's event loop: a read takes every event that
    arrived since the last one (waiting for the first)."""

    def __init__(self, worker, job: wpb.DecodeJob, bridge=None):
        self.worker, self.job = worker, job
        self._arrived: list[wpb.DecodeEvent] = []
        self._waiter: asyncio.Future | None = None     # a read waiting for the next event
        self.open_sequences = job.params.best_of or job.params.n or 1
        self.ended = False
        bridge = bridge or functools.partial(on_event_loop, asyncio.get_running_loop())
        worker.submit(job, bridge(self._arrive))

    def _arrive(self, event: wpb.DecodeEvent) -> None:
        self._arrived.append(event)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def read(self) -> list[wpb.DecodeEvent] | None:
        if self.ended:
            return None
        while not self._arrived:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        events, self._arrived = self._arrived, []
        for ev in events:
            reason = ev.finish_reason
            if reason:
                self.open_sequences -= 1
                if reason == generation_pb2.FINISH_REASON_ABORT or self.open_sequences <= 0:
                    self.ended = True
            elif ev.error.code:
                self.ended = True
        return events

    def cancel(self) -> None:
        if not self.ended:
            self.ended = True
            self.worker.abort(self.job.request_id)


class LocalDecodeClient(LocalClient):
    def open_stream(self, job: wpb.DecodeJob) -> LocalDecodeStream:
        return LocalDecodeStream(self.worker, job, self.bridge)

    async def cached_prefix(self, query: wpb.PrefixQuery) -> wpb.PrefixHits:
        return self.worker.cached_prefix(query)


@dataclass
class LocalCluster:
    pools: Pools
    prefill: list[PrefillWorker]
    decode: list[DecodeWorker]

    @property
    def workers(self) -> list:
        return [*self.prefill, *self.decode]

    def stop(self) -> None:
        for w in self.workers:
            w.stop()


def start_local_cluster(model: str, num_prefill: int, num_decode: int, prefill_blocks: int, decode_blocks: int,
                        block_size: int = 16) -> LocalCluster:
    """Started workers (float32, eager attention) over one fake transport, and their pools."""
    hub = FakeHub()

    def engine(num_blocks: int) -> Engine:
        return Engine(EngineArgs(model, dtype="float32", num_blocks=num_blocks, block_size=block_size,
                                 attention="eager"))
    prefill, decode = [], []
    for i in range(num_prefill):
        e = engine(prefill_blocks)
        prefill.append(PrefillWorker(e, make_sender("fake", _layout(e), codec="none", hub=hub), f"prefill-{i}"))
    for i in range(num_decode):
        e = engine(decode_blocks)
        decode.append(DecodeWorker(e, lambda on_complete, e=e: make_receiver(
            "fake", _layout(e), e.kv_cache, e.block_manager, codec="none", hub=hub, on_complete=on_complete),
            f"decode-{i}"))
    for w in (*prefill, *decode):
        w.start()
    pools = Pools([PrefillView(w.actor_id, LocalPrefillClient(w), prefill_blocks) for w in prefill],
                  [DecodeView(w.actor_id, LocalDecodeClient(w), w.endpoint, decode_blocks) for w in decode])
    return LocalCluster(pools, prefill, decode)


def _layout(engine: Engine):
    return layout_of(engine.kv_cache, engine.fingerprint, engine.kv_format)
