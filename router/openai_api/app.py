"""The OpenAI-compatible HTTP app (Starlette) over the router's `RequestCore`.

Endpoints:

- ``POST /v1/completions``, ``POST /v1/chat/completions``: JSON, or server-sent events with
  ``"stream": true`` (ending ``data: [DONE]``). Admission is the gRPC front door's (same
  in-flight limit, draining, readiness); a stream's response starts with its first token, so a
  failure before it gets a proper status; a failure after it is sent as a ``data: {"error": ...}``
  event, then ``[DONE]``.
- ``GET /v1/models``, ``GET /v1/models/{model}``: the served model.
- ``GET /health``: 200 when ready, 503 when not ready or draining (no token needed).
- ``POST /tokenize`` (``{"prompt"}`` or ``{"messages"[, "tools"]}`` → ``{"count", "max_model_len",
  "tokens"}``), ``POST /detokenize`` (``{"tokens"}`` → ``{"prompt"}``), as vLLM shapes them.

Structured outputs (``response_format``, ``guided_*``): structured.py; a chat request's tools (checked
before admission, forced by a grammar or parsed from the text): tools.py and tool_parsers.py.

Every other request needs ``Authorization: Bearer <token>`` when the server has a token (else
401). Bodies over ``max_body_bytes`` get 413. ``X-Request-Id`` sets the request id (as gRPC's
``request_id``; echoed in the response header); errors are `router.openai_api.errors.APIError` bodies.
A client that disconnects cancels its request (the backend frees it).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from router.backend import GenerationChunk, Usage
from router.best_of import needs_selection
from router.log import log_event
from router.openai_api.chat import ChatView
from router.openai_api.chat_template import ChatTemplate
from router.openai_api.completions import CompletionView
from router.openai_api.errors import STATUS_TO_HTTP, APIError
from router.openai_api.inputs import api_error, chat_input, chat_prompt_ids, completion_input, split_prompts
from router.openai_api.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, \
    TokenizeRequest, ignored_fields, parse_body
from router.openai_api.responses import usage_json
from router.openai_api.sse import ClientGone, EventStream, all_or_none, sse_events, until_disconnected
from router.openai_api.tool_parsers import tool_format
from router.openai_api.tools import tool_request
from router.security import check_http_bearer
from router.request_core import THREAD_TOKENIZE_CHARS, AdmittedRequest, RequestCore
from router.validation import MAX_REQUEST_ID_CHARS, THREAD_TOKEN_IDS, RequestError, check_text_fits

log = logging.getLogger("pdserve.router")
PUBLIC_PATHS = ("/health",)
HTTP_TO_STATUS = {http: name for name, http in STATUS_TO_HTTP.items()}


class OpenAIApp:
    """The endpoints' shared state.

    Args:
        core: admission and the in-flight registry (shared with gRPC).
        model_name: the served model's name (requests must name it).
        chat_template: renders chat messages to a prompt.
        max_body_bytes: largest request body accepted (413 beyond).
        is_serving: whether /health answers 200 (default: the core is ready and not draining).
        tool_parser: the tool-call format (`router.openai_api.tool_parsers.TOOL_PARSERS`; auto: from the
            chat template).
    """

    def __init__(self, core: RequestCore, model_name: str, chat_template: ChatTemplate,
                 max_body_bytes: int, is_serving: Callable[[], bool] | None = None, tool_parser: str = "auto") -> None:
        self.core = core
        self.is_serving = is_serving or (lambda: core.ready and not core.draining)
        self.model_name = model_name
        self.chat_template = chat_template
        self.tool_format = tool_format(tool_parser, chat_template.source + (chat_template.tool_source or ""))
        self.max_body_bytes = max_body_bytes
        self.created = int(time.time())
        self._ignored_logged: set[tuple[str, ...]] = set()

    @property
    def backend(self):
        return self.core.backend

    # ---- endpoints ------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        ok = self.is_serving() and not self.core.draining
        return Response(status_code=200 if ok else 503)

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request) -> Response:
        self._check_model(request.path_params["model"])
        return JSONResponse(self._model_card())

    async def completions(self, request: Request) -> Response:
        body: CompletionRequest = parse_body(CompletionRequest, await self._read_body(request))
        self._check_model(body.model)
        self._note_ignored(body)
        self._check_stream_options(body)
        if body.stream and needs_selection(body.n or 1, body.best_of):
            raise APIError(400, "best_of > n cannot be streamed; set stream to false or best_of to n", "best_of")
        try:
            prompts = split_prompts(body.prompt)
        except RequestError as e:
            raise api_error(e, body) from None
        if len(prompts) > self.core.max_queue:
            raise APIError(400, f"prompt: a batch of {len(prompts)} prompts exceeds the router's limit of "
                                f"{self.core.max_queue} requests in flight", "prompt")
        batch = len(prompts) > 1       # the batch's usage object is the merged one, not each prompt's
        bodies = [body.model_copy(update={"prompt": p, **({"stream_options": None} if batch else {})})
                  for p in prompts]
        header_id = request.headers.get("x-request-id", "")
        room = MAX_REQUEST_ID_CHARS - len(f"-{len(prompts) - 1}")
        if batch and len(header_id) > room:
            raise APIError(400, f"X-Request-Id: a batch of {len(prompts)} prompts names prompt i "
                                f"'<X-Request-Id>-<i>', so the header must be at most {room} characters, "
                                f"got {len(header_id)}", "X-Request-Id")
        backend = self.backend
        admitted: list[AdmittedRequest] = []
        try:
            for i, sub in enumerate(bodies):
                long = len(sub.prompt) >= (THREAD_TOKENIZE_CHARS if isinstance(sub.prompt, str) else THREAD_TOKEN_IDS)
                request_id = f"{header_id}-{i}" if batch and header_id else header_id
                admitted.append(await self._admit(request_id, sub, long, lambda rid, in_flight, sub=sub: (
                    completion_input(sub, backend.tokenizer, backend.max_model_len, backend.generation_defaults,
                                     rid, in_flight))))
        except BaseException:
            for a in admitted:
                a.finish()
            raise

        def view(a: AdmittedRequest, sub: CompletionRequest) -> CompletionView:
            return CompletionView(a.inp, sub, backend.tokenizer, self.model_name, int(time.time()))
        if not batch:
            return await self._respond(request, admitted[0], body, lambda: view(admitted[0], bodies[0]))
        return await self._respond_batch(request, admitted, body,
                                         lambda: [view(a, sub) for a, sub in zip(admitted, bodies)])

    async def chat_completions(self, request: Request) -> Response:
        raw = await self._read_body(request)
        body: ChatCompletionRequest = parse_body(ChatCompletionRequest, raw)
        self._check_model(body.model)
        self._note_ignored(body)
        self._check_stream_options(body)
        if body.stream and body.prompt_logprobs is not None:
            raise APIError(400, "prompt_logprobs: not available when stream is true", "prompt_logprobs")
        try:
            tools = tool_request(body, self.tool_format)
        except RequestError as e:
            raise api_error(e, body) from None
        # the body's size bounds all the text the template renders (string or parts content, tools, calls)
        long = len(raw) >= THREAD_TOKENIZE_CHARS
        backend = self.backend
        admitted = await self._admit(request.headers.get("x-request-id", ""), body, long,
                                     lambda rid, in_flight: chat_input(
            body, self.chat_template, backend.tokenizer, backend.max_model_len, backend.generation_defaults, rid,
            in_flight, tools))
        return await self._respond(request, admitted, body, lambda: ChatView(
            admitted.inp, body, backend.tokenizer, self.model_name, int(time.time()), tools))

    async def tokenize(self, request: Request) -> Response:
        body: TokenizeRequest = parse_body(TokenizeRequest, await self._read_body(request))
        if body.model is not None:
            self._check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", "prompt")
        tokenizer = self.backend.tokenizer
        try:
            if body.prompt is not None:
                add = True if body.add_special_tokens is None else body.add_special_tokens
                check_text_fits(body.prompt, tokenizer, self.backend.max_model_len, "prompt")
                tokens = list(await asyncio.to_thread(tokenizer.encode, body.prompt, add_special_tokens=add))
            else:
                tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
                tokens = await asyncio.to_thread(chat_prompt_ids, body, self.chat_template, tokenizer,
                                                 self.backend.max_model_len, tools)
        except RequestError as e:
            raise api_error(e, body) from None
        return JSONResponse({"count": len(tokens), "max_model_len": self.backend.max_model_len, "tokens": tokens})

    async def detokenize(self, request: Request) -> Response:
        body: DetokenizeRequest = parse_body(DetokenizeRequest, await self._read_body(request))
        if body.model is not None:
            self._check_model(body.model)
        tokenizer = self.backend.tokenizer
        bad = next((t for t in body.tokens if not 0 <= t < tokenizer.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"tokens: {bad} is out of range: vocab_size is {tokenizer.vocab_size}", "tokens")
        return JSONResponse({"prompt": await asyncio.to_thread(tokenizer.decode, body.tokens)})

    # ---- plumbing -------------------------------------------------------------
    def _model_card(self) -> dict[str, Any]:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "pdserve",
                "root": self.model_name, "parent": None, "max_model_len": self.backend.max_model_len}

    def _check_model(self, name: str) -> None:
        if name != self.model_name:
            raise APIError(404, f"The model `{name}` does not exist; this server serves `{self.model_name}`.",
                           "model", "model_not_found")

    def _note_ignored(self, body) -> None:
        """Log, once per set of names, the fields a request sent that have no effect here (as vLLM does)."""
        names = tuple(ignored_fields(body))
        if names and names not in self._ignored_logged:
            self._ignored_logged.add(names)
            log_event("fields_ignored", logging.WARNING, fields=",".join(names),
                      note="no effect on this server; logged once")

    @staticmethod
    def _check_stream_options(body) -> None:
        if body.stream_options is not None and not body.stream:
            raise APIError(400, "stream_options: only allowed when stream is true", "stream_options")

    async def _read_body(self, request: Request) -> bytes:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise APIError(413, f"request body of {declared} bytes exceeds the limit of {self.max_body_bytes}")
        parts, size = [], 0
        async for part in request.stream():
            size += len(part)
            if size > self.max_body_bytes:
                raise APIError(413, f"request body exceeds the limit of {self.max_body_bytes} bytes")
            parts.append(part)
        return b"".join(parts)

    async def _admit(self, request_id: str, body, offload: bool,
                     build: Callable[[str, Any], Any]) -> AdmittedRequest:
        try:
            return await self.core.admit(lambda in_flight: build(request_id, in_flight), api="http",
                                         user=body.user or "", peek_id=request_id[:64] or "-", offload=offload)
        except RequestError as e:
            error = api_error(e, body)
            error.logged = True             # the core logged the rejection
            raise error from None

    async def _respond(self, request: Request, admitted: AdmittedRequest, body,
                       make_view: Callable[[], CompletionView | ChatView]) -> Response:
        """The whole answer, or the event stream; ``admitted.finish()`` runs once however it ends."""
        headers = {"X-Request-Id": admitted.inp.request_id}
        try:
            view = make_view()
        except BaseException:
            admitted.finish()
            raise
        if not body.stream:
            async def collect() -> dict:
                async with contextlib.aclosing(admitted.chunks()) as chunks:
                    return await view.whole(chunks)
            try:
                result = await until_disconnected(request.receive, collect())
            except RequestError as e:
                raise _failed(e) from None
            except ClientGone:
                return Response(status_code=499)
            finally:
                admitted.finish()
            return JSONResponse(result, headers=headers)
        chunks = admitted.chunks()
        try:        # the first chunk before the headers: a failure before any token gets its own status
            first = await until_disconnected(request.receive, anext(chunks))
        except BaseException as e:
            await chunks.aclose()
            admitted.finish()
            if isinstance(e, RequestError):
                raise _failed(e) from None
            if isinstance(e, ClientGone):
                return Response(status_code=499)
            raise
        return EventStream(sse_events(view.events(_prepend(first, chunks))), admitted.finish, headers)


    async def _respond_batch(self, request: Request, admitted: list[AdmittedRequest], body: CompletionRequest,
                             make_views: Callable[[], list[CompletionView]]) -> Response:
        """A batch of prompts: prompt i's choice j is choice ``i * n + j``; usage is summed."""
        n = admitted[0].inp.params.n

        def finish_all() -> None:
            for a in admitted:
                a.finish()
        try:
            views = make_views()
        except BaseException:
            finish_all()
            raise
        for view in views[1:]:          # one response: every prompt's objects carry the first one's id
            view.id, view.created = views[0].id, views[0].created
        if not body.stream:
            async def collect(a: AdmittedRequest, view: CompletionView) -> dict:
                async with contextlib.aclosing(a.chunks()) as chunks:
                    return await view.whole(chunks)
            try:
                results = await until_disconnected(request.receive, all_or_none(
                    [collect(a, v) for a, v in zip(admitted, views)]))
            except RequestError as e:
                raise _failed(e) from None
            except ClientGone:
                return Response(status_code=499)
            finally:
                finish_all()
            merged = results[0]
            merged["choices"] = [{**c, "index": i * n + c["index"]}
                                 for i, result in enumerate(results) for c in result["choices"]]
            merged["usage"] = usage_json(_sum_usage([a.record.usage for a in admitted], body.max_tokens == 0))
            return JSONResponse(merged, headers={"X-Request-Id": admitted[0].inp.request_id})
        streams = [a.chunks() for a in admitted]
        try:
            firsts = await until_disconnected(request.receive, all_or_none([anext(c) for c in streams]))
        except BaseException as e:
            for c in streams:
                await c.aclose()
            finish_all()
            if isinstance(e, RequestError):
                raise _failed(e) from None
            if isinstance(e, ClientGone):
                return Response(status_code=499)
            raise
        events = [v.events(_prepend(f, c)) for v, f, c in zip(views, firsts, streams)]
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return EventStream(sse_events(_merge_batch(events, admitted, n, include_usage, body.max_tokens == 0)),
                           finish_all,
                           {"X-Request-Id": admitted[0].inp.request_id})


