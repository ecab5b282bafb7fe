"""`GenerationServicer`: the pdserve.v1.GenerationService handlers.

Lifecycle of one Generate call::

    parse → (draining? UNAVAILABLE) → (in-flight ≥ max_queue? RESOURCE_EXHAUSTED)
      → validate + tokenize (INVALID_ARGUMENT / ALREADY_EXISTS)
      → backend.generate(inp): one GenerateResponse per chunk
      → last chunk: finish_reason, usage, timing → one log line

Client cancellation and deadline expiry cancel the handler task; the backend
generator is closed (``aclose``) so the backend frees the request.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field

import grpc

from engine.latency import time_per_output_token
from proto.pdserve.v1 import generation_pb2 as pb
from router.backend import ActorStats, Backend, BackendError, GenerationChunk, GenerationInput, Timing, Usage
from router.log import log_event
from router.validation import THREAD_TOKEN_IDS, RequestError, num_token_ids, validate_request

SERVICE_NAME = "pdserve.v1.GenerationService"
THREAD_TOKENIZE_CHARS = 8192  # prompts at least this long are tokenized in a worker thread
STATS_TIMEOUT_S = 3.0  # GetStats answers within this even when backend.stats() never returns

FINISH_REASON_TO_PROTO = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
}
ROLE_TO_PROTO = {
    "prefill": pb.ACTOR_ROLE_PREFILL,
    "decode": pb.ACTOR_ROLE_DECODE,
    "colocated": pb.ACTOR_ROLE_COLOCATED,
}


@dataclass(slots=True)
class UnparsableRequest:
    """Stands in for a request whose bytes did not parse (e.g. invalid UTF-8)."""

    error: str


def parse_generate_request(data: bytes) -> pb.GenerateRequest | UnparsableRequest:
    """Deserializer that turns a parse failure into INVALID_ARGUMENT, not INTERNAL."""
    try:
        return pb.GenerateRequest.FromString(data)
    except Exception as e:  # noqa: BLE001 — DecodeError and friends
        return UnparsableRequest(str(e) or type(e).__name__)


@dataclass(slots=True)
class _RequestRecord:
    """What one request's log line reports."""

    request_id: str
    received: float
    num_prompt_tokens: int
    num_completion_tokens: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None
    itl_s: list[float] = field(default_factory=list)  # gaps between token messages, as relayed
    finish_reason: str | None = None
    status: str = "OK"
    usage: Usage | None = None
    timing: Timing = field(default_factory=Timing)


