"""Server-sent events and client disconnects for the HTTP front door.

`EventStream` is the streaming response: it sends ``data: ...`` events from an async iterator,
stops it when the client goes away (or the server stops) and runs its ``on_close`` exactly once.
`until_disconnected` runs a non-streamed request until done or until the client disconnects.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from starlette.types import Receive, Scope, Send

from router.openai_api.errors import APIError
from router.validation import RequestError

T = TypeVar("T")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


async def sse_events(events: AsyncIterator[dict]) -> AsyncIterator[bytes]:
    """Events as ``data: {json}`` lines; a failure becomes an error event; always ``data: [DONE]`` last."""
    async with contextlib.aclosing(events) as stream:
        try:
            async for event in stream:
                yield b"data: " + _json(event) + b"\n\n"
        except RequestError as e:
            yield b"data: " + _json(APIError.from_status(e.code, e.message).body()) + b"\n\n"
    yield b"data: [DONE]\n\n"


def _json(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode("utf-8")


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnected(receive: Receive, awaitable: Awaitable[T]) -> T:
    """Await ``awaitable``, cancelling it if the client disconnects first (then raise `ClientGone`)."""
    work = asyncio.ensure_future(awaitable)
    watch = asyncio.ensure_future(_wait_disconnect(receive))
    try:
        await asyncio.wait((work, watch), return_when=asyncio.FIRST_COMPLETED)
        if work.done():
            return work.result()
        raise ClientGone()
    finally:
        for task in (work, watch):
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, ClientGone, RequestError, StopAsyncIteration):
                    await task


class EventStream:
    """A ``text/event-stream`` response that stops (closing its source) when the client goes away.

    ``on_close`` runs exactly once, however the stream ends (finished, client gone, server stop).
    """

    def __init__(self, body: AsyncIterator[bytes], on_close: Callable[[], None], headers: dict[str, str]) -> None:
        self._body = body
        self._on_close = on_close
        self._headers = [(b"content-type", b"text/event-stream; charset=utf-8")] + [
            (k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in {**SSE_HEADERS, **headers}.items()]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        pump = asyncio.ensure_future(self._pump(send))
        watch = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            await asyncio.wait((pump, watch), return_when=asyncio.FIRST_COMPLETED)
            if pump.done() and not pump.cancelled() and pump.exception() is not None:
                exc = pump.exception()
                if not isinstance(exc, OSError):     # a send to a closed connection is a client gone
                    raise exc
        finally:
            for task in (pump, watch):
                if not task.done():
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError, OSError):
                        await task
            with contextlib.suppress(Exception):
                await self._body.aclose()
            self._on_close()

    async def _pump(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self._headers})
        async for data in self._body:
            await send({"type": "http.response.body", "body": data, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def all_or_none(awaitables: list[Awaitable[T]]) -> list[T]:
    """Await all; on the first failure cancel the rest and raise it."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        failed = next((t for t in tasks if t.done() and not t.cancelled() and t.exception() is not None), None)
        if failed is not None:
            raise failed.exception()
        return [t.result() for t in tasks]
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()
        for t in tasks:
            with contextlib.suppress(BaseException):
                await t
