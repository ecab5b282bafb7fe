"""`HTTPServer`: uvicorn serving the OpenAI app inside the router's own asyncio loop.

The socket is bound here, before uvicorn starts (so port 0 gives a real port at once, and a
bind failure is an ``OSError`` from `HTTPServer.start`); uvicorn's signal handling is off (the
router's `serve_until_signal` owns SIGTERM/SIGINT), and so is its access log (the router logs
one line per request itself). Each connection is bounded by `router.openai_api.http_limits`: header
size and time, body pace, idle keep-alive, connections per client address.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
import ssl
from collections.abc import Callable

import uvicorn
from starlette.types import ASGIApp

from router.openai_api.http_limits import BoundedHttpToolsProtocol, ConnectionGuard, HTTPLimits, Refusal
from router.security import TLSConfig

log = logging.getLogger("pdserve.router")


class _Uvicorn(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):   # the router handles signals (serve_until_signal)
        yield


class HTTPServer:
    """One uvicorn server on a socket bound at `start`.

    Args:
        app: the ASGI app.
        host: the host to bind.
        port: the port to bind (0: a free one).
        tls: the server certificate and key (and a client CA for mTLS); None = plain HTTP.
        limits: the per-connection bounds (default `HTTPLimits()`).
        on_refused: called with each `Refusal` a limit made (e.g. to count it).

    Attributes:
        host: the bound host.
        port: the bound port (the real one when asked for port 0).
        guard: the connections' shared `ConnectionGuard` (open connections per client address).
    """

    def __init__(self, app: ASGIApp, host: str, port: int, tls: TLSConfig | None = None,
                 limits: HTTPLimits | None = None, on_refused: Callable[[Refusal], None] | None = None) -> None:
        self.app = app
        self.host = host
        self.port = port
        self.tls = tls
        self.guard = ConnectionGuard(limits or HTTPLimits(), on_refused)
        self._server: _Uvicorn | None = None
        self._task: asyncio.Task | None = None
        self._sock: socket.socket | None = None

    @property
    def scheme(self) -> str:
        return "https" if self.tls else "http"

    @property
    def base_url(self) -> str:
        """``http(s)://host:port`` (IPv6 hosts bracketed)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"

    async def start(self) -> None:
        """Bind and start serving.

        Raises:
            OSError: the address could not be bound.
            ValueError: the TLS files could not be loaded.
        """
        kwargs = {}
        if self.tls is not None:
            kwargs = dict(ssl_certfile=str(self.tls.cert_path), ssl_keyfile=str(self.tls.key_path))
            if self.tls.client_ca_path:
                kwargs.update(ssl_ca_certs=str(self.tls.client_ca_path), ssl_cert_reqs=ssl.CERT_REQUIRED)
        protocol = functools.partial(BoundedHttpToolsProtocol, guard=self.guard)
        config = uvicorn.Config(self.app, http=protocol, ws="none", lifespan="off", access_log=False,
                                log_level="warning", log_config=None, timeout_graceful_shutdown=5,
                                timeout_keep_alive=self.guard.limits.keep_alive_timeout_s, server_header=False,
                                **kwargs)
        try:
            config.load()       # reads the TLS files now, so that a bad one fails the start
        except (OSError, ssl.SSLError) as e:
            raise ValueError(f"HTTP server TLS: {e}") from None
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        # proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets that name it, and without it
        # Nagle holds an SSE event behind the unacknowledged headers for the peer's delayed ACK (~40 ms).
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, self.port))
        except OSError as e:
            sock.close()
            raise OSError(f"could not bind HTTP {self.host}:{self.port}: {e}") from None
        sock.set_inheritable(True)
        self._sock = sock
        self.port = sock.getsockname()[1]
        self._server = _Uvicorn(config)
        self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()
                raise OSError(f"HTTP server on {self.host}:{self.port} exited at start")
            await asyncio.sleep(0.005)

    async def stop(self, grace: float | None = None) -> None:
        """Stop accepting, give open requests ``grace`` seconds (default 5), then cancel them."""
        if self._server is None or self._task is None:
            return
        self._server.config.timeout_graceful_shutdown = max(grace or 0.0, 0.1) if grace is not None else 5
        self._server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self._task), (grace or 5.0) + 5.0)
        except asyncio.TimeoutError:
            self._server.force_exit = True
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        except Exception:  # noqa: BLE001 — stopping never raises
            log.exception("HTTP server stopped with an error")
        self._server = None
        self._task = None
