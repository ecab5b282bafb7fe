"""Bounds on every connection of the HTTP front door: header size and time, body pace, idle keep-alive,
and connections per client address.

uvicorn's httptools protocol bounds none of these but the idle time after a response.
`BoundedHttpToolsProtocol` adds them with loop timers and is otherwise uvicorn's. A connection's life::

    connection_made ── its client address already has max_connections_per_client open → 503, closed
        │  header timer: header_timeout_s
    request line + headers ── over max_header_bytes in all → 431, closed
        │                  └─ header timer fires → 408, closed (closed without an answer if no byte came)
        │  on_headers_complete: header timer off, body timer on
    body ── its deadline passes → 408 (closed without one if the response has started, e.g. a 401)
        │  (body_timeout_s after the headers, 1 s later per min_body_bytes_per_s received; a body
        │  uvicorn itself stopped reading, waiting for the app, is never the client's fault)
        │  on_message_complete: body timer off
    response ── no timer: a stream may last as long as the app streams
        │  on_response_complete: uvicorn's keep-alive timer (keep_alive_timeout_s)
    next request's first byte ── header timer on, as above

The limits do not depend on what the app answers: a connection whose request got a 401 is held to the
same header, body and idle bounds. Every refusal is logged (one line per kind, at most every
`REFUSAL_LOG_INTERVAL_S`, with the number left unlogged) and reported to ``on_refused`` (the metrics).
"""
from __future__ import annotations

import asyncio
import enum
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from router.log import log_event

log = logging.getLogger("pdserve.router")
REFUSAL_LOG_INTERVAL_S = 10.0


@dataclass(frozen=True, slots=True)
class HTTPLimits:
    """Per-connection bounds of the HTTP front door (`server.http_limits` in the config).

    Attributes:
        max_header_bytes: request line + headers, in all (431 beyond).
        header_timeout_s: the request line and headers must arrive within this of the connection's
            start, or of the request's first byte after an idle keep-alive (408).
        body_timeout_s: the body's first allowance after the headers (408 when it runs out).
        min_body_bytes_per_s: each this many body bytes received add 1 s to the allowance
            (0: the whole body within ``body_timeout_s``).
        keep_alive_timeout_s: an idle connection between requests is closed after this.
        max_connections_per_client: open connections per client IP address; more are answered 503 and
            closed at once.
    """

    max_header_bytes: int = 64 * 1024
    header_timeout_s: float = 10.0
    body_timeout_s: float = 10.0
    min_body_bytes_per_s: int = 16 * 1024
    keep_alive_timeout_s: float = 5.0
    max_connections_per_client: int = 256

    def __post_init__(self) -> None:
        assert self.max_header_bytes > 0 and self.max_connections_per_client > 0, self
        assert self.header_timeout_s > 0 and self.body_timeout_s > 0 and self.keep_alive_timeout_s > 0, self
        assert self.min_body_bytes_per_s >= 0, self


class Refusal(enum.Enum):
    """Why a connection was closed by a limit; the value is the metrics' ``reason`` label."""

    HEADER_TOO_LARGE = "header_too_large"
    HEADER_TIMEOUT = "header_timeout"
    BODY_TIMEOUT = "body_timeout"
    TOO_MANY_CONNECTIONS = "too_many_connections"

    @property
    def http_status(self) -> int:
        return _HTTP_STATUS[self]

    @property
    def status_name(self) -> str:
        """The gRPC status name the metrics count it under (as the app's own refusals)."""
        return _STATUS_NAME[self]

    def response(self) -> bytes:
        """The whole answer: status line, ``connection: close``, an OpenAI-style error body."""
        message, error_type = _MESSAGE[self]
        body = json.dumps({"error": {"message": message, "type": error_type, "param": None,
                                     "code": self.value}}).encode()
        return b"".join([STATUS_LINE[self.http_status], b"content-type: application/json\r\n",
                         b"content-length: %d\r\n" % len(body), b"connection: close\r\n\r\n", body])


