"""The router's protocol for talking to worker actors (deploy implements it with Ray; tests fake it).

Every message is a `pdserve.v1` worker message (proto/pdserve/v1/worker.proto, kv_events.proto):

    PrefillClient.prefill(PrefillJob) -> PrefillResult     prefill, ship the KV, report
    DecodeClient.open_stream(DecodeJob) -> DecodeStream    decode; tokens stream back
    DecodeClient.cached_prefix(PrefixQuery) -> PrefixHits  leading prompt blocks its prefix cache holds
    ActorClient.abort(request_id)                          fire and forget; idempotent
    ActorClient.info() -> dict                             liveness and identity
    ActorClient.stats() -> ActorStats                      load, for GetStats and metrics
    ActorClient.kv_events(KVEventsRequest) -> KVEventsResponse   prefix-cache events since the ack

A call whose actor is gone (dead, restarting, unreachable) raises `ActorUnavailable`;
the dispatcher then retries on another prefill actor or migrates the decode.
"""
from __future__ import annotations

from typing import Protocol

from proto.pdserve.v1 import kv_events_pb2 as kpb, worker_pb2 as wpb
from router.backend import ActorStats


class ActorUnavailable(Exception):
    """The actor did not answer: it died, is restarting, or cannot be reached."""


class ActorClient(Protocol):
    actor_id: str

    def abort(self, request_id: str) -> None:
        """Drop the request on the actor (no reply; unknown ids are ignored)."""

    async def info(self) -> dict:
        """Identity of a live actor; raises ActorUnavailable when it does not answer."""

    async def stats(self) -> ActorStats:
        """Current load; raises ActorUnavailable when it does not answer."""

    async def kv_events(self, request: kpb.KVEventsRequest) -> kpb.KVEventsResponse:
        """The actor's prefix-cache event batches after `request.acked_seq` (or a snapshot when
        `request.snapshot`), from its engine's `engine.kv_cache.events.KVEventLog`; raises ActorUnavailable
        when it does not answer."""


class PrefillClient(ActorClient, Protocol):
    async def prefill(self, job: wpb.PrefillJob) -> wpb.PrefillResult:
        """Prefill `job.prompt_token_ids` and ship the KV to `job.kv_endpoint`.

        Returns the result once the KV reached the decode actor (or the request ended at
        its first token, or failed). Cancelling the call aborts the request on the actor.
        """


class DecodeStream(Protocol):
    async def read(self) -> list[wpb.DecodeEvent] | None:
        """The events produced since the last read; None when the stream ended.
        Raises ActorUnavailable when the actor is lost mid-stream."""

    def cancel(self) -> None:
        """Close the stream; the actor aborts the request if it has not finished."""


class DecodeClient(ActorClient, Protocol):
    def open_stream(self, job: wpb.DecodeJob) -> DecodeStream:
        """Start `job` on the actor (it waits for the job's KV, or prefills it there)."""

    async def cached_prefix(self, query: wpb.PrefixQuery) -> wpb.PrefixHits:
        """How many leading blocks of `query.block_hashes` the actor's prefix cache holds now
        (an answer, not a reservation); raises ActorUnavailable when it does not answer."""
