"""The token stream from a decode actor to the router: `pdserve.v1.DecodeStreamService` (worker.proto).

Measured against a Ray streaming generator on this machine (bench/serving/stream_latency.py),
a gRPC server stream adds ~8x less per-token delay, so each decode (and colocated)
actor serves `Decode`: the request carries a `DecodeJob`, each response every
`DecodeEvent` produced since the last one. The cluster token travels in metadata.
Cancelling the call aborts the request on the actor.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import AsyncIterator

import grpc

from decode_worker.colocated import ColocatedWorker
from engine.loop import on_event_loop
from kv_transfer import TOKEN_KEY
from proto.pdserve.v1 import worker_pb2 as wpb, worker_pb2_grpc

log = logging.getLogger(f"pdserve.{__name__}")

MAX_JOB_BYTES = 16 << 20


class DecodeStreamServer(worker_pb2_grpc.DecodeStreamServiceServicer):
    """Runs in the actor's event loop; `worker` emits from its loop thread."""

    def __init__(self, worker: ColocatedWorker, token: str, host: str = "127.0.0.1"):
        self.worker, self.token, self.host = worker, token, host
        self.endpoint = ""
        self.auth_failures = 0
        self._server: grpc.aio.Server | None = None

    async def start(self) -> str:
        self._server = grpc.aio.server(options=[("grpc.max_receive_message_length", MAX_JOB_BYTES)])
        worker_pb2_grpc.add_DecodeStreamServiceServicer_to_server(self, self._server)
        port = self._server.add_insecure_port(f"{self.host}:0")
        await self._server.start()
        self.endpoint = f"{self.host}:{port}"
        return self.endpoint

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(0.5)

    async def Decode(self, request: wpb.DecodeRequest,  # noqa: N802 — the proto's method name
                     context: grpc.aio.ServicerContext) -> AsyncIterator[wpb.DecodeResponse]:
        presented = dict(context.invocation_metadata()).get(TOKEN_KEY, "")
        if not hmac.compare_digest(presented.encode(), self.token.encode()):
            self.auth_failures += 1
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "wrong cluster token")
        job = request.job
        queue: asyncio.Queue[wpb.DecodeEvent] = asyncio.Queue()
        self.worker.submit(job, on_event_loop(asyncio.get_running_loop(), queue.put_nowait))
        finished = False
        try:
            while not finished:
                response = wpb.DecodeResponse(events=[await queue.get()])
                while not queue.empty():
                    response.events.append(queue.get_nowait())
                finished = any(ev.finish_reason or ev.error.code for ev in response.events)
                yield response
        finally:
            if not finished:            # the router went away or cancelled: free the request here
                self.worker.abort(job.request_id)


class DecodeStreamClient:
    """Router side: one channel per decode actor, one call per request."""

    def __init__(self, token: str):
        self.token = token
        self._stubs: dict[str, tuple[grpc.aio.Channel, worker_pb2_grpc.DecodeStreamServiceStub]] = {}

    def open(self, endpoint: str, job: wpb.DecodeJob) -> grpc.aio.UnaryStreamCall:
        """Start the stream; iterate the call for `DecodeResponse`s; `cancel()` aborts."""
        entry = self._stubs.get(endpoint)
        if entry is None:
            channel = grpc.aio.insecure_channel(endpoint)
            entry = self._stubs[endpoint] = (channel, worker_pb2_grpc.DecodeStreamServiceStub(channel))
        return entry[1].Decode(wpb.DecodeRequest(job=job), metadata=((TOKEN_KEY, self.token),))

    async def close(self) -> None:
        for channel, _ in self._stubs.values():
            await channel.close()
        self._stubs.clear()
