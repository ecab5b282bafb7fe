"""`GenerationServicer`: the gRPC handlers of pdserve.v1.GenerationService over a `RequestCore`.

``Generate`` admits the request through the shared `router.request_core.RequestCore` and writes one
`GenerateResponse` per chunk; ``GetStats`` reports every actor's load (within `STATS_TIMEOUT_S`).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

import grpc

from proto.pdserve.v1 import generation_pb2 as pb
from router.backend import ActorStats, BackendError, GenerationChunk
from router.log import log_event
from router.request_core import THREAD_TOKENIZE_CHARS, AdmittedRequest, RequestCore
from router.validation import THREAD_TOKEN_IDS, RequestError, num_token_ids, validate_request

SERVICE_NAME = "pdserve.v1.GenerationService"
STATS_TIMEOUT_S = 3.0  # GetStats answers within this even when backend.stats() never returns


log = logging.getLogger("pdserve.router")


@dataclass(slots=True)
class UnparsableRequest:
    """Stands in for a request whose bytes did not parse (e.g. invalid UTF-8)."""

    error: str


def parse_generate_request(data: bytes) -> pb.GenerateRequest | UnparsableRequest:
    """Deserializer that turns a parse failure into INVALID_ARGUMENT, not INTERNAL."""
    return _parse(pb.GenerateRequest, data)


def parse_stats_request(data: bytes) -> pb.GetStatsRequest | UnparsableRequest:
    """Deserializer that turns a parse failure into INVALID_ARGUMENT, not UNKNOWN and a logged traceback."""
    return _parse(pb.GetStatsRequest, data)


def _parse(message_type, data: bytes):
    try:
        return message_type.FromString(data)
    except Exception as e:  # noqa: BLE001 — DecodeError and friends
        return UnparsableRequest(str(e) or type(e).__name__)


def tier_stats_message(tier: dict) -> pb.KVTierStats:
    """An actor's report of one tier (`KVTiers.stats`) as the public message."""
    return pb.KVTierStats(
        kind=tier["kind"], enabled=tier["enabled"], num_blocks=tier["num_blocks"], num_bytes=tier["num_bytes"],
        capacity_bytes=tier["capacity_bytes"], hit_rate=tier["hit_rate"], offload_bytes=tier["offload_bytes"],
        onboard_bytes=tier["onboard_bytes"], onboard_bytes_per_s=tier["onboard_bytes_per_s"],
        num_dropped_offloads=tier["num_dropped_offloads"], num_corrupt_blocks=tier["num_corrupt"])


