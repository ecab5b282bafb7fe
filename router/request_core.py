"""`RequestCore`: what both front doors (gRPC ``Generate`` and OpenAI HTTP) share.

Lifecycle of one request, through either front door::

    parse (front door) → RequestCore.admit:
        (draining / not ready? UNAVAILABLE) → (in-flight ≥ max_queue? RESOURCE_EXHAUSTED)
        → validate + tokenize (INVALID_ARGUMENT / ALREADY_EXISTS) → registered in flight
      → AdmittedRequest.chunks(): backend.generate(inp) → [best_of selection] → chunks,
        the request's last one with usage and timing (router-measured ttft / e2e)
      → AdmittedRequest.finish(): out of the in-flight registry, one log line, metrics

Client cancellation and deadline expiry cancel the consuming task; the backend
generator is closed (``aclose``) so the backend frees the request.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Container
from dataclasses import dataclass, field

from engine.latency import time_per_output_token
from router.backend import FINISH_REASONS, Backend, BackendError, GenerationChunk, GenerationInput, Usage, \
    finish_reason_name
from router.best_of import needs_selection, select_best
from router.log import log_event
from router.timing import Timing
from router.validation import RequestError

THREAD_TOKENIZE_CHARS = 8192  # prompts at least this long are tokenized in a worker thread
MAX_LOGGED_USER_CHARS = 128

log = logging.getLogger("pdserve.router")


@dataclass(slots=True)
class RequestRecord:
    """What one request's log line and metrics report."""

    request_id: str
    api: str
    user: str
    received: float
    num_prompt_tokens: int
    backend_started: float | None = None     # the backend got the request (end of intake)
    num_sequences: int = 1
    num_completion_tokens: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None
    itl_s: list[float] = field(default_factory=list)  # gaps between token chunks, as relayed
    finish_reasons: dict[int, int] = field(default_factory=dict)   # sequence index -> its pb.FinishReason
    status: str = "OK"
    backend_usage: Usage | None = None
    backend_timing: Timing | None = None
    usage: Usage | None = None      # set when the request's last chunk went out
    timing: Timing = field(default_factory=Timing)

    @property
    def all_finished(self) -> bool:
        return len(self.finish_reasons) == self.num_sequences

    @property
    def finish_reason(self) -> int | None:
        """The first sequence's finish reason (the metrics label; the log line lists them all)."""
        return self.finish_reasons.get(0, next(iter(self.finish_reasons.values()), None))


