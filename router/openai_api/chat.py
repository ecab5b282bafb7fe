"""POST /v1/chat/completions: one admitted request → a ``chat.completion`` body, or its chunk stream.

Whole::

    {"id": "chatcmpl-<request id>", "object": "chat.completion", "created", "model",
     "choices": [{"index", "message": {"role": "assistant", "content"}, "logprobs",
                  "finish_reason", "stop_reason"}],
     "usage": {...}[, "prompt_logprobs": [...] (vLLM's field, when asked for; not streamed)]}

Streamed (SSE): ``chat.completion.chunk`` objects — first one per choice with ``delta: {"role":
"assistant", "content": ""}``, then one per backend chunk with ``delta: {"content"}`` (``{}``
when the chunk has no text) and, on a sequence's last, its ``finish_reason`` and
``stop_reason``; with ``stream_options.include_usage`` every chunk has ``"usage": null`` (the counts so far
with ``continuous_usage_stats``: `StreamUsage`) and a
last one has ``"choices": []`` and the usage; then ``[DONE]``.

With tools (and ``tool_choice`` not none) each sequence's text goes through its tool-call parser
(router/openai_api/tool_parsers.py): the message has ``tool_calls`` (``[{"id": "call_...", "type":
"function", "function": {"name", "arguments"}}]``), ``content`` the text outside them (null when there is
none), and ``finish_reason`` "tool_calls" when a sequence that made calls ended on a stop. Streamed, the
role delta has ``content: null``, text that may start a call is held back, a call's first delta carries
``index``, ``id``, ``type`` and ``name`` (``arguments: ""``), and later ones its ``arguments`` as written.
"""
from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from router.backend import GenerationChunk, GenerationInput, Tokenizer
from router.openai_api.protocol import ChatCompletionRequest
from router.openai_api.responses import StreamUsage, TokenTexts, chat_logprobs, finish_reason_json, stop_reason, \
    usage_json, vllm_prompt_logprobs
from router.openai_api.tool_parsers import ToolCallParser
from router.openai_api.tools import ToolRequest


class ChatView:
    """Shapes one request's chunks as chat completion JSON.

    Args:
        inp: the admitted input.
        body: the client's request (stream_options).
        tokenizer: for token texts in logprobs.
        model: the served model name.
        created: the response's Unix time.
        tools: the request's tools (their parser finds the calls in each sequence's text).
    """

    def __init__(self, inp: GenerationInput, body: ChatCompletionRequest, tokenizer: Tokenizer, model: str,
                 created: int, tools: ToolRequest | None = None) -> None:
        self.inp = inp
        self.body = body
        self.model = model
        self.created = created
        self.id = f"chatcmpl-{inp.request_id}"
        self.texts = TokenTexts(tokenizer)
        self.want_logprobs = bool(body.logprobs)
        self.tools = tools

    def _parser(self) -> ToolCallParser | None:
        return self.tools.parser() if self.tools is not None else None

    @staticmethod
    def _finish(chunk: GenerationChunk | None, parser: ToolCallParser | None) -> str | None:
        reason = finish_reason_json(chunk)
        return "tool_calls" if reason == "stop" and parser is not None and parser.calls else reason

    def _logprobs(self, chunk: GenerationChunk) -> list[dict[str, Any]] | None:
        if not self.want_logprobs or chunk.logprobs is None:
            return None
        return chat_logprobs(chunk.token_ids, chunk.logprobs, self.texts)

    def _object(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    async def whole(self, chunks: AsyncIterator[GenerationChunk]) -> dict[str, Any]:
        """Collect every chunk into one chat completion."""
        n = self.inp.params.n
        texts: list[list[str]] = [[] for _ in range(n)]
        logprobs: list[list[dict[str, Any]]] = [[] for _ in range(n)]
        ends: list[GenerationChunk | None] = [None] * n
        usage = prompt_logprobs = None
        async for chunk in chunks:
            prompt_logprobs = chunk.prompt_logprobs or prompt_logprobs
            texts[chunk.index].append(chunk.text)
            logprobs[chunk.index].extend(self._logprobs(chunk) or [])
            if chunk.finish_reason is not None:
                ends[chunk.index] = chunk
            usage = chunk.usage or usage
        choices = []
        for index in range(n):
            end = ends[index]
            text = "".join(texts[index])
            message = {"role": "assistant", "content": text}
            parser = self._parser()
            if parser is not None:
                message["content"], calls = parser.parse(text)
                if calls:
                    message["tool_calls"] = [call.json() for call in calls]
            choices.append({
                "index": index, "message": message,
                "logprobs": {"content": logprobs[index]} if self.want_logprobs else None,
                "finish_reason": self._finish(end, parser),
                "stop_reason": stop_reason(end, self.inp) if end else None,
            })
        body = self._object("chat.completion", choices)
        body["usage"] = usage_json(usage)
        if self.body.prompt_logprobs is not None:      # vLLM's field, beside the choices
            body["prompt_logprobs"] = vllm_prompt_logprobs(prompt_logprobs or [], self.texts)
        return body

    async def events(self, chunks: AsyncIterator[GenerationChunk]) -> AsyncIterator[dict[str, Any]]:
        """The role delta per choice, one chunk object per backend chunk, then the usage when asked for."""
        stream_usage = StreamUsage(self.body.stream_options, len(self.inp.prompt_token_ids))
        usage = None
        first = True
        parsers = [self._parser() for _ in range(self.inp.params.n)]
        async with contextlib.aclosing(chunks):      # closing the events closes the request's chunks
            async for chunk in chunks:
                if first:
                    first = False
                    for index in range(self.inp.params.n):
                        delta = {"role": "assistant", "content": "" if parsers[index] is None else None}
                        role = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
                        yield stream_usage.stamp(self._object("chat.completion.chunk", [role]))
                if not chunk.text and not chunk.token_ids and chunk.finish_reason is None:
                    continue
                logprobs = self._logprobs(chunk)
                parser = parsers[chunk.index]
                choice = {"index": chunk.index, "delta": self._delta(chunk, parser),
                          "logprobs": {"content": logprobs} if logprobs is not None else None,
                          "finish_reason": self._finish(chunk, parser)}
                if chunk.finish_reason is not None:
                    choice["stop_reason"] = stop_reason(chunk, self.inp)
                stream_usage.count(chunk)
                yield stream_usage.stamp(self._object("chat.completion.chunk", [choice]))
                usage = chunk.usage or usage
        if stream_usage.include and usage is not None:
            body = self._object("chat.completion.chunk", [])
            body["usage"] = usage_json(usage)
            yield body

    @staticmethod
    def _delta(chunk: GenerationChunk, parser: ToolCallParser | None) -> dict[str, Any]:
        """The chunk's text as a delta: as it is, or what its sequence's tool-call parser lets through."""
        if parser is None:
            return {"content": chunk.text} if chunk.text else {}
        parsed = parser.feed(chunk.text)
        if chunk.finish_reason is not None:
            parsed.add(parser.finish())
        delta: dict[str, Any] = {}
        if parsed.content:
            delta["content"] = parsed.content
        if parsed.calls:
            delta["tool_calls"] = [call.json() for call in parsed.calls]
        return delta
