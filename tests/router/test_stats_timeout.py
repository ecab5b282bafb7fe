"""A backend whose stats() never returns: GetStats still answers within its
bound (without actor stats, logged once), and the metrics poll keeps polling."""
from __future__ import annotations

import asyncio
import logging
import time

import grpc
import pytest

from proto.pdserve.v1 import generation_pb2 as pb
from router.metrics import poll_stats

STATS_TIMEOUT_S = 0.3


@pytest.fixture
def hanging_backend(make_backend):
    """A FakeBackend whose stats() hangs forever while ``hang`` is set."""

    class HangingStats(make_backend):
        def __init__(self) -> None:
            super().__init__()
            self.hang = True
            self.stats_calls = 0

        async def stats(self):
            self.stats_calls += 1
            if self.hang:
                await asyncio.Event().wait()          # never set: the call never returns
            return await super().stats()

    return HangingStats()


def _get_stats(address: str) -> tuple[pb.GetStatsResponse, float]:
    from proto.pdserve.v1 import generation_pb2_grpc as pb_grpc
    with grpc.insecure_channel(address) as channel:
        start = time.monotonic()
        response = pb_grpc.GenerationServiceStub(channel).GetStats(pb.GetStatsRequest(), timeout=10)
        return response, time.monotonic() - start


def _events(caplog, name: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if getattr(r, "event", "") == name]


def test_get_stats_answers_without_the_actors_when_stats_hang(serve, hanging_backend, caplog):
    caplog.set_level(logging.INFO, logger="pdserve.router")
    running = serve(hanging_backend)
    running.server.servicer.stats_timeout_s = STATS_TIMEOUT_S

    first, elapsed = _get_stats(running.address)
    second, _ = _get_stats(running.address)

    assert elapsed < STATS_TIMEOUT_S + 2.0
    assert list(first.actors) == [] and list(second.actors) == []
    assert first.router_in_flight_requests == 0
    assert len(_events(caplog, "stats_timeout")) == 1          # once, not per call
    assert hanging_backend.stats_calls == 2

    hanging_backend.hang = False
    answered, _ = _get_stats(running.address)
    assert [a.actor_id for a in answered.actors] == ["prefill-0", "decode-0"]
    assert len(_events(caplog, "stats_recovered")) == 1


def test_default_bound_is_a_few_seconds(serve, hanging_backend):
    running = serve(hanging_backend)
    assert 1.0 <= running.server.servicer.stats_timeout_s <= 5.0


class _RecordingMetrics:
    def __init__(self) -> None:
        self.observed: list[list] = []

    def observe_stats(self, stats) -> None:
        self.observed.append(list(stats))


def test_metrics_poll_skips_a_hanging_stats_call_and_polls_again(hanging_backend, wait_until, loop_thread):
    metrics = _RecordingMetrics()
    task = loop_thread.submit(poll_stats(hanging_backend, metrics, interval_s=0.01, timeout_s=STATS_TIMEOUT_S))
    try:
        wait_until(lambda: hanging_backend.stats_calls >= 2, 5.0)       # the first call timed out, the poll went on
        assert metrics.observed == []
        hanging_backend.hang = False
        wait_until(lambda: metrics.observed, 5.0)
        assert [s.actor_id for s in metrics.observed[-1]] == ["prefill-0", "decode-0"]
    finally:
        task.cancel()
