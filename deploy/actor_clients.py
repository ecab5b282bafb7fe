"""The router's actor protocol (`router.actor_protocol`) over Ray actor handles.

Prefill jobs travel as serialized `PrefillJob` bytes in a Ray call; decode jobs
open a gRPC stream (`DecodeStreamService.Decode`) on the decode actor, which
streams tokens with far less delay than a Ray generator. Ray and gRPC errors
become `ActorUnavailable`, so the router never sees either.
"""
from __future__ import annotations

import grpc
import ray

from decode_worker.stream_service import DecodeStreamClient
from proto.pdserve.v1 import kv_events_pb2 as kpb, worker_pb2 as wpb
from router.actor_protocol import ActorUnavailable
from router.backend import ActorStats


class RayActorClient:
    """What every pool's actor answers: abort, info, stats, kv_events."""

    def __init__(self, actor_id: str, handle):
        self.actor_id = actor_id
        self.handle = handle

    def abort(self, request_id: str) -> None:
        self.handle.abort.remote(request_id)

    async def retire(self) -> None:
        """The actor left the pool (replaced or removed): drop what the router holds for it."""

    async def _call(self, method: str, *args):
        """`handle.<method>.remote(*args)`, a Ray error raised as `ActorUnavailable`."""
        try:
            return await getattr(self.handle, method).remote(*args)
        except ray.exceptions.RayError as e:
            raise ActorUnavailable(f"{self.actor_id}: {e}") from None

    async def info(self) -> dict:
        return await self._call("info")

    async def stats(self) -> ActorStats:
        return ActorStats.from_report(await self._call("stats"))

    async def kv_events(self, request: kpb.KVEventsRequest) -> kpb.KVEventsResponse:
        return kpb.KVEventsResponse.FromString(await self._call("kv_events", request.SerializeToString()))


class RayPrefillClient(RayActorClient):
    async def prefill(self, job: wpb.PrefillJob) -> wpb.PrefillResult:
        return wpb.PrefillResult.FromString(await self._call("prefill", job.SerializeToString()))


class GrpcDecodeStream:
    """One request's `Decode` call."""

    def __init__(self, actor_id: str, call: grpc.aio.UnaryStreamCall):
        self.actor_id, self._call = actor_id, call

    async def read(self) -> list[wpb.DecodeEvent] | None:
        try:
            response = await self._call.read()
        except grpc.aio.AioRpcError as e:
            raise ActorUnavailable(f"{e.code().name} {e.details()}") from None
        return None if response is grpc.aio.EOF else list(response.events)

    def cancel(self) -> None:
        self._call.cancel()


class RayDecodeClient(RayActorClient):
    """A decode (or colocated) actor: Ray for control, its gRPC stream endpoint for tokens."""

    def __init__(self, actor_id: str, handle, stream_endpoint: str, streams: DecodeStreamClient):
        super().__init__(actor_id, handle)
        self.stream_endpoint = stream_endpoint       # the pool manager updates it when Ray restarts the actor
        self.streams = streams

    async def moved(self, stream_endpoint: str) -> None:
        """Ray restarted the actor: its token stream is served elsewhere now."""
        old, self.stream_endpoint = self.stream_endpoint, stream_endpoint
        if old != stream_endpoint:
            await self.streams.forget(old)

    async def retire(self) -> None:
        await self.streams.forget(self.stream_endpoint)

    def open_stream(self, job: wpb.DecodeJob) -> GrpcDecodeStream:
        return GrpcDecodeStream(self.actor_id, self.streams.open(self.stream_endpoint, job))

    async def cached_prefix(self, query: wpb.PrefixQuery) -> wpb.PrefixHits:
        return wpb.PrefixHits.FromString(await self._call("cached_prefix", query.SerializeToString()))
