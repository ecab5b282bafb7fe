"""The decode token stream's guards (decode_worker/stream_service.py): the token is checked before the
request is read, a request is bounded by max_model_len, calls by max_streams, and with internal TLS
only mutual-TLS clients get through. A fake worker stands in for the engine."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import pytest
from tls_support import make_certs

from decode_worker.stream_service import DecodeStreamClient, DecodeStreamServer, max_job_bytes
from kv_transfer import TOKEN_KEY
from proto.internal_auth import InternalTLS
from proto.pdserve.v1 import generation_pb2, worker_pb2 as wpb

SECRET = "internal-secret"
MAX_MODEL_LEN = 256
DECODE = "/pdserve.v1.DecodeStreamService/Decode"


class FakeWorker:
    """Answers each job with one finished event, or holds it (``hold``) until the call is cancelled."""

    def __init__(self, hold: bool = False) -> None:
        self.engine = SimpleNamespace(max_model_len=MAX_MODEL_LEN)
        self.hold = hold
        self.jobs: list[wpb.DecodeJob] = []
        self.aborted: list[str] = []

    def submit(self, job: wpb.DecodeJob, emit) -> None:
        self.jobs.append(job)
        if not self.hold:
            emit(wpb.DecodeEvent(token_ids=[7], text="x", finish_reason=generation_pb2.FINISH_REASON_STOP))

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 60))


async def _served(worker: FakeWorker, **options) -> DecodeStreamServer:
    server = DecodeStreamServer(worker, SECRET, "127.0.0.1", **options)
    await server.start()
    return server


async def _code(call) -> grpc.StatusCode:
    try:
        async for _ in call:
            pass
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def _job(request_id: str = "r1", num_tokens: int = 4) -> wpb.DecodeRequest:
    return wpb.DecodeRequest(job=wpb.DecodeJob(request_id=request_id, prompt_token_ids=[100_000] * num_tokens))


def test_wrong_token_is_refused_before_the_request_is_read():
    async def main():
        worker = FakeWorker()
        server = await _served(worker)
        try:
            async with grpc.aio.insecure_channel(server.endpoint, options=[("grpc.max_send_message_length", -1)]) \
                    as channel:
                decode = channel.unary_stream(DECODE)
                # 17 MiB: over any limit the server reads (16 MiB before this fix, ~66 KiB now), so a
                # server that read it first would answer RESOURCE_EXHAUSTED
                big = bytes(17 << 20)
                assert await _code(decode(big, metadata=((TOKEN_KEY, "wrong"),), timeout=30)) == \
                    grpc.StatusCode.UNAUTHENTICATED
                assert await _code(decode(big, timeout=30)) == grpc.StatusCode.UNAUTHENTICATED
                good = _job().SerializeToString()
                assert await _code(decode(good, metadata=((TOKEN_KEY, SECRET),), timeout=30)) == grpc.StatusCode.OK
            assert server.auth_failures == 2 and [job.request_id for job in worker.jobs] == ["r1"]
        finally:
            await server.stop()

    run(main())


def test_request_over_the_bound_of_max_model_len_is_refused():
    async def main():
        worker = FakeWorker()
        server = await _served(worker)
        client = DecodeStreamClient(SECRET)
        try:
            fits = _job("fits", MAX_MODEL_LEN)
            too_big = _job("too-big", max_job_bytes(MAX_MODEL_LEN) // 3 + 1)    # 3 bytes per id
            assert fits.ByteSize() < max_job_bytes(MAX_MODEL_LEN) < too_big.ByteSize()
            assert await _code(client.open(server.endpoint, fits.job)) == grpc.StatusCode.OK
            assert await _code(client.open(server.endpoint, too_big.job)) == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert [job.request_id for job in worker.jobs] == ["fits"]
        finally:
            await client.close()
            await server.stop()

    run(main())


def test_calls_over_max_streams_are_refused():
    async def main():
        worker = FakeWorker(hold=True)
        server = await _served(worker, max_streams=2)
        client = DecodeStreamClient(SECRET)
        try:
            held = [client.open(server.endpoint, _job(f"held-{i}").job) for i in range(2)]
            while len(worker.jobs) < 2:              # both calls are running on the server
                await asyncio.sleep(0.01)
            assert await _code(client.open(server.endpoint, _job("third").job)) == grpc.StatusCode.RESOURCE_EXHAUSTED
            for call in held:
                call.cancel()
            while len(worker.aborted) < 2:           # cancelling a call aborts its request on the actor
                await asyncio.sleep(0.01)
            assert sorted(worker.aborted) == ["held-0", "held-1"]
        finally:
            await client.close()
            await server.stop()

    run(main())


def test_a_duplicate_call_going_away_leaves_the_running_request_alone():
    """A second call for a request id already streaming here (the worker answers it ALREADY_EXISTS), cancelled
    before it reads that answer, must not abort the request the first call streams."""
    async def main():
        worker = FakeWorker(hold=True)
        server = await _served(worker)
        client = DecodeStreamClient(SECRET)
        try:
            first = client.open(server.endpoint, _job("r1").job)
            while len(worker.jobs) < 1:
                await asyncio.sleep(0.01)
            duplicate = client.open(server.endpoint, _job("r1").job)
            while len(worker.jobs) < 2:              # the duplicate reached the worker
                await asyncio.sleep(0.01)
            duplicate.cancel()
            while server.num_open > 1:               # the duplicate's call has ended on the server
                await asyncio.sleep(0.01)
            assert worker.aborted == []
            first.cancel()
            while not worker.aborted:
                await asyncio.sleep(0.01)
            assert worker.aborted == ["r1"] and server.num_open == 0
        finally:
            await client.close()
            await server.stop()

    run(main())


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certs(tmp_path_factory.mktemp("certs"))


def test_with_internal_tls_plaintext_is_refused_and_mutual_tls_streams(certs):
    def tls(name: str) -> InternalTLS:
        return InternalTLS(str(certs / f"{name}.pem"), str(certs / f"{name}.key"), str(certs / "ca.pem"))

    async def main():
        worker = FakeWorker()
        server = await _served(worker, tls=tls("node"))
        clients = {"plaintext": DecodeStreamClient(SECRET), "rogue CA": DecodeStreamClient(SECRET, tls("rogue")),
                   "mutual TLS": DecodeStreamClient(SECRET, tls("node"))}
        try:
            codes = {what: await _code(client.open(server.endpoint, _job(what).job))
                     for what, client in clients.items()}
            assert codes == {"plaintext": grpc.StatusCode.UNAVAILABLE, "rogue CA": grpc.StatusCode.UNAVAILABLE,
                             "mutual TLS": grpc.StatusCode.OK}
            assert [job.request_id for job in worker.jobs] == ["mutual TLS"]
        finally:
            for client in clients.values():
                await client.close()
            await server.stop()

    run(main())