async def _merge_batch(events: list[AsyncIterator[dict]], admitted: list[AdmittedRequest], n: int,
                       include_usage: bool, score_only: bool) -> AsyncIterator[dict]:
    """The prompts' stream objects as they come, choices renumbered; then the summed usage if asked for."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[dict]) -> None:
        try:
            async with contextlib.aclosing(stream) as s:
                async for event in s:
                    for choice in event["choices"]:
                        choice["index"] += i * n
                    if include_usage:
                        event["usage"] = None
                    await queue.put(event)
            await queue.put(None)
        except Exception as e:  # noqa: BLE001 — handed to the consumer, which raises it
            await queue.put(e)

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(events)]
    head: dict = {}
    try:
        for _ in range(len(tasks)):
            while (item := await queue.get()) is not None:
                if isinstance(item, Exception):
                    raise item
                head = head or {k: item[k] for k in ("id", "object", "created", "model")}
                yield item
        if include_usage:
            yield {**head, "choices": [], "usage": usage_json(_sum_usage([a.record.usage for a in admitted],
                                                                                 score_only))}
    finally:
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(BaseException):
                await t


def _sum_usage(usages: list, score_only: bool = False) -> Usage:
    """The batch's usage; scoring (``max_tokens: 0``) has no completion tokens."""
    completion = 0 if score_only else sum(u.completion_tokens for u in usages)
    return Usage(sum(u.prompt_tokens for u in usages), completion,
                 sum(u.cached_prompt_tokens for u in usages))


