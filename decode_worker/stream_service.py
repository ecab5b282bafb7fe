"""The token stream from a decode actor to the router: `pdserve.v1.DecodeStreamService` (worker.proto).

A gRPC server stream adds less per-token delay than a Ray streaming generator
(bench/serving/stream_latency.py measures both), so each decode (and colocated)
actor serves `Decode`: the request carries a `DecodeJob`, each response every
`DecodeEvent` produced since the last one. Cancelling the call aborts the request on the actor.

The internal secret travels in metadata (``TOKEN_KEY``) and is checked by an interceptor before
the request is read (`proto.internal_auth`); a request is at most `max_job_bytes` of the
actor's ``max_model_len``, an actor serves at most `MAX_DECODE_STREAMS` calls at once (more get
RESOURCE_EXHAUSTED), and with ``tls`` (an `InternalTLS`) both ends speak mutual TLS only.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import grpc

from engine.scheduling.loop import on_event_loop
from kv_transfer import TOKEN_KEY
from proto.internal_auth import AsyncTokenInterceptor, InternalTLS, TokenGate, add_port, open_channel
from proto.pdserve.v1 import generation_pb2, worker_pb2 as wpb, worker_pb2_grpc

if TYPE_CHECKING:
    from decode_worker.colocated import ColocatedWorker
    from decode_worker.worker import DecodeWorker

log = logging.getLogger(f"pdserve.{__name__}")

MAX_DECODE_STREAMS = 4096      # Decode calls one actor serves at once (running + waiting for KV)
JOB_OVERHEAD_BYTES = 64 << 10  # ids, sampling params with 16 stop strings of 256 characters, field tags
TOKEN_ID_BYTES = 5             # the longest varint of a uint32


def max_job_bytes(max_model_len: int) -> int:
    """The largest `DecodeRequest` an actor reads: prompt and resumed tokens fit in ``max_model_len``."""
    return JOB_OVERHEAD_BYTES + TOKEN_ID_BYTES * max_model_len


class DecodeStreamServer(worker_pb2_grpc.DecodeStreamServiceServicer):
    """Runs in the actor's event loop; `worker` emits from its loop thread.

    Args:
        worker: the actor's worker (`submit`, `abort`; ``engine.max_model_len`` sizes the request limit).
        token: the internal secret callers must present.
        host: the interface to listen on.
        tls: the node's internal certificates; set = mutual TLS only.
        max_streams: concurrent calls; more get RESOURCE_EXHAUSTED.
        max_request_bytes: the request limit (default `max_job_bytes` of the engine's ``max_model_len``).
    """

    def __init__(self, worker: DecodeWorker | ColocatedWorker, token: str, host: str = "127.0.0.1", *,
                 tls: InternalTLS | None = None, max_streams: int = MAX_DECODE_STREAMS,
                 max_request_bytes: int | None = None):
        self.worker, self.token, self.host, self.tls = worker, token, host, tls
        self.max_streams = max_streams
        self.max_request_bytes = max_request_bytes or max_job_bytes(worker.engine.max_model_len)
        self.endpoint = ""
        self._gate = TokenGate(TOKEN_KEY, token, message="{reason} cluster token")
        self._server: grpc.aio.Server | None = None
        self._owned: set[str] = set()       # request ids whose stream is open here (a duplicate's call owns none)
        self.num_open = 0                   # calls in progress

    @property
    def auth_failures(self) -> int:
        return self._gate.num_rejected

    def add_refusals(self, stats: dict) -> dict:
        """An actor's ``stats()`` with the calls this stream refused added to its refused connections."""
        refused = dict(stats.get("refused_connections", {}))
        refused["bad_token"] = refused.get("bad_token", 0) + self.auth_failures
        return {**stats, "refused_connections": refused}

    async def start(self) -> str:
        self._server = grpc.aio.server(interceptors=[AsyncTokenInterceptor(self._gate)],
                                       options=[("grpc.max_receive_message_length", self.max_request_bytes)],
                                       maximum_concurrent_rpcs=self.max_streams)
        worker_pb2_grpc.add_DecodeStreamServiceServicer_to_server(self, self._server)
        port = add_port(self._server, f"{self.host}:0", self.tls)
        if port == 0:
            raise OSError(f"cannot bind the decode token stream to {self.host}")
        await self._server.start()
        self.endpoint = f"{self.host}:{port}"
        return self.endpoint

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(0.5)

    async def Decode(self, request: wpb.DecodeRequest,  # noqa: N802 — the proto's method name
                     context: grpc.aio.ServicerContext) -> AsyncIterator[wpb.DecodeResponse]:
        job = request.job
        queue: asyncio.Queue[tuple[float, wpb.DecodeEvent]] = asyncio.Queue()
        put = on_event_loop(asyncio.get_running_loop(), queue.put_nowait)
        # a second call for a running request id is answered ALREADY_EXISTS by the worker; going away early, it
        # must not abort the request the first call streams
        owner = job.request_id not in self._owned
        self._owned.add(job.request_id)
        self.num_open += 1
        finished = False
        open_sequences = job.params.best_of or job.params.n or 1     # the stream ends after each one's finish
        try:
            self.worker.submit(job, lambda ev: put((time.monotonic(), ev)))      # stamped as made (timeline)
            while not finished:
                response = wpb.DecodeResponse(events=[_stamped(await queue.get())])
                while not queue.empty():
                    response.events.append(_stamped(queue.get_nowait()))
                for ev in response.events:
                    open_sequences -= bool(ev.finish_reason)
                    ended = ev.error.code or ev.finish_reason == generation_pb2.FINISH_REASON_ABORT
                    finished = finished or bool(ended) or open_sequences <= 0
                yield response
        finally:
            self.num_open -= 1
            if owner:
                self._owned.discard(job.request_id)
                if not finished:        # the router went away or cancelled: free the request here
                    self.worker.abort(job.request_id)


def _stamped(item: tuple[float, wpb.DecodeEvent]) -> wpb.DecodeEvent:
    """The event; the request's first (the one with stages) learns how long it took to reach the stream."""
    made, ev = item
    if ev.HasField("stages"):
        ev.stages.first_event_s = time.monotonic() - made
    return ev


class DecodeStreamClient:
    """Router side: one channel per decode actor, one call per request (mutual TLS with ``tls``)."""

    def __init__(self, token: str, tls: InternalTLS | None = None):
        self.token, self.tls = token, tls
        self._stubs: dict[str, tuple[grpc.aio.Channel, worker_pb2_grpc.DecodeStreamServiceStub]] = {}

    def open(self, endpoint: str, job: wpb.DecodeJob) -> grpc.aio.UnaryStreamCall:
        """Start the stream; iterate the call for `DecodeResponse`s; `cancel()` aborts."""
        entry = self._stubs.get(endpoint)
        if entry is None:
            channel = open_channel(endpoint, self.tls, asynchronous=True)
            entry = self._stubs[endpoint] = (channel, worker_pb2_grpc.DecodeStreamServiceStub(channel))
        return entry[1].Decode(wpb.DecodeRequest(job=job), metadata=((TOKEN_KEY, self.token),))

    async def forget(self, endpoint: str) -> None:
        """Close the channel to an endpoint no actor serves any more (restarted or removed)."""
        entry = self._stubs.pop(endpoint, None)
        if entry is not None:
            await entry[0].close()

    @property
    def num_channels(self) -> int:
        return len(self._stubs)

    async def close(self) -> None:
        for channel, _ in self._stubs.values():
            await channel.close()
        self._stubs.clear()
