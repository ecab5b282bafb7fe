"""The load generator's two front doors: the gRPC `Generate` stream and the OpenAI HTTP API.

Each client streams one request as `Piece`s (what arrived, and when the last one ends it), so the
load generator times both the same way: TTFT at the first piece with tokens, ITL between pieces.
The OpenAI client is what any OpenAI-compatible server gets from a load generator: `POST
/v1/completions` with the prompt's token ids, `stream: true`, `stream_options.include_usage`;
one SSE chunk is one token arrival, and the final usage chunk gives the token counts. It carries no
server-side timing breakdown (the OpenAI API has none). A spec's grammar goes as ``sampling.structured``
(gRPC) or the matching ``guided_*`` field (OpenAI).
"""
from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

from bench.serving.workloads import RequestSpec

FINISH_NAMES = {1: "stop", 2: "length", 3: "abort"}


@dataclass(slots=True)
class Piece:
    """Part of one request's stream; the last one has ``finish_reason``."""

    num_tokens: int
    finish_reason: str = ""
    completion_tokens: int | None = None      # the server's count, on the last piece when it gives one
    cached_prompt_tokens: int = 0
    timing: object | None = None              # the gRPC response's Timing (server breakdown), last piece only


def guided_fields(spec) -> dict:
    """A `StructuredOutput` as the OpenAI API's (vLLM's) request field."""
    kind = spec.kind
    if kind == "json_object":
        return {"response_format": {"type": "json_object"}}
    if kind == "json_schema":
        return {"guided_json": json.loads(spec.json_schema)}
    return {f"guided_{kind}": list(spec.choice) if kind == "choice" else getattr(spec, kind)}


class RequestFailed(Exception):
    """The server answered the request with an error status."""


class GrpcLoadClient:
    """`pdserve.v1.GenerationService.Generate` over one channel."""

    api = "grpc"

    def __init__(self, address: str, token: str | None = None):
        from router.client import AsyncGenerationClient
        self._client = AsyncGenerationClient(address, token=token)

    async def stream(self, spec: RequestSpec, request_id: str, timeout: float) -> AsyncIterator[Piece]:
        kwargs = dict(max_tokens=spec.output_len, temperature=0.0, ignore_eos=True, request_id=request_id,
                      timeout=timeout)
        if spec.structured is not None:
            kwargs["structured"] = spec.structured.to_proto()
        if spec.prompt_token_ids is not None:
            responses = self._client.generate(token_ids=spec.prompt_token_ids, **kwargs)
        else:
            responses = self._client.generate(spec.prompt, **kwargs)
        async for msg in responses:
            piece = Piece(len(msg.token_ids))
            if msg.finish_reason:
                piece.finish_reason = FINISH_NAMES.get(msg.finish_reason, str(msg.finish_reason))
                piece.completion_tokens = msg.usage.completion_tokens
                piece.cached_prompt_tokens = msg.usage.cached_prompt_tokens
                piece.timing = msg.timing
            yield piece

    async def close(self) -> None:
        await self._client.close()


class OpenAILoadClient:
    """`POST /v1/completions` with SSE streaming over one aiohttp connection pool (the client
    vLLM's and SGLang's serving benchmarks use, so figures compare with theirs)."""

    api = "openai"

    def __init__(self, base_url: str, model: str, token: str | None = None, max_connections: int = 1024):
        import aiohttp
        self._base_url = base_url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._connector = aiohttp.TCPConnector(limit=max_connections)
        self._session: aiohttp.ClientSession | None = None
        self.model = model

    @classmethod
    async def for_server(cls, base_url: str, token: str | None = None) -> OpenAILoadClient:
        """A client of the first model the server lists at ``GET /models``."""
        client = cls(base_url, "", token)
        async with client._http().get(f"{client._base_url}/models") as response:
            if response.status != 200:
                await client.close()
                raise RequestFailed(f"GET /models: HTTP {response.status}: {(await response.text())[:300]}")
            client.model = (await response.json())["data"][0]["id"]
        return client

    def _http(self):
        import aiohttp
        if self._session is None:
            self._session = aiohttp.ClientSession(connector=self._connector, headers=self._headers,
                                                  timeout=aiohttp.ClientTimeout(total=None))
        return self._session

    async def stream(self, spec: RequestSpec, request_id: str, timeout: float) -> AsyncIterator[Piece]:
        import aiohttp
        body = {"model": self.model, "max_tokens": spec.output_len, "temperature": 0.0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}, "user": request_id,
                "prompt": spec.prompt_token_ids if spec.prompt_token_ids is not None else spec.prompt}
        if spec.structured is not None:
            body.update(guided_fields(spec.structured))
        finish = ""
        async with self._http().post(f"{self._base_url}/completions", json=body,
                                     timeout=aiohttp.ClientTimeout(total=timeout)) as response:
            if response.status != 200:
                raise RequestFailed(f"HTTP {response.status}: {(await response.text())[:300]}")
            async for line in response.content:          # one SSE line at a time
                if not line.startswith(b"data: "):
                    continue
                data = line[6:].strip()
                if data == b"[DONE]":
                    return
                event = json.loads(data)
                if "error" in event:
                    raise RequestFailed(f"{event['error'].get('code')}: {event['error'].get('message')}")
                for choice in event.get("choices", ()):
                    finish = choice.get("finish_reason") or finish
                    yield Piece(1)
                usage = event.get("usage")
                if usage and not event.get("choices"):
                    details = usage.get("prompt_tokens_details") or {}
                    yield Piece(0, finish or "?", usage["completion_tokens"], details.get("cached_tokens") or 0)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
        else:
            await self._connector.close()
