"""SIGTERM drains a real router process: NOT_SERVING, new requests refused, in-flight finish, exit 0."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proto.pdserve.v1 import generation_pb2 as pb
from proto.pdserve.v1 import generation_pb2_grpc as pb_grpc
from router import build_request

REPO = Path(__file__).resolve().parents[2]
SCRIPT = textwrap.dedent("""
    import asyncio, sys
    sys.path[:0] = ["tests/router", "tests"]
    from conftest import FakeBackend
    from router import configure_logging, serve_until_signal, start_server

    async def main():
        configure_logging("json")
        server = await start_server(FakeBackend(token_delay_s=0.02), ready_poll_s=0.01)
        await server.wait_ready(5)
        print(server.port, flush=True)
        sys.exit(0 if await serve_until_signal(server, drain_timeout=10, grace=1) else 3)

    asyncio.run(main())
""")


@pytest.mark.timeout(60)
def test_sigterm_drains_and_exits(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        address = f"127.0.0.1:{int(proc.stdout.readline())}"
        with grpc.insecure_channel(address) as ch:
            stub = pb_grpc.GenerationServiceStub(ch)
            call = stub.Generate(build_request("abcdefgh", max_tokens=40), timeout=20)
            first = next(call)
            proc.send_signal(signal.SIGTERM)
            health = health_pb2_grpc.HealthStub(ch)
            serving = health_pb2.HealthCheckResponse.SERVING
            while health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == serving:
                pass
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(build_request("new"), timeout=5))
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            rest = list(call)
        assert 1 + len(rest) == 40 and rest[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert first.text + "".join(r.text for r in rest) == ("hgfedcba" * 5)
        assert proc.wait(timeout=20) == 0
        events = [json.loads(line)["event"] for line in proc.stderr.read().splitlines() if line.startswith("{")]
        lifecycle = [e for e in events if not e.startswith("request_")]
        assert lifecycle == ["started", "ready", "signal_received", "draining", "drained", "stopped"]
        assert events.count("request_finished") == 1 and events.count("request_rejected") == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
