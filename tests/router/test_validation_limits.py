"""Huge `token_ids`: refused at once by their count, validated without
blocking the event loop, while a small request on the same router keeps streaming."""
from __future__ import annotations

import asyncio
import threading
import time

import grpc

from proto.pdserve.v1 import generation_pb2 as pb
from router import build_request

MAX_STALL_S = 0.3       # the router's loop may be held up at most this long (the old code: 0.4-1.8 s; parsing < 0.15 s)
BIG_MESSAGES = 64 << 20  # room for the huge requests, so the router itself sees them


class LoopLagProbe:
    """How long the router's loop was held up by work in this process: a 5 ms timer fires late when the
    loop is blocked. A machine busy with other processes makes it late too, but then this process burns
    little CPU meanwhile, so each lateness counts only up to the CPU time the process used during it."""

    def __init__(self, loop_thread) -> None:
        self.stalls: list[tuple[float, float]] = []      # (wall lateness, process CPU seconds during it)
        self._stop = asyncio.Event()
        self._task = loop_thread.submit(self._run())
        self._loop_thread = loop_thread

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._stop.is_set():
            start, cpu = loop.time(), time.process_time()
            await asyncio.sleep(0.005)
            self.stalls.append((loop.time() - start - 0.005, time.process_time() - cpu))

    def stop(self) -> float:
        """The longest stall, counted as min(lateness, CPU this process used meanwhile)."""
        self._loop_thread.loop.call_soon_threadsafe(self._stop.set)
        self._task.result(5)
        return max(min(late, cpu) for late, cpu in self.stalls)


class SmallStream:
    """A small request streaming in a thread; records when each token message arrived."""

    def __init__(self, address: str, max_tokens: int) -> None:
        self.arrivals: list[float] = []
        self.messages: list[pb.GenerateResponse] = []
        self._channel = grpc.insecure_channel(address)
        self._thread = threading.Thread(target=self._run, args=(max_tokens,), daemon=True)
        self._thread.start()

    def _run(self, max_tokens: int) -> None:
        from proto.pdserve.v1 import generation_pb2_grpc as pb_grpc
        stub = pb_grpc.GenerationServiceStub(self._channel)
        request = build_request("hello", max_tokens=max_tokens, ignore_eos=True, request_id="small")
        for msg in stub.Generate(request, timeout=60):
            self.arrivals.append(time.monotonic())
            self.messages.append(msg)

    def join(self) -> None:
        self._thread.join(60)
        self._channel.close()


def _refusal(address: str, data: bytes) -> tuple[grpc.RpcError, float]:
    """Send a serialized GenerateRequest (serialized beforehand: the client shares this process's GIL)."""
    options = [("grpc.max_send_message_length", BIG_MESSAGES)]
    with grpc.insecure_channel(address, options=options) as channel:
        generate = channel.unary_stream("/pdserve.v1.GenerationService/Generate", request_serializer=None,
                                        response_deserializer=pb.GenerateResponse.FromString)
        start = time.monotonic()
        try:
            list(generate(data, timeout=30))
        except grpc.RpcError as e:
            return e, time.monotonic() - start
    raise AssertionError("the huge request was accepted")


def _huge_request(num_ids: int, last_id: int = 1) -> bytes:
    ids = [1] * num_ids
    ids[-1] = last_id
    return pb.GenerateRequest(request_id="huge", token_ids=pb.TokenIds(ids=ids),
                              sampling=pb.SamplingParams(max_tokens=4)).SerializeToString()


def _refuse_beside_a_stream(serve, make_backend, loop_thread, wait_until, max_model_len: int,
                            request: bytes) -> tuple[grpc.RpcError, float, float]:
    """Send ``request`` while a small request streams (it must finish intact); (error, seconds, loop stall)."""
    running = serve(make_backend(max_model_len=max_model_len, token_delay_s=0.01), max_message_bytes=BIG_MESSAGES)
    small = SmallStream(running.address, max_tokens=150)
    wait_until(lambda: len(small.arrivals) >= 3)
    probe = LoopLagProbe(loop_thread)
    error, elapsed = _refusal(running.address, request)
    stall = probe.stop()
    small.join()
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "huge" not in running.backend.inputs
    assert small.messages[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert sum(len(m.token_ids) for m in small.messages) == 150
    return error, elapsed, stall


def test_five_million_token_ids_refused_fast_without_stalling_other_streams(serve, make_backend, loop_thread,
                                                                           wait_until):
    error, elapsed, stall = _refuse_beside_a_stream(serve, make_backend, loop_thread, wait_until, 4096,
                                                    _huge_request(5_000_000))
    assert "5000000 tokens" in error.details() and "max_model_len (4096)" in error.details()
    assert elapsed < 5.0
    assert stall < MAX_STALL_S, f"the router's loop stalled {stall:.3f}s"


def test_large_in_budget_token_ids_are_checked_off_the_loop(serve, make_backend, loop_thread, wait_until):
    """Ids that fit max_model_len are still range-checked (naming the first bad index) without a stall."""
    error, _, stall = _refuse_beside_a_stream(serve, make_backend, loop_thread, wait_until, 10_000_000,
                                              _huge_request(8_000_000, last_id=258))
    assert "token_ids.ids[7999999] = 258" in error.details() and "vocab_size is 258" in error.details()
    assert stall < MAX_STALL_S, f"the router's loop stalled {stall:.3f}s"
