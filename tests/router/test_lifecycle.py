"""Health, readiness, drain, stop, reflection, cancellation, deadlines and overload."""
from __future__ import annotations

import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from proto.pdserve.v1 import generation_pb2 as pb
from router import build_request, generate

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _health(channel: grpc.Channel, service: str = "") -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def _stream_in_thread(address: str, **kwargs) -> tuple[threading.Thread, list]:
    """Run one Generate call on a thread; its responses or its RpcError land in the list."""
    out: list = []

    def run() -> None:
        try:
            out.append(list(generate(address, timeout=10, **kwargs)))
        except grpc.RpcError as e:
            out.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


def test_health_serving_for_both_names(server, channel):
    assert _health(channel, "") == SERVING
    assert _health(channel, "pdserve.v1.GenerationService") == SERVING


def test_not_serving_until_backend_ready(serve, make_backend):
    backend = make_backend()
    backend.is_ready = False
    running = serve(backend, wait_ready=False)
    with grpc.insecure_channel(running.address) as ch:
        assert _health(ch) == NOT_SERVING
        with pytest.raises(grpc.RpcError) as e:
            list(running.stub(ch).Generate(build_request("abc"), timeout=5))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "not ready" in e.value.details()
        backend.is_ready = True
        assert running.loop.run(running.server.wait_ready(5))
        assert _health(ch, "pdserve.v1.GenerationService") == SERVING


def test_drain_refuses_new_requests_and_lets_in_flight_finish(server, channel, wait_until):
    server.backend.release.clear()
    thread, out = _stream_in_thread(server.address, prompt="abc", request_id="inflight", max_tokens=3)
    wait_until(lambda: "inflight" in server.backend.active)
    drained = server.loop.submit(server.server.drain(timeout=10))
    wait_until(lambda: _health(channel) == NOT_SERVING)
    assert _health(channel, "pdserve.v1.GenerationService") == NOT_SERVING
    with pytest.raises(grpc.RpcError) as e:
        list(server.stub(channel).Generate(build_request("new"), timeout=5))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in e.value.details()
    assert not drained.done()
    server.backend.release.set()
    assert drained.result(10) is True
    thread.join(10)
    assert "".join(r.text for r in out[0]) == "cba"
    assert out[0][-1].finish_reason == pb.FINISH_REASON_LENGTH


def test_stop_cancels_in_flight_after_grace(serve, make_backend, wait_until):
    running = serve(make_backend(token_delay_s=0.05))
    thread, out = _stream_in_thread(running.address, prompt="abcdef", request_id="long", max_tokens=100)
    wait_until(lambda: "long" in running.backend.active)
    running.loop.run(running.server.stop(grace=0.1))
    thread.join(10)
    assert isinstance(out[0], grpc.RpcError)
    wait_until(lambda: "long" in running.backend.cancelled)


def test_reflection_lists_and_describes_the_service(server, channel):
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    requests = [
        reflection_pb2.ServerReflectionRequest(list_services=""),
        reflection_pb2.ServerReflectionRequest(file_containing_symbol="pdserve.v1.GenerationService"),
    ]
    listed, described = list(stub.ServerReflectionInfo(iter(requests), timeout=5))
    names = {s.name for s in listed.list_services_response.service}
    assert {"pdserve.v1.GenerationService", "grpc.health.v1.Health"} <= names
    assert described.file_descriptor_response.file_descriptor_proto  # the .proto is served


def test_client_cancel_propagates_to_backend(serve, make_backend, wait_until):
    running = serve(make_backend(token_delay_s=0.02))
    with grpc.insecure_channel(running.address) as ch:
        call = running.stub(ch).Generate(build_request("abcdef", request_id="c1", max_tokens=100), timeout=10)
        first = [next(call), next(call)]
        assert [r.text for r in first] == ["f", "e"]
        call.cancel()
    wait_until(lambda: "c1" in running.backend.cancelled)
    wait_until(lambda: running.server.core.num_in_flight == 0)
    assert "c1" not in running.backend.finished


def test_deadline_cancels_backend_and_is_carried_in_input(serve, make_backend, wait_until):
    running = serve(make_backend(token_delay_s=0.05))
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:
        list(generate(running.address, "abcdef", request_id="d1", max_tokens=100, timeout=0.3))
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_until(lambda: "d1" in running.backend.cancelled)
    deadline = running.backend.inputs["d1"].deadline
    assert deadline is not None and start < deadline < start + 0.5


def test_overload_gives_resource_exhausted_quickly(serve, wait_until):
    running = serve(max_queue=2)
    running.backend.release.clear()
    workers = [_stream_in_thread(running.address, prompt="abc", request_id=f"q{i}", max_tokens=2) for i in range(2)]
    wait_until(lambda: len(running.backend.active) == 2)
    latencies = []
    for _ in range(5):
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as e:
            list(generate(running.address, "abc", timeout=5))
        latencies.append(time.monotonic() - t0)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "capacity" in e.value.details() and "2" in e.value.details()
    assert max(latencies) < 0.5
    running.backend.release.set()
    for thread, out in workers:
        thread.join(10)
        assert out[0][-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert list(generate(running.address, "abc", max_tokens=1, timeout=5))  # admitted again