class GenerationServicer:
    """Handlers for pdserve.v1.GenerationService over a `Backend`.

    Args:
        backend: generates tokens and reports stats.
        max_queue: most Generate calls in flight at once; more are refused
            with RESOURCE_EXHAUSTED at once.
        metrics: optional `router.metrics.Metrics`; each finished request is reported to it.
    """

    def __init__(self, backend: Backend, max_queue: int, metrics=None) -> None:
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        self._backend = backend
        self._metrics = metrics
        self._max_queue = max_queue
        self._in_flight: dict[str, float] = {}
        self._idle = asyncio.Event()
        self._idle.set()
        self.draining = False
        self.ready = False  # set by the server once backend.ready() is True
        self.stats_timeout_s = STATS_TIMEOUT_S
        self._stats_late = False  # the last backend.stats() timed out (logged once until it answers again)
        self._num_admitting = 0

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    async def wait_idle(self, timeout: float | None) -> bool:
        """Wait until no Generate call is in flight; False on timeout."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    async def Generate(self, request: pb.GenerateRequest | UnparsableRequest,  # noqa: N802
                       context: grpc.aio.ServicerContext) -> None:
        received = time.monotonic()
        self._num_admitting += 1  # holds a slot while the request is validated
        try:
            inp = await self._admit(request, context, received)
        except RequestError as e:
            log_event("request_rejected", logging.INFO, request_id=_peek_request_id(request), status=e.code,
                      reason=e.message)
            await context.abort(grpc.StatusCode[e.code], e.message)
        except Exception:  # noqa: BLE001 — e.g. a tokenizer bug; never take the server down
            logging.getLogger("pdserve.router").exception("admitting request failed")
            await context.abort(grpc.StatusCode.INTERNAL, "internal error while validating; see the router log")
        finally:
            self._num_admitting -= 1
        record = _RequestRecord(inp.request_id, received, len(inp.prompt_token_ids))
        self._in_flight[inp.request_id] = received
        self._idle.clear()
        error: RequestError | None = None
        try:
            error = await self._stream(inp, context, record)
        except asyncio.CancelledError:
            expired = inp.deadline is not None and time.monotonic() >= inp.deadline
            record.status = "DEADLINE_EXCEEDED" if expired else "CANCELLED"
            raise
        finally:
            del self._in_flight[inp.request_id]
            if not self._in_flight:
                self._idle.set()
            _log_finished(record)
            if self._metrics is not None:
                _report_finished(self._metrics, record)
        if error is not None:
            await context.abort(grpc.StatusCode[error.code], error.message)

    async def GetStats(self, request: pb.GetStatsRequest,  # noqa: N802
                       context: grpc.aio.ServicerContext) -> pb.GetStatsResponse:
        try:
            actors = await self._actor_stats()
        except BackendError as e:
            await context.abort(grpc.StatusCode[e.code], e.message)
        except Exception:  # noqa: BLE001
            logging.getLogger("pdserve.router").exception("backend.stats() failed")
            await context.abort(grpc.StatusCode.INTERNAL, "could not collect stats; see the router log")
        response = pb.GetStatsResponse(router_in_flight_requests=len(self._in_flight))
        totals = response.totals
        for a in actors:
            role = ROLE_TO_PROTO.get(a.role, pb.ACTOR_ROLE_UNSPECIFIED)
            response.actors.add(
                actor_id=a.actor_id, role=role, kv_blocks_total=a.kv_blocks_total,
                kv_blocks_used=a.kv_blocks_used, queued_requests=a.queued_requests,
                running_requests=a.running_requests,
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
            actors = await asyncio.wait_for(self._backend.stats(), self.stats_timeout_s)
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
                     received: float) -> GenerationInput:
        if isinstance(request, UnparsableRequest):
            raise RequestError("INVALID_ARGUMENT", f"request: not a valid GenerateRequest ({request.error})")
        self._check_open()
        if len(self._in_flight) + self._num_admitting > self._max_queue:
            raise RequestError(
                "RESOURCE_EXHAUSTED", f"router is at capacity ({self._max_queue} requests in flight); retry later"
            )
        remaining = context.time_remaining()
        deadline = received + remaining if remaining is not None else None
        tokenizer, max_model_len = self._backend.tokenizer, self._backend.max_model_len
        num_ids = num_token_ids(request)
        long_prompt = request.WhichOneof("input") == "prompt" and len(request.prompt) >= THREAD_TOKENIZE_CHARS
        if not long_prompt and not THREAD_TOKEN_IDS <= num_ids <= max_model_len:
            # small inputs, and token ids beyond the budget (refused by their count alone), on the loop
            return validate_request(request, tokenizer, max_model_len, self._in_flight, deadline)
        # Long prompts are tokenized, and many token ids copied and checked, off the event loop.
        inp = await asyncio.to_thread(
            validate_request, request, tokenizer, max_model_len, frozenset(self._in_flight), deadline
        )
        if inp.request_id in self._in_flight:
            raise RequestError("ALREADY_EXISTS", f"request_id {inp.request_id!r} is already in flight")
        self._check_open()
        return inp

    def _check_open(self) -> None:
        if self.draining:
            raise RequestError("UNAVAILABLE", "server is draining; retry on another replica")
        if not self.ready:
            raise RequestError("UNAVAILABLE", "cluster is not ready yet; retry shortly")

    async def _stream(self, inp: GenerationInput, context: grpc.aio.ServicerContext,
                      record: _RequestRecord) -> RequestError | None:
        """Relay backend chunks; return the error to send, if any."""
        try:
            async with contextlib.aclosing(self._backend.generate(inp)) as chunks:
                async for chunk in chunks:
                    await context.write(self._response(inp, chunk, record))
                    if chunk.finish_reason is not None:
                        return None
            record.status = "INTERNAL"
            return RequestError("INTERNAL", "backend ended the stream without a finish reason")
        except BackendError as e:
            record.status = e.code
            return RequestError(e.code, e.message)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception:  # noqa: BLE001 — bad input must never take the server down
            logging.getLogger("pdserve.router").exception("request %s failed", inp.request_id)
            record.status = "INTERNAL"
            return RequestError("INTERNAL", "internal error while generating; see the router log")

    def _response(self, inp: GenerationInput, chunk: GenerationChunk, record: _RequestRecord) -> pb.GenerateResponse:
        now = time.monotonic()
        if chunk.token_ids:
            if record.first_token_at is None:
                record.first_token_at = now
            else:
                record.itl_s.append(now - record.last_token_at)
            record.last_token_at = now
        record.num_completion_tokens += len(chunk.token_ids)
        response = pb.GenerateResponse(request_id=inp.request_id, token_ids=chunk.token_ids, text=chunk.text)
        if chunk.finish_reason is None:
            return response
        if chunk.finish_reason not in FINISH_REASON_TO_PROTO:
            raise ValueError(f"backend sent unknown finish_reason {chunk.finish_reason!r}")
        record.finish_reason = chunk.finish_reason
        usage = chunk.usage or Usage(record.num_prompt_tokens, record.num_completion_tokens, 0)
        t = chunk.timing or Timing()
        ttft = (record.first_token_at or now) - record.received
        record.usage = usage
        record.timing = Timing(t.queue_s, t.prefill_s, t.kv_transfer_s, t.decode_queue_s, ttft, now - record.received)
        response.finish_reason = FINISH_REASON_TO_PROTO[chunk.finish_reason]
        response.usage.CopyFrom(pb.Usage(
            prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
            cached_prompt_tokens=usage.cached_prompt_tokens,
        ))
        rt = record.timing
        response.timing.CopyFrom(pb.Timing(
            queue_s=rt.queue_s, prefill_s=rt.prefill_s, kv_transfer_s=rt.kv_transfer_s,
            decode_queue_s=rt.decode_queue_s, ttft_s=rt.ttft_s, e2e_s=rt.e2e_s,
        ))
        return response


def _peek_request_id(request: pb.GenerateRequest | UnparsableRequest) -> str:
    if isinstance(request, UnparsableRequest):
        return "-"
    return request.request_id[:64] or "-"


def _tpot(record: _RequestRecord) -> float:
    """Time per output token after the first (0 for fewer than two tokens)."""
    t = record.timing
    return time_per_output_token(t.ttft_s, t.e2e_s, record.num_completion_tokens) if record.usage else 0.0


def _report_finished(metrics, record: _RequestRecord) -> None:
    try:
        ok = record.usage is not None
        t = record.timing
        metrics.request_finished(
            record.finish_reason if ok else record.status.lower(),
            ttft_s=t.ttft_s if ok else None, e2e_s=t.e2e_s, queue_s=t.queue_s,
            num_output_tokens=record.num_completion_tokens, itl_s=record.itl_s,
        )
    except Exception:  # noqa: BLE001 — metrics never fail a request
        logging.getLogger("pdserve.router").exception("metrics.request_finished failed")


def _log_finished(record: _RequestRecord) -> None:
    usage = record.usage
    t = record.timing
    log_event(
        "request_finished",
        logging.INFO if record.status == "OK" else logging.WARNING,
        request_id=record.request_id, status=record.status, finish_reason=record.finish_reason or "-",
        prompt_tokens=record.num_prompt_tokens,
        completion_tokens=usage.completion_tokens if usage else record.num_completion_tokens,
        cached_prompt_tokens=usage.cached_prompt_tokens if usage else 0,
        queue_s=t.queue_s, prefill_s=t.prefill_s, kv_transfer_s=t.kv_transfer_s,
        decode_queue_s=t.decode_queue_s, ttft_s=t.ttft_s,
        e2e_s=t.e2e_s if usage else time.monotonic() - record.received,
        tpot_s=_tpot(record),
    )
