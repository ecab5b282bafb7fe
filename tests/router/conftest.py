"""Router test factories: a byte-level tokenizer, a deterministic `FakeBackend`,
an event loop in a background thread, and a `serve` fixture that starts routers on it.

Tests talk to the router through real gRPC (sync stubs on 127.0.0.1); the
server and the fake backend run on the loop thread.
"""
from __future__ import annotations

import asyncio
import codecs
import threading
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest

from proto.pdserve.v1 import generation_pb2 as pb, generation_pb2_grpc as pb_grpc
from waiting import wait_until
from router import (
    ActorStats,
    Backend,
    BackendError,
    GenerationChunk,
    GenerationInput,
    RouterServer,
    Timing,
    Usage,
    start_server,
)

EOS_TOKEN_ID = 257


class ByteTokenizer:
    """Token id = UTF-8 byte (0..255); 256 = BOS, 257 = EOS."""

    vocab_size = 258
    eos_token_id = EOS_TOKEN_ID

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: list[int]) -> str:
        return bytes(t for t in token_ids if t < 256).decode("utf-8", errors="replace")


class FakeBackend(Backend):
    """Generates the prompt's token ids reversed (cycled) — deterministic and checkable.

    Honours max_tokens ("length"), EOS unless ignore_eos ("stop"), and stop
    strings ("stop"); text deltas come from an incremental UTF-8 decoder, so
    they never split a character. Records every request's fate.

    Attributes:
        release: while cleared, generation waits (keeps requests in flight).
        fail_with: raised instead of generating, when set.
        no_finish: end the stream without a finish reason (a broken backend).
    """

    def __init__(self, max_model_len: int = 128, token_delay_s: float = 0.0) -> None:
        self.tokenizer = ByteTokenizer()
        self.max_model_len = max_model_len
        self.token_delay_s = token_delay_s
        self.is_ready = True
        self.release = threading.Event()
        self.release.set()
        self.fail_with: BackendError | None = None
        self.no_finish = False
        self.inputs: dict[str, GenerationInput] = {}
        self.active: set[str] = set()
        self.finished: list[str] = []
        self.cancelled: list[str] = []
        self.failed: list[str] = []

    def expected_token_ids(self, prompt_token_ids: list[int], max_tokens: int) -> list[int]:
        reversed_ids = prompt_token_ids[::-1]
        return [reversed_ids[i % len(reversed_ids)] for i in range(max_tokens)]

    async def generate(self, inp: GenerationInput):
        rid = inp.request_id
        self.inputs[rid] = inp
        self.active.add(rid)
        try:
            while not self.release.is_set():
                await asyncio.sleep(0.005)
            if self.fail_with is not None:
                self.failed.append(rid)
                raise self.fail_with
            params = inp.params
            decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
            text = ""
            outputs = self.expected_token_ids(inp.prompt_token_ids, params.max_tokens)
            for i, token_id in enumerate(outputs):
                await asyncio.sleep(self.token_delay_s)
                delta = decoder.decode(bytes([token_id]) if token_id < 256 else b"")
                text += delta
                finish = None
                if token_id == EOS_TOKEN_ID and not params.ignore_eos:
                    finish = pb.FINISH_REASON_STOP
                elif any(s in text[-(len(s) + len(delta)):] for s in params.stop):
                    finish = pb.FINISH_REASON_STOP
                elif i + 1 == len(outputs):
                    finish = pb.FINISH_REASON_LENGTH
                if finish is not None:
                    delta += decoder.decode(b"", final=True)  # flush a trailing partial character
                if finish is None:
                    yield GenerationChunk([token_id], delta, None)
                    continue
                if self.no_finish:
                    break
                usage = Usage(len(inp.prompt_token_ids), i + 1, 0)
                timing = Timing(queue_s=0.001, prefill_s=0.002, kv_transfer_s=0.003, decode_queue_s=0.004)
                self.finished.append(rid)
                yield GenerationChunk([token_id], delta, finish, usage, timing)
                return
        except (asyncio.CancelledError, GeneratorExit):
            self.cancelled.append(rid)
            raise
        finally:
            self.active.discard(rid)

    async def stats(self) -> list[ActorStats]:
        return [
            ActorStats("prefill-0", pb.ACTOR_ROLE_PREFILL, 64, 3, 1, 0),
            ActorStats("decode-0", pb.ACTOR_ROLE_DECODE, 128, len(self.active), 0, len(self.active)),
        ]

    async def ready(self) -> bool:
        return self.is_ready


class LoopThread:
    """An asyncio loop running in a daemon thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="router-test-loop", daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 10.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def submit(self, coro: Coroutine[Any, Any, Any]):
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)


@dataclass
class Running:
    """A started router and its fake backend."""

    server: RouterServer
    backend: FakeBackend
    loop: LoopThread

    @property
    def address(self) -> str:
        return self.server.address

    def stub(self, channel: grpc.Channel) -> pb_grpc.GenerationServiceStub:
        return pb_grpc.GenerationServiceStub(channel)


@pytest.fixture
def make_backend() -> Callable[..., FakeBackend]:
    """Factory for `FakeBackend` (tests can't import conftest by name safely)."""
    return FakeBackend


@pytest.fixture(name="wait_until")
def wait_until_fixture() -> Callable[..., None]:
    return wait_until


@pytest.fixture(scope="session")
def loop_thread() -> Iterator[LoopThread]:
    lt = LoopThread()
    yield lt
    lt.close()


@pytest.fixture
def serve(loop_thread: LoopThread) -> Iterator[Callable[..., Running]]:
    """Factory: ``serve(backend=None, wait_ready=True, **start_server_kwargs) -> Running``.

    On teardown every server stops and each backend must hold no request (leak check).
    """
    started: list[Running] = []

    def start(backend: FakeBackend | None = None, wait_ready: bool = True, **kwargs: Any) -> Running:
        backend = backend or FakeBackend()
        kwargs.setdefault("ready_poll_s", 0.01)
        server = loop_thread.run(start_server(backend, **kwargs))
        running = Running(server, backend, loop_thread)
        started.append(running)
        if wait_ready:
            assert loop_thread.run(server.wait_ready(5.0))
        return running

    yield start
    for running in started:
        running.backend.release.set()
        loop_thread.run(running.server.stop(0))
        wait_until(lambda: not running.backend.active, 5.0)
        assert running.server.core.num_in_flight == 0


@pytest.fixture
def server(serve: Callable[..., Running]) -> Running:
    """A ready router on 127.0.0.1 over a default `FakeBackend`."""
    return serve()


@pytest.fixture
def channel(server: Running) -> Iterator[grpc.Channel]:
    ch = grpc.insecure_channel(server.address)
    yield ch
    ch.close()