def _failed(error: RequestError) -> APIError:
    """A generation failure as the HTTP answer (its request_finished line already reports it)."""
    answer = APIError.from_status(error.code, error.message)
    answer.logged = True
    return answer


async def _prepend(first: GenerationChunk, rest: AsyncIterator[GenerationChunk]) -> AsyncIterator[GenerationChunk]:
    async with contextlib.aclosing(rest) as chunks:
        yield first
        async for chunk in chunks:
            yield chunk


class BearerAuth:
    """ASGI middleware: ``Authorization: Bearer <token>`` on every path but `PUBLIC_PATHS` (else 401)."""

    def __init__(self, app: ASGIApp, token: str, on_reject: Callable[[str], None] | None = None) -> None:
        self.app = app
        self.token = token
        self.on_reject = on_reject          # called with "missing" or "invalid"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in PUBLIC_PATHS:
            header = next((v for k, v in scope["headers"] if k == b"authorization"), None)
            presented = header.decode("latin-1") if header is not None else None
            reason = check_http_bearer(presented, self.token, scope["path"])
            if reason is not None:
                if self.on_reject is not None:
                    self.on_reject(reason)
                error = APIError(401, f"{reason} bearer token: send header 'Authorization: Bearer <token>'",
                                 code="invalid_api_key")
                response = JSONResponse(error.body(), status_code=401,
                                        headers={"WWW-Authenticate": 'Bearer realm="pdserve"'})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    if not exc.logged:                  # (the core reported the refusals it made itself)
        status = HTTP_TO_STATUS.get(exc.status, "INVALID_ARGUMENT")
        if request.method == "POST":    # as gRPC: every refused generation request gets a line
            log_event("request_rejected", logging.INFO, request_id=request.headers.get("x-request-id", "-")[:64],
                      api="http", status=status, http_status=exc.status, path=request.url.path, reason=exc.message)
        request.app.state.api.core.rejected("http", status, "-", "", "body_too_large" if exc.status == 413 else None,
                                            log=False)
    return JSONResponse(exc.body(), status_code=exc.status)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    error = APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}")
    request.app.state.api.core.rejected("http", HTTP_TO_STATUS.get(exc.status_code, "NOT_FOUND"), "-", "",
                                        "unknown_route", log=False)
    return JSONResponse(error.body(), status_code=exc.status_code, headers=exc.headers)