class GenerationServicer:
    """Handlers for pdserve.v1.GenerationService over a `RequestCore`.

    Args:
        core: the `RequestCore` (shared with the HTTP front door).
    """

    def __init__(self, core: RequestCore) -> None:
        self.core = core
        self.stats_timeout_s = STATS_TIMEOUT_S
        self._stats_late = False  # the last backend.stats() timed out (logged once until it answers again)

    async def Generate(self, request: pb.GenerateRequest | UnparsableRequest,  # noqa: N802
                       context: grpc.aio.ServicerContext) -> None:
        received = time.monotonic()
        try:
            admitted = await self._admit(request, context, received)
        except RequestError as e:
            await context.abort(grpc.StatusCode[e.code], e.message)
        error: RequestError | None = None
        try:
            async with contextlib.aclosing(admitted.chunks()) as chunks:
                async for chunk in chunks:
                    await context.write(_response(admitted.inp.request_id, chunk))
        except RequestError as e:
            error = e
        finally:
            admitted.finish()
        if error is not None:
            await context.abort(grpc.StatusCode[error.code], error.message)

    async def GetStats(self, request: pb.GetStatsRequest | UnparsableRequest,  # noqa: N802
                       context: grpc.aio.ServicerContext) -> pb.GetStatsResponse:
        if isinstance(request, UnparsableRequest):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"request: not a valid GetStatsRequest ({request.error})")
        try:
            actors = await self._actor_stats()
        except BackendError as e:
            await context.abort(grpc.StatusCode[e.code], e.message)
        except Exception:  # noqa: BLE001
            log.exception("backend.stats() failed")
            await context.abort(grpc.StatusCode.INTERNAL, "could not collect stats; see the router log")
        response = pb.GetStatsResponse(router_in_flight_requests=self.core.num_in_flight)
        totals = response.totals
        for a in actors:
            role = a.role
            response.actors.add(
                actor_id=a.actor_id, role=role, kv_blocks_total=a.kv_blocks_total,
                kv_blocks_used=a.kv_blocks_used, queued_requests=a.queued_requests,
                running_requests=a.running_requests, kv_tiers=[tier_stats_message(t) for t in a.kv_tiers],
            )
            totals.num_prefill_actors += role == pb.ACTOR_ROLE_PREFILL
            totals.num_decode_actors += role == pb.ACTOR_ROLE_DECODE
            totals.num_colocated_actors += role == pb.ACTOR_ROLE_COLOCATED
            totals.kv_blocks_total += a.kv_blocks_total
            totals.kv_blocks_used += a.kv_blocks_used
            totals.queued_requests += a.queued_requests
            totals.running_requests += a.running_requests
        return response

    async def _actor_stats(self) -> list[ActorStats]:
        """``backend.stats()`` within `stats_timeout_s`; past it, no actor stats (logged once until it answers)."""
        try:
            actors = await asyncio.wait_for(self.core.backend.stats(), self.stats_timeout_s)
        except asyncio.TimeoutError:
            if not self._stats_late:
                self._stats_late = True
                log_event("stats_timeout", logging.WARNING, timeout_s=self.stats_timeout_s,
                          note="GetStats answers without actor stats until the backend answers")
            return []
        if self._stats_late:
            self._stats_late = False
            log_event("stats_recovered")
        return actors

    async def _admit(self, request: pb.GenerateRequest | UnparsableRequest, context: grpc.aio.ServicerContext,
                     received: float) -> AdmittedRequest:
        peek_id = _peek_request_id(request)
        if isinstance(request, UnparsableRequest):
            error = RequestError("INVALID_ARGUMENT", f"request: not a valid GenerateRequest ({request.error})")
            self.core.rejected("grpc", error.code, peek_id, error.message)
            raise error
        remaining = context.time_remaining()
        deadline = received + remaining if remaining is not None else None
        backend = self.core.backend
        tokenizer, max_model_len = backend.tokenizer, backend.max_model_len
        defaults = backend.generation_defaults
        num_ids = num_token_ids(request)
        long_prompt = request.WhichOneof("input") == "prompt" and len(request.prompt) >= THREAD_TOKENIZE_CHARS
        # Long prompts are tokenized, and many token ids copied and checked, off the event loop; token ids
        # beyond the budget are refused by their count alone, on the loop.
        offload = long_prompt or THREAD_TOKEN_IDS <= num_ids <= max_model_len
        return await self.core.admit(
            lambda in_flight: validate_request(request, tokenizer, max_model_len, in_flight, deadline, defaults),
            api="grpc", received=received, user=request.user, peek_id=peek_id, offload=offload,
        )


def _response(request_id: str, chunk: GenerationChunk) -> pb.GenerateResponse:
    """One `GenerateResponse` for one chunk (usage and timing only on the request's last one)."""
    response = pb.GenerateResponse(request_id=request_id, token_ids=chunk.token_ids, text=chunk.text,
                                   index=chunk.index)
    if chunk.logprobs:
        response.logprobs.extend(chunk.logprobs)
    if chunk.prompt_logprobs:
        response.prompt_logprobs.extend(chunk.prompt_logprobs)
    if chunk.finish_reason is not None:
        response.finish_reason = chunk.finish_reason
        if isinstance(chunk.matched_stop, str):
            response.stop_str = chunk.matched_stop
        elif isinstance(chunk.matched_stop, int):
            response.stop_token_id = chunk.matched_stop
    if chunk.usage is not None:
        u = chunk.usage
        response.usage.CopyFrom(pb.Usage(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                                         cached_prompt_tokens=u.cached_prompt_tokens))
    if chunk.timing is not None:
        response.timing.CopyFrom(chunk.timing.to_proto())
    return response


def _peek_request_id(request: pb.GenerateRequest | UnparsableRequest) -> str:
    if isinstance(request, UnparsableRequest):
        return "-"
    return request.request_id[:64] or "-"
