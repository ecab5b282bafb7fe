"""Start, drain and stop the router's gRPC server and its OpenAI-compatible HTTP server.

The gRPC server hosts pdserve.v1.GenerationService, grpc.health.v1.Health and
server reflection. With ``http_port`` set, the OpenAI-compatible HTTP API
(`router.openai_api`) runs beside it on the same host and event loop, with the
same token, TLS files and `RequestCore` (one in-flight limit for both; draining
closes both; its ``GET /health`` follows the same readiness).

Health follows ``await backend.ready()``, polled for as long as the server
runs: NOT_SERVING until it first returns True, then SERVING ⇄ NOT_SERVING as
readiness comes and goes (e.g. every decode actor gone; each transition logged
once), and NOT_SERVING for good from
`RouterServer.drain` on. Requests are refused (UNAVAILABLE) until the backend
is first ready; after that the backend decides (it queues them, bounded, while
its actors come back).

Example::

    server = await start_server(backend, "127.0.0.1", 50051, token=None, http_port=8000, model_name="small")
    await server.wait_ready()          # server.http_port: the bound HTTP port (port 0 → a free one)
    ...
    await server.drain(timeout=30.0)   # NOT_SERVING; new requests get UNAVAILABLE
    await server.stop(grace=5.0)

or, in a CLI, ``await serve_until_signal(server)`` drains on SIGTERM/SIGINT.
"""
from __future__ import annotations

import asyncio
import logging
import signal

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from proto.pdserve.v1 import generation_pb2 as pb
from router.backend import Backend
from router.log import log_event
from router.openai_api import ChatTemplate, HTTPServer, create_app
from router.openai_api.http_limits import HTTPLimits
from router.security import BearerTokenInterceptor, TLSConfig, check_bind, is_loopback
from router.request_core import RequestCore
from router.servicer import SERVICE_NAME, GenerationServicer, parse_generate_request, parse_stats_request

DEFAULT_MAX_QUEUE = 256
DEFAULT_MAX_MESSAGE_BYTES = 4 * 1024 * 1024
READY_PROBE_TIMEOUT_S = 5.0  # a backend.ready() that takes longer counts as "not ready"
HEALTH_SERVICE_NAMES = ("", SERVICE_NAME)