_HTTP_STATUS = {Refusal.HEADER_TOO_LARGE: 431, Refusal.HEADER_TIMEOUT: 408, Refusal.BODY_TIMEOUT: 408,
                Refusal.TOO_MANY_CONNECTIONS: 503}
_STATUS_NAME = {Refusal.HEADER_TOO_LARGE: "INVALID_ARGUMENT", Refusal.HEADER_TIMEOUT: "DEADLINE_EXCEEDED",
                Refusal.BODY_TIMEOUT: "DEADLINE_EXCEEDED", Refusal.TOO_MANY_CONNECTIONS: "RESOURCE_EXHAUSTED"}
_MESSAGE = {
    Refusal.HEADER_TOO_LARGE: ("request headers too large", "invalid_request_error"),
    Refusal.HEADER_TIMEOUT: ("request headers not received in time", "timeout_error"),
    Refusal.BODY_TIMEOUT: ("request body not received in time", "timeout_error"),
    Refusal.TOO_MANY_CONNECTIONS: ("too many connections from this client", "service_unavailable_error"),
}


class ConnectionGuard:
    """What one server's connections share: the open-connection count per client address and the
    refusal log.

    Args:
        limits: the bounds.
        on_refused: called with each `Refusal` (counts it); never raises into the protocol.
    """

    def __init__(self, limits: HTTPLimits, on_refused: Callable[[Refusal], None] | None = None) -> None:
        self.limits = limits
        self.on_refused = on_refused
        self._num_open: dict[str, int] = {}
        self._last_logged: dict[Refusal, float] = {}
        self._num_unlogged: dict[Refusal, int] = {}

    def num_open(self, client_ip: str) -> int:
        return self._num_open.get(client_ip, 0)

    def can_open(self, client_ip: str) -> bool:
        return self.num_open(client_ip) < self.limits.max_connections_per_client

    def opened(self, client_ip: str) -> None:
        assert self.can_open(client_ip), client_ip
        self._num_open[client_ip] = self.num_open(client_ip) + 1

    def closed(self, client_ip: str) -> None:
        num_open = self._num_open[client_ip] - 1
        assert num_open >= 0, client_ip
        if num_open:
            self._num_open[client_ip] = num_open
        else:
            del self._num_open[client_ip]

    def refused(self, refusal: Refusal, client_ip: str) -> None:
        """Count one refusal; log it unless this kind was logged less than `REFUSAL_LOG_INTERVAL_S` ago."""
        if self.on_refused is not None:
            try:
                self.on_refused(refusal)
            except Exception:  # noqa: BLE001 — a metrics hook never breaks the connection's handling
                log.warning("counting an HTTP refusal (%s) failed", refusal.value)
        now = time.monotonic()
        last = self._last_logged.get(refusal)
        if last is not None and now - last < REFUSAL_LOG_INTERVAL_S:
            self._num_unlogged[refusal] = self._num_unlogged.get(refusal, 0) + 1
            return
        self._last_logged[refusal] = now
        log_event("http_connection_refused", logging.WARNING, reason=refusal.value,
                  http_status=refusal.http_status, client=client_ip,
                  unlogged_since_last=self._num_unlogged.pop(refusal, 0))


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with `HTTPLimits` (see the module docstring); build it through
    ``functools.partial(BoundedHttpToolsProtocol, guard=...)`` as ``uvicorn.Config(http=...)``."""

    def __init__(self, *args: Any, guard: ConnectionGuard, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.guard = guard
        self.limits = guard.limits
        self._client_ip = ""
        self._counted = False               # holds one of its client's connection slots
        self._reading_headers = True        # from the connection's (or last message's) end to on_headers_complete
        self._message_begun = False         # the parser saw this request's first byte
        self._num_header_bytes = 0
        self._num_headers_completed = 0
        self._header_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._body_started = 0.0
        self._num_body_bytes = 0

    # ---- connection -------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._client_ip = self.client[0] if self.client else ""
        if not self.guard.can_open(self._client_ip):
            self._refuse(Refusal.TOO_MANY_CONNECTIONS, answer=True)
            return
        self.guard.opened(self._client_ip)
        self._counted = True
        self._header_timer = self.loop.call_later(self.limits.header_timeout_s, self._header_timed_out)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        self._cancel_body_timer()
        if self._counted:
            self._counted = False
            self.guard.closed(self._client_ip)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.transport.is_closing():     # refused (or done): what is still in flight is not parsed
            return
        if not self._reading_headers:
            super().data_received(data)
            return
        if self._header_timer is None and self._response_done():
            self._header_timer = self.loop.call_later(self.limits.header_timeout_s, self._header_timed_out)
        room = self.limits.max_header_bytes - self._num_header_bytes
        if len(data) <= room:
            self._num_header_bytes += len(data)
            super().data_received(data)
            return
        # Feed only what fits: the parser must never hold more header than the limit. (A pipelined
        # request whose headers start in the read that ends the one before is counted from its next
        # read: the bound is then the limit plus one read.)
        num_completed = self._num_headers_completed
        if room > 0:
            super().data_received(data[:room])
        if self.transport.is_closing():
            return
        if num_completed == self._num_headers_completed:
            self._refuse(Refusal.HEADER_TOO_LARGE, answer=self._response_done())
            return
        super().data_received(data[room:])

    # ---- parser callbacks -------------------------------------------------------
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._message_begun = True

    def on_headers_complete(self) -> None:
        self._reading_headers = False
        self._num_headers_completed += 1
        self._cancel_header_timer()
        super().on_headers_complete()
        self._body_started = self.loop.time()
        self._num_body_bytes = 0
        self._body_timer = self.loop.call_later(self.limits.body_timeout_s, self._body_timed_out)

    def on_body(self, body: bytes) -> None:
        self._num_body_bytes += len(body)
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._cancel_body_timer()
        self._reading_headers = True
        self._message_begun = False
        self._num_header_bytes = 0
        super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # the next request began before this response ended (pipelined): its header time starts now
        if (self._message_begun and self._reading_headers and self._header_timer is None
                and not self.transport.is_closing()):
            self._header_timer = self.loop.call_later(self.limits.header_timeout_s, self._header_timed_out)

    # ---- timers -----------------------------------------------------------------
    def _header_timed_out(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            began = self._message_begun or self._num_header_bytes > 0
            self._refuse(Refusal.HEADER_TIMEOUT, answer=began and self._response_done())

    def _body_timed_out(self) -> None:
        self._body_timer = None
        if self.transport.is_closing():
            return
        now = self.loop.time()
        if self.flow.read_paused:    # uvicorn stopped reading (the app has not taken the body yet)
            self._body_started, self._num_body_bytes = now, 0
            self._body_timer = self.loop.call_later(self.limits.body_timeout_s, self._body_timed_out)
            return
        rate = self.limits.min_body_bytes_per_s
        deadline = self._body_started + self.limits.body_timeout_s + (self._num_body_bytes / rate if rate else 0.0)
        if now < deadline:
            self._body_timer = self.loop.call_later(deadline - now, self._body_timed_out)
            return
        self._refuse(Refusal.BODY_TIMEOUT, answer=not self.cycle.response_started)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _cancel_body_timer(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    # ---- refusing ---------------------------------------------------------------
    def _response_done(self) -> bool:
        """No response is being written (so one may be), as far as this connection's last request goes."""
        return self.cycle is None or self.cycle.response_complete

    def _refuse(self, refusal: Refusal, *, answer: bool) -> None:
        """Close the connection (after ``refusal``'s answer, when ``answer``); the app sees a disconnect."""
        self._cancel_header_timer()
        self._cancel_body_timer()
        if answer:
            self.transport.write(refusal.response())
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.disconnected = True     # the app may not write after our answer
            self.cycle.message_event.set()
        self.transport.close()
        self.guard.refused(refusal, self._client_ip)
