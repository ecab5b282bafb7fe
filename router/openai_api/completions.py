"""POST /v1/completions: one admitted request → a ``text_completion`` body, or its stream of chunks.

Whole::

    {"id": "cmpl-<request id>", "object": "text_completion", "created", "model",
     "choices": [{"index", "text", "logprobs", "finish_reason", "stop_reason"[, "prompt_logprobs"]}],
     "usage": {...}}

Streamed (SSE): one ``text_completion`` object per backend chunk with a single choice (the
echoed prompt first, per choice, when ``echo``), then, with ``stream_options.include_usage``, one
with ``"choices": []`` and the usage (every other chunk has ``"usage": null``), then ``[DONE]``.
"""
from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

from router.backend import GenerationChunk, GenerationInput, Tokenizer, Usage
from router.openai_api.protocol import CompletionRequest
from router.openai_api.responses import CompletionLogprobs, StreamUsage, TokenTexts, merge_completion_logprobs, \
    finish_reason_json, stop_reason, usage_json, vllm_prompt_logprobs


class CompletionView:
    """Shapes one request's chunks as completions JSON.

    Args:
        inp: the admitted input (its params say n, logprobs, stop ids).
        body: the client's request (echo, prompt, stream_options).
        tokenizer: for token texts and the echoed prompt of a token-id prompt.
        model: the served model name.
        created: the response's Unix time.
    """

    def __init__(self, inp: GenerationInput, body: CompletionRequest, tokenizer: Tokenizer, model: str,
                 created: int) -> None:
        self.inp = inp
        self.body = body
        self.model = model
        self.created = created
        self.id = f"cmpl-{inp.request_id}"
        self.texts = TokenTexts(tokenizer)
        self.echo = bool(body.echo)
        self.score_only = body.max_tokens == 0      # the one token the backend made is left out
        self.want_logprobs = body.logprobs is not None
        self.want_prompt_logprobs = body.prompt_logprobs is not None
        self.prompt_logprobs = None
        self._logprobs = [CompletionLogprobs(self.texts) for _ in range(inp.params.n)]
        self._tokenizer = tokenizer
        whole = isinstance(body.prompt, str) and body.truncate_prompt_tokens is None
        self._prompt_text = body.prompt if whole else None

    @property
    def prompt_text(self) -> str:
        if self._prompt_text is None:
            self._prompt_text = self._tokenizer.decode(self.inp.prompt_token_ids)
        return self._prompt_text

    def _echo_choice(self, index: int) -> dict[str, Any]:
        logprobs = None
        if self.want_logprobs:
            logprobs = self._logprobs[index].prompt(self.inp.prompt_token_ids, self.prompt_logprobs, self.prompt_text)
        return {"index": index, "text": self.prompt_text, "logprobs": logprobs, "finish_reason": None,
                "stop_reason": None}

    def _choice(self, chunk: GenerationChunk) -> dict[str, Any]:
        if self.score_only:
            return {"index": chunk.index, "text": "", "logprobs": None,
                    "finish_reason": "length" if chunk.finish_reason else None, "stop_reason": None}
        logprobs = None
        if self.want_logprobs and chunk.logprobs is not None:
            logprobs = self._logprobs[chunk.index].tokens(chunk.token_ids, chunk.logprobs, chunk.text)
        return {"index": chunk.index, "text": chunk.text, "logprobs": logprobs,
                "finish_reason": finish_reason_json(chunk), "stop_reason": stop_reason(chunk, self.inp)}

    def _object(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": choices}

    async def whole(self, chunks: AsyncIterator[GenerationChunk]) -> dict[str, Any]:
        """Collect every chunk into one completion."""
        n = self.inp.params.n
        parts: list[list[dict[str, Any]]] = [[] for _ in range(n)]
        usage = None
        async for chunk in chunks:
            if chunk.prompt_logprobs is not None:
                self.prompt_logprobs = chunk.prompt_logprobs
            if not parts[chunk.index] and self.echo:
                parts[chunk.index].append(self._echo_choice(chunk.index))
            parts[chunk.index].append(self._choice(chunk))
            usage = chunk.usage or usage
        choices = []
        for index, pieces in enumerate(parts):
            last = pieces[-1]
            logprobs = [p["logprobs"] for p in pieces if p["logprobs"] is not None]
            choice = {"index": index, "text": "".join(p["text"] for p in pieces),
                      "logprobs": merge_completion_logprobs(logprobs) if self.want_logprobs else None,
                      "finish_reason": last["finish_reason"], "stop_reason": last["stop_reason"]}
            if self.want_prompt_logprobs:
                choice["prompt_logprobs"] = vllm_prompt_logprobs(self.prompt_logprobs or [], self.texts)
            choices.append(choice)
        body = self._object(choices)
        body["usage"] = usage_json(self._usage(usage))
        return body

    def _usage(self, usage: Usage) -> Usage:
        return dataclasses.replace(usage, completion_tokens=0) if self.score_only else usage

    async def events(self, chunks: AsyncIterator[GenerationChunk]) -> AsyncIterator[dict[str, Any]]:
        """One stream object per chunk (echoed prompts first), then the usage object when asked for."""
        stream_usage = StreamUsage(self.body.stream_options, len(self.inp.prompt_token_ids))
        usage = None
        first = True
        async with contextlib.aclosing(chunks):      # closing the events closes the request's chunks
            async for chunk in chunks:
                prompt_logprobs = None
                if first:
                    first = False
                    self.prompt_logprobs = chunk.prompt_logprobs
                    if self.echo:
                        for index in range(self.inp.params.n):
                            yield stream_usage.stamp(self._object([self._echo_choice(index)]))
                    if self.want_prompt_logprobs:
                        prompt_logprobs = vllm_prompt_logprobs(chunk.prompt_logprobs or [], self.texts)
                choice = self._choice(chunk)
                if prompt_logprobs is not None:
                    choice["prompt_logprobs"] = prompt_logprobs
                if not self.score_only:
                    stream_usage.count(chunk)
                yield stream_usage.stamp(self._object([choice]))
                usage = chunk.usage or usage
        if stream_usage.include and usage is not None:
            body = self._object([])
            body["usage"] = usage_json(self._usage(usage))
            yield body