class RouterServer:
    """A running router; build it with `start_server`.

    Attributes:
        host: the bound host.
        port: the bound port (the real one when started with port 0).
        servicer: the `GenerationServicer` (the gRPC handlers).
        core: the `RequestCore` both front doors share.
        http: the OpenAI-compatible `HTTPServer`, or None when not started.
    """

    def __init__(self, server: grpc.aio.Server, servicer: GenerationServicer, health: health_aio.HealthServicer,
                 host: str, port: int) -> None:
        self._server = server
        self.core = servicer.core
        self.http: HTTPServer | None = None
        self._health = health
        self._ready = asyncio.Event()
        self._ready_task: asyncio.Task[None] | None = None
        self._stopped = False
        self.servicer = servicer
        self.host = host
        self.port = port

    @property
    def address(self) -> str:
        """``host:port`` for clients (IPv6 hosts bracketed)."""
        return f"{_bracket(self.host)}:{self.port}"

    @property
    def http_port(self) -> int | None:
        """The bound HTTP port (the real one when started with ``http_port=0``); None without HTTP."""
        return self.http.port if self.http is not None else None

    @property
    def http_url(self) -> str | None:
        """``http(s)://host:port`` of the OpenAI-compatible API; None without HTTP."""
        return self.http.base_url if self.http is not None else None

    @property
    def is_ready(self) -> bool:
        return self._ready.is_set()

    async def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait until health is SERVING; False on timeout."""
        try:
            await asyncio.wait_for(self._ready.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    async def drain(self, timeout: float | None = None) -> bool:
        """Turn health NOT_SERVING, refuse new requests (UNAVAILABLE), wait for in-flight ones.

        Returns:
            True if every in-flight request finished within ``timeout``.
        """
        if not self.core.draining:
            self.core.draining = True
            self._cancel_ready_task()
            await self._health.enter_graceful_shutdown()
            log_event("draining", in_flight=self.core.num_in_flight)
        finished = await self.core.wait_idle(timeout)
        log_event("drained" if finished else "drain_timeout", in_flight=self.core.num_in_flight)
        return finished

    async def stop(self, grace: float | None = None) -> None:
        """Stop serving; in-flight requests get ``grace`` seconds, then are cancelled."""
        if self._stopped:
            return
        self._stopped = True
        self.core.draining = True
        self._cancel_ready_task()
        await self._health.enter_graceful_shutdown()
        if self.http is not None:
            await asyncio.gather(self._server.stop(grace), self.http.stop(grace))
        else:
            await self._server.stop(grace)
        log_event("stopped", address=self.address)

    async def wait_for_termination(self) -> None:
        """Block until the server stops."""
        await self._server.wait_for_termination()

    def _start_ready_watch(self, backend: Backend, poll_s: float) -> None:
        self._ready_task = asyncio.get_running_loop().create_task(self._watch_ready(backend, poll_s))

    async def _watch_ready(self, backend: Backend, poll_s: float) -> None:
        """Poll ``backend.ready()`` every ``poll_s`` until drain/stop; health follows each change."""
        serving = False
        probe_failed = False
        while True:
            try:
                ready = bool(await asyncio.wait_for(backend.ready(), READY_PROBE_TIMEOUT_S))
                probe_failed = False
            except Exception:  # noqa: BLE001 — a failing or hanging probe means "not ready"
                if not probe_failed:
                    logging.getLogger("pdserve.router").exception("backend.ready() failed or took over %.0f s",
                                                                  READY_PROBE_TIMEOUT_S)
                probe_failed, ready = True, False
            if ready != serving and not self.core.draining:
                serving = ready
                await self._set_serving(ready)
            await asyncio.sleep(poll_s)

    async def _set_serving(self, ready: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in HEALTH_SERVICE_NAMES:
            await self._health.set(name, status)
        if ready:
            self.core.ready = True      # from now on the backend decides about each request
            self._ready.set()
            log_event("ready", address=self.address)
        else:
            self._ready.clear()
            log_event("not_ready", logging.WARNING, address=self.address,
                      note="backend.ready() is False (e.g. no decode actor); health is NOT_SERVING")

    def _cancel_ready_task(self) -> None:
        if self._ready_task is not None and not self._ready_task.done():
            self._ready_task.cancel()


async def start_server(
    backend: Backend,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    token: str | None = None,
    tls: TLSConfig | None = None,
    max_queue: int = DEFAULT_MAX_QUEUE,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ready_poll_s: float = 0.5,
    metrics=None,
    http_port: int | None = None,
    model_name: str = "pdserve",
    model_dir: str | None = None,
    chat_template: ChatTemplate | None = None,
    http_limits: HTTPLimits | None = None,
    tool_parser: str = "auto",
) -> RouterServer:
    """Start the router's gRPC server on the running event loop.

    Args:
        backend: the `Backend` that generates (the cluster, or a fake).
        host: interface to bind; anything but loopback requires ``token``.
        port: TCP port; 0 picks a free one (see ``RouterServer.port``).
        token: when set, every RPC but the health check must send metadata
            ``authorization: Bearer <token>``.
        tls: server certificate and key, optionally a client CA for mTLS.
        max_queue: most Generate calls in flight; more get RESOURCE_EXHAUSTED.
        max_message_bytes: largest request/response message accepted.
        ready_poll_s: how often to poll ``backend.ready()`` (health follows it while the server runs).
        metrics: optional `router.metrics.Metrics` that every finished request is reported to.
        http_port: also serve the OpenAI-compatible HTTP API on ``host:http_port`` (0 picks a free
            port: ``RouterServer.http_port``); None = no HTTP.
        model_name: the served model's name in the HTTP API (``router.openai_api.served_model_name``).
        model_dir: the model directory whose tokenizer_config.json holds the chat template.
        chat_template: the chat template (default: from ``model_dir``, else ChatML).
        http_limits: the HTTP connections' bounds (header size and time, body pace, idle keep-alive,
            connections per client address; default `HTTPLimits()`).
        tool_parser: the HTTP API's tool-call format: auto (from the chat template), hermes, llama3_json,
            none (`router.openai_api.tool_parsers`).

    Returns:
        The running `RouterServer`; health is SERVING while the backend is ready.

    Raises:
        ValueError: non-loopback host without a token, a bad limit, an unreadable chat template.
        OSError: an address could not be bound.
    """
    check_bind(host, token)
    if max_message_bytes < 1024:
        raise ValueError(f"max_message_bytes must be >= 1024, got {max_message_bytes}")
    if http_port is not None and chat_template is None:
        chat_template = ChatTemplate.from_model_dir(model_dir)
    core = RequestCore(backend, max_queue, metrics)
    servicer = GenerationServicer(core)
    interceptors = [BearerTokenInterceptor(token, lambda reason: core.rejected(
        "grpc", "UNAUTHENTICATED", "-", "", f"{reason}_token", log=False))] if token else []
    server = grpc.aio.server(
        interceptors=interceptors,
        options=[
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.so_reuseport", 0),
        ],
    )
    _add_generation_service(server, servicer)
    health = health_aio.HealthServicer()
    for name in HEALTH_SERVICE_NAMES:
        await health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
        server,
    )
    bind = f"{_bracket(host)}:{port}"
    try:
        bound = server.add_secure_port(bind, tls.server_credentials()) if tls else server.add_insecure_port(bind)
    except RuntimeError as e:
        raise OSError(f"could not bind {bind}: {e}") from None
    if not bound:
        raise OSError(f"could not bind {bind}")
    await server.start()
    router = RouterServer(server, servicer, health, host, bound)
    if http_port is not None:
        app = create_app(core, model_name=model_name, chat_template=chat_template, token=token,
                         max_body_bytes=max_message_bytes, is_serving=lambda: router.is_ready, tool_parser=tool_parser)
        router.http = HTTPServer(app, host, http_port, tls, http_limits, lambda refusal: core.rejected(
            "http", refusal.status_name, "-", "", refusal.value, log=False))    # the guard logs, rate limited
        try:
            await router.http.start()
        except BaseException:
            router.http = None
            await server.stop(None)
            raise
    if not tls and not is_loopback(host):
        log_event("insecure_bind", logging.WARNING, address=router.address,
                  note="the bearer token travels in cleartext; configure TLS")
    http_fields = {"http": router.http_url, "model": model_name,
                   "chat_template": "default" if chat_template.is_default else "model"} if router.http else {}
    log_event("started", address=router.address, tls=tls is not None, auth=token is not None,
              max_queue=max_queue, **http_fields)
    router._start_ready_watch(backend, ready_poll_s)
    return router


async def serve_until_signal(
    server: RouterServer,
    *,
    drain_timeout: float = 30.0,
    grace: float = 5.0,
    signals: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT),
) -> bool:
    """Serve until SIGTERM/SIGINT, then drain and stop (call from the main thread's loop).

    Health turns NOT_SERVING and new requests get UNAVAILABLE at once;
    in-flight requests get ``drain_timeout`` seconds to finish, then ``grace``
    more before they are cancelled.

    Returns:
        True if every in-flight request finished during the drain.
    """
    loop = asyncio.get_running_loop()
    received = asyncio.Event()
    for sig in signals:
        loop.add_signal_handler(sig, received.set)
    try:
        await received.wait()
        log_event("signal_received", address=server.address)
        drained = await server.drain(drain_timeout)
        await server.stop(grace)
        return drained
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)


def _add_generation_service(server: grpc.aio.Server, servicer: GenerationServicer) -> None:
    # Registered by hand (not via the generated helper) so that an unparsable
    # request reaches the servicer and gets INVALID_ARGUMENT instead of INTERNAL.
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate,
            request_deserializer=parse_generate_request,
            response_serializer=pb.GenerateResponse.SerializeToString,
        ),
        "GetStats": grpc.unary_unary_rpc_method_handler(
            servicer.GetStats,
            request_deserializer=parse_stats_request,
            response_serializer=pb.GetStatsResponse.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