async def _client_disconnected(request: Request, exc: Exception) -> Response:
    """The client went away before its request was read whole: one INFO line, nothing to answer."""
    log_event("client_disconnected", logging.INFO, request_id=request.headers.get("x-request-id", "-")[:64],
              api="http", path=request.url.path, stage="reading the request body")
    return Response(status_code=499)


async def _internal_error(request: Request, exc: Exception) -> Response:
    log.error("HTTP %s %s failed", request.method, request.url.path, exc_info=exc)
    return JSONResponse(APIError(500, "internal error; see the router log").body(), status_code=500)


def create_app(core: RequestCore, *, model_name: str, chat_template: ChatTemplate | None = None,
               token: str | None = None, max_body_bytes: int = 4 * 1024 * 1024,
               is_serving: Callable[[], bool] | None = None, tool_parser: str = "auto") -> ASGIApp:
    """The ASGI app of the OpenAI-compatible API.

    Args:
        core: the router's `RequestCore` (shared with the gRPC servicer).
        model_name: the served model's name (``model`` in requests must equal it).
        chat_template: default: `ChatTemplate.from_model_dir(None)` (ChatML).
        token: when set, every path but /health needs ``Authorization: Bearer <token>``.
        max_body_bytes: largest request body (413 beyond).
        is_serving: /health answers 200 while this is True (and the core is not draining).
        tool_parser: how tool calls are written and read: auto (from the chat template), hermes,
            llama3_json or none (`router.openai_api.tool_parsers`).
    """
    api = OpenAIApp(core, model_name, chat_template or ChatTemplate.from_model_dir(None), max_body_bytes,
                    is_serving, tool_parser)
    routes = [
        Route("/health", api.health, methods=["GET"]),
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/v1/models/{model:path}", api.model, methods=["GET"]),
        Route("/v1/completions", api.completions, methods=["POST"]),
        Route("/v1/chat/completions", api.chat_completions, methods=["POST"]),
        Route("/tokenize", api.tokenize, methods=["POST"]),
        Route("/detokenize", api.detokenize, methods=["POST"]),
    ]
    app = Starlette(routes=routes, exception_handlers={
        APIError: _api_error, HTTPException: _http_error, ClientDisconnect: _client_disconnected,
        Exception: _internal_error,
    })
    app.state.api = api
    if not token:
        return app
    return BearerAuth(app, token, lambda reason: core.rejected("http", "UNAUTHENTICATED", "-", "", f"{reason}_token",
                                                                 log=False))   # check_http_bearer logged it