class RequestCore:
    """Admission, the in-flight registry, deadlines, and one log line + metrics per request.

    Both front doors (the gRPC servicer and the OpenAI HTTP app) hold the same `RequestCore`, so
    ``max_queue`` bounds their requests together and draining closes both.

    Args:
        backend: generates tokens and reports stats.
        max_queue: most requests in flight at once (both front doors); more are refused
            with RESOURCE_EXHAUSTED at once.
        metrics: optional `router.metrics.Metrics`; each finished request is reported to it.

    Attributes:
        draining: set by the server on drain/stop; new requests get UNAVAILABLE.
        ready: set by the server once ``backend.ready()`` first returned True.
    """

    def __init__(self, backend: Backend, max_queue: int, metrics=None) -> None:
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        self.backend = backend
        self.metrics = metrics
        self.max_queue = max_queue
        self._in_flight: dict[str, float] = {}
        self._idle = asyncio.Event()
        self._idle.set()
        self._num_admitting = 0
        self.draining = False
        self.ready = False

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    @property
    def in_flight(self) -> Container[str]:
        """Request ids in flight (read only)."""
        return self._in_flight.keys()

    async def wait_idle(self, timeout: float | None) -> bool:
        """Wait until no request is in flight; False on timeout."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    def rejected(self, api: str, status: str, request_id: str, message: str, reason: str | None = None,
                 log: bool = True) -> None:
        """Report one refused request: its ``request_rejected`` line (unless ``log`` is False) and the
        rejected-requests counter (``reason``: one of `router.metrics.REJECTION_REASONS`; default the status's)."""
        if log:
            log_event("request_rejected", logging.INFO, request_id=request_id, api=api, status=status, reason=message)
        if self.metrics is not None:
            self.metrics.request_rejected(api, status, reason)

    def check_open(self) -> None:
        """Raise UNAVAILABLE while draining or before the backend was first ready."""
        if self.draining:
            raise RequestError("UNAVAILABLE", "server is draining; retry on another replica")
        if not self.ready:
            raise RequestError("UNAVAILABLE", "cluster is not ready yet; retry shortly")

    async def admit(self, validate: Callable[[Container[str]], GenerationInput], *, api: str,
                    received: float | None = None, user: str = "", peek_id: str = "-",
                    offload: bool = False) -> AdmittedRequest:
        """Admit one request: open? room? then ``validate(in_flight_ids)``; register it in flight.

        Args:
            validate: builds the `GenerationInput` (validates, tokenizes); raises `RequestError`.
            api: "grpc" or "http" (logged).
            received: ``time.monotonic()`` of receipt (default: now).
            user: the client's end-user id (logged only).
            peek_id: the request id to log if the request is refused before it has one.
            offload: run ``validate`` in a worker thread (long prompts, many token ids).

        Returns:
            The `AdmittedRequest`; its ``finish()`` must be called exactly once (in a ``finally``).

        Raises:
            RequestError: the refusal (logged as ``request_rejected``).
        """
        received = time.monotonic() if received is None else received
        self._num_admitting += 1  # holds a slot while the request is validated
        try:
            self.check_open()
            if len(self._in_flight) + self._num_admitting > self.max_queue:
                raise RequestError("RESOURCE_EXHAUSTED",
                                   f"router is at capacity ({self.max_queue} requests in flight); retry later")
            if offload:
                inp = await asyncio.to_thread(validate, frozenset(self._in_flight))
                if inp.request_id in self._in_flight:
                    raise RequestError("ALREADY_EXISTS", f"request_id {inp.request_id!r} is already in flight",
                                       "request_id")
                self.check_open()
            else:
                inp = validate(self._in_flight)
        except RequestError as e:
            self.rejected(api, e.code, peek_id, e.message)
            raise
        except Exception:  # noqa: BLE001 — e.g. a tokenizer bug; never take the server down
            log.exception("admitting request failed")
            raise RequestError("INTERNAL", "internal error while validating; see the router log") from None
        finally:
            self._num_admitting -= 1
        params = inp.params
        record = RequestRecord(inp.request_id, api, user[:MAX_LOGGED_USER_CHARS], received,
                               len(inp.prompt_token_ids), num_sequences=params.num_sequences)
        self._in_flight[inp.request_id] = received
        self._idle.clear()
        return AdmittedRequest(self, inp, record)

    def _release(self, request_id: str) -> None:
        del self._in_flight[request_id]
        if not self._in_flight:
            self._idle.set()


class AdmittedRequest:
    """One admitted request: stream its chunks with `chunks`, then `finish` it (once)."""

    def __init__(self, core: RequestCore, inp: GenerationInput, record: RequestRecord) -> None:
        self.core = core
        self.inp = inp
        self.record = record
        self._finished = False
        params = inp.params
        self.keep_logprobs = params.logprobs is not None   # what the client asked for
        if needs_selection(params.n, params.best_of) and params.logprobs is None:
            params.logprobs = 0     # best_of ranks by the sampled tokens' logprobs: every hop must carry them

    async def chunks(self) -> AsyncIterator[GenerationChunk]:
        """The backend's chunks, best_of-selected when ``best_of > n``; stops after every sequence finished.

        The request's last chunk carries ``usage`` (the backend's, else counted here) and ``timing``
        (the backend's, with the router's own ttft_s / e2e_s); no other chunk carries either.

        Raises:
            RequestError: the backend failed (its code), or broke the contract (INTERNAL).
        """
        params, record = self.inp.params, self.record
        n = params.n
        selecting = needs_selection(n, params.best_of)
        num_out = n if selecting else record.num_sequences
        num_done = 0
        try:
            record.backend_started = time.monotonic()
            async with contextlib.aclosing(self.core.backend.generate(self.inp)) as raw:
                stream = self._recorded(raw)
                if selecting:
                    stream = select_best(stream, n, keep_logprobs=self.keep_logprobs)
                async with contextlib.aclosing(stream) as out:
                    async for chunk in out:
                        chunk.usage = chunk.timing = None
                        num_done += chunk.finish_reason is not None
                        if num_done == num_out and chunk.finish_reason is not None:
                            chunk.usage, chunk.timing = self._final_usage_and_timing()
                            yield chunk
                            return
                        yield chunk
        except RequestError as e:
            record.status = e.code
            raise
        except BackendError as e:
            record.status = e.code
            raise RequestError(e.code, e.message) from None
        except (asyncio.CancelledError, GeneratorExit):
            if record.usage is None:
                deadline = self.inp.deadline
                expired = deadline is not None and time.monotonic() >= deadline
                record.status = "DEADLINE_EXCEEDED" if expired else "CANCELLED"
            raise
        except Exception:  # noqa: BLE001 — bad input must never take the server down
            log.exception("request %s failed", self.inp.request_id)
            record.status = "INTERNAL"
            raise RequestError("INTERNAL", "internal error while generating; see the router log") from None

    async def _recorded(self, raw: AsyncIterator[GenerationChunk]) -> AsyncIterator[GenerationChunk]:
        """Check the backend's chunks against the contract and record tokens, gaps and finishes."""
        record = self.record
        async for chunk in raw:
            if chunk.finish_reason is not None and chunk.finish_reason not in FINISH_REASONS:
                raise ValueError(f"backend sent unknown finish_reason {chunk.finish_reason!r}")
            if not 0 <= chunk.index < record.num_sequences or chunk.index in record.finish_reasons:
                raise ValueError(f"backend sent a chunk for sequence {chunk.index} "
                                 f"({record.num_sequences} sequences, finished: {sorted(record.finish_reasons)})")
            now = time.monotonic()
            if chunk.token_ids:
                if record.first_token_at is None:
                    record.first_token_at = now
                else:
                    record.itl_s.append(now - record.last_token_at)
                record.last_token_at = now
            record.num_completion_tokens += len(chunk.token_ids)
            if chunk.finish_reason is not None:
                record.finish_reasons[chunk.index] = chunk.finish_reason
            record.backend_usage = chunk.usage or record.backend_usage
            record.backend_timing = chunk.timing or record.backend_timing
            yield chunk
            if record.all_finished:
                return
        raise RequestError("INTERNAL", "backend ended the stream without a finish reason for every sequence")

    def _final_usage_and_timing(self) -> tuple[Usage, Timing]:
        record = self.record
        now = time.monotonic()
        usage = record.backend_usage or Usage(record.num_prompt_tokens, record.num_completion_tokens, 0)
        t = record.backend_timing or Timing()
        ttft = (record.first_token_at or now) - record.received
        record.usage = usage
        timeline = t.timeline
        if timeline is not None:     # the backend's stages, after this router's intake; they sum to ttft
            timeline.intake_s = (record.backend_started or record.received) - record.received
            timeline.close(ttft)
        record.timing = Timing(t.queue_s, t.prefill_s, t.kv_transfer_s, t.decode_queue_s, ttft, now - record.received,
                               timeline, t.placement)
        return usage, record.timing

    def finish(self) -> None:
        """Leave the in-flight registry; log the request's line and report its metrics. Idempotent."""
        if self._finished:
            return
        self._finished = True
        if self.record.usage is None and self.record.status == "OK":
            self.record.status = "CANCELLED"     # it never ran to its end (e.g. another prompt of its batch failed)
        self.core._release(self.inp.request_id)
        _log_finished(self.record)
        if self.core.metrics is not None:
            _report_finished(self.core.metrics, self.record)


def _tpot(record: RequestRecord) -> float:
    """Time per output token after the first (0 for fewer than two tokens)."""
    t = record.timing
    return time_per_output_token(t.ttft_s, t.e2e_s, record.num_completion_tokens) if record.usage else 0.0


def _report_finished(metrics, record: RequestRecord) -> None:
    try:
        ok = record.usage is not None
        t = record.timing
        metrics.request_finished(
            finish_reason_name(record.finish_reason) if ok else record.status.lower(),
            ttft_s=t.ttft_s if ok else None, e2e_s=t.e2e_s, queue_s=t.queue_s,
            num_output_tokens=record.num_completion_tokens, itl_s=record.itl_s,
        )
    except Exception:  # noqa: BLE001 — metrics never fail a request
        log.exception("metrics.request_finished failed")


def _log_finished(record: RequestRecord) -> None:
    usage = record.usage
    t = record.timing
    reasons = ",".join(finish_reason_name(record.finish_reasons[i]) if i in record.finish_reasons else "-"
                       for i in range(record.num_sequences))
    fields: dict[str, object] = dict(
        request_id=record.request_id, api=record.api, status=record.status,
        finish_reason=reasons if record.finish_reasons else "-",
    )
    if record.user:
        fields["user"] = record.user
    if record.num_sequences > 1:
        fields["num_sequences"] = record.num_sequences
    log_event(
        "request_finished",
        logging.INFO if record.status == "OK" else logging.WARNING,
        **fields,
        prompt_tokens=record.num_prompt_tokens,
        completion_tokens=usage.completion_tokens if usage else record.num_completion_tokens,
        cached_prompt_tokens=usage.cached_prompt_tokens if usage else 0,
        queue_s=t.queue_s, prefill_s=t.prefill_s, kv_transfer_s=t.kv_transfer_s,
        decode_queue_s=t.decode_queue_s, ttft_s=t.ttft_s,
        e2e_s=t.e2e_s if usage else time.monotonic() - record.received,
        tpot_s=_tpot(record),
        **(t.placement.log_fields() if t.placement is not None else {}),
        **(dict(spec_proposed_tokens=usage.spec_proposed_tokens, spec_accepted_tokens=usage.spec_accepted_tokens)
           if usage is not None and usage.spec_proposed_tokens else {}),
    )
