"""Health follows the backend's readiness for as long as the router runs:
SERVING, NOT_SERVING once every decode actor is gone, SERVING again when one is back."""
from __future__ import annotations

import asyncio
import logging

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _health(channel: grpc.Channel, service: str = "") -> int:
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def _both(channel: grpc.Channel) -> tuple[int, int]:
    return _health(channel, ""), _health(channel, "pdserve.v1.GenerationService")


def _events(caplog) -> list[str]:
    return [r.event for r in caplog.records if getattr(r, "event", "") in ("ready", "not_ready")]


def test_health_follows_readiness_both_ways(serve, make_backend, wait_until, caplog):
    caplog.set_level(logging.INFO, logger="pdserve.router")
    backend = make_backend()
    running = serve(backend)
    with grpc.insecure_channel(running.address) as channel:
        assert _both(channel) == (SERVING, SERVING)

        backend.is_ready = False                      # e.g. every decode actor is gone
        wait_until(lambda: _both(channel) == (NOT_SERVING, NOT_SERVING))
        assert not running.server.is_ready

        backend.is_ready = True
        wait_until(lambda: _both(channel) == (SERVING, SERVING))
        assert running.server.is_ready
    assert _events(caplog) == ["ready", "not_ready", "ready"]     # each transition logged once


def test_a_hanging_or_failing_probe_counts_as_not_ready(serve, make_backend, wait_until, monkeypatch):
    monkeypatch.setattr("router.server.READY_PROBE_TIMEOUT_S", 0.2)
    class Probe(make_backend):
        mode = "ok"

        async def ready(self) -> bool:
            if self.mode == "hang":
                await asyncio.Event().wait()
            if self.mode == "fail":
                raise RuntimeError("probe broke")
            return True

    backend = Probe()
    running = serve(backend)
    with grpc.insecure_channel(running.address) as channel:
        for broken in ("fail", "hang"):
            backend.mode = broken
            wait_until(lambda: _health(channel) == NOT_SERVING)
            backend.mode = "ok"
            wait_until(lambda: _health(channel) == SERVING)
