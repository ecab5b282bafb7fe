"""Backend chunks → OpenAI response bodies: completions and chat, whole or as stream chunks.

Per choice (``index`` = the sequence's index; 0..n-1):

- ``finish_reason``: "stop" | "length" | "abort".
- ``stop_reason`` (vLLM's field): the matched stop string, or the matched ``stop_token_ids``
  entry; null when the sequence ended on EOS, on length, or was aborted (as vLLM).
- completions ``logprobs``: ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``; each
  ``top_logprobs`` entry maps token text → logprob for the k most likely tokens, plus the sampled
  token (so up to k + 1 entries, as OpenAI). With ``echo`` the prompt comes first, its first
  token's logprob and alternatives null. ``text_offset`` indexes the returned text: a special
  token it omits (the echoed BOS) takes no characters. ``prompt_logprobs`` (vLLM's field, when asked for):
  per prompt token, null for the first, else ``{"<token id>": {"logprob", "decoded_token"}}``.
- chat ``logprobs``: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token",
  "logprob", "bytes"}]}]}``.

Token texts are ``tokenizer.decode([id], skip_special_tokens=False)``; ``bytes`` is that text's
UTF-8 (a token holding part of a character shows U+FFFD). A logprob of -inf is sent as -9999.0
(as OpenAI does), since JSON has no infinity.

``usage``: ``{"prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details":
{"cached_tokens"}}``; completion tokens count every generated sequence (all ``best_of``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from proto.pdserve.v1 import generation_pb2 as pb
from router.backend import GenerationChunk, GenerationInput, Tokenizer, Usage, finish_reason_name

LOGPROB_FLOOR = -9999.0


class TokenTexts:
    """Token id → its text, decoded once per request."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}
        self._special: dict[int, bool] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self._tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def is_special(self, token_id: int) -> bool:
        """Whether decoding drops the token when special tokens are skipped (BOS, EOS, ...)."""
        special = self._special.get(token_id)
        if special is None:
            special = self._special[token_id] = \
                not self._tokenizer.decode([token_id], skip_special_tokens=True) and bool(self(token_id))
        return special


def usage_json(usage: Usage) -> dict[str, Any]:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_prompt_tokens}}


class StreamUsage:
    """The ``usage`` a streamed chunk carries.

    Without ``stream_options.include_usage`` chunks carry none. With it, every chunk has
    ``"usage": null`` and one last chunk has the request's usage; with ``continuous_usage_stats`` too
    (vLLM's extension, sent by guidellm and aiperf) every chunk carries the counts so far instead of null:
    the prompt's tokens and the completion tokens of every choice up to and including that chunk.
    """

    def __init__(self, options, prompt_tokens: int) -> None:
        self.include = bool(options and options.include_usage)
        self.continuous = self.include and bool(options.continuous_usage_stats)
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = 0

    def count(self, chunk: GenerationChunk) -> None:
        self.completion_tokens += len(chunk.token_ids)

    def stamp(self, body: dict[str, Any]) -> dict[str, Any]:
        if self.include:
            body["usage"] = None if not self.continuous else {
                "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}
        return body


def finish_reason_json(chunk: GenerationChunk | None) -> str | None:
    """The choice's ``finish_reason``: the chunk's reason by name, null while the sequence runs."""
    return None if chunk is None or chunk.finish_reason is None else finish_reason_name(chunk.finish_reason)


def stop_reason(chunk: GenerationChunk, inp: GenerationInput) -> str | int | None:
    """vLLM's stop_reason: the stop string or stop_token_ids entry that ended the sequence, else None."""
    if chunk.finish_reason != pb.FINISH_REASON_STOP or chunk.matched_stop is None:
        return None
    if isinstance(chunk.matched_stop, str) or chunk.matched_stop in inp.params.stop_token_ids:
        return chunk.matched_stop
    return None   # EOS


def _logprob(value: float) -> float:
    return value if math.isfinite(value) else LOGPROB_FLOOR


@dataclass(slots=True)
class _CompletionLogprobs:
    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)

    def json(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "token_logprobs": self.token_logprobs, "top_logprobs": self.top_logprobs,
                "text_offset": self.text_offset}


class CompletionLogprobs:
    """Builds the completions ``logprobs`` object of one choice, tracking its text offset."""

    def __init__(self, texts: TokenTexts) -> None:
        self._texts = texts
        self.offset = 0

    def prompt(self, prompt_token_ids: list[int], prompt_logprobs: list[pb.TokenLogprob] | None,
               shown: str) -> dict[str, Any]:
        """The echoed prompt's entries; ``shown`` is the prompt text the choice returns."""
        out = _CompletionLogprobs()
        scored = {i + 1: lp for i, lp in enumerate(prompt_logprobs or [])}
        advances = self._advances(prompt_token_ids, shown)
        for i, token_id in enumerate(prompt_token_ids):
            self._add(out, token_id, scored.get(i), advances[i])
        return out.json()

    def tokens(self, token_ids: list[int], logprobs: list[pb.TokenLogprob], shown: str) -> dict[str, Any]:
        """The entries of generated tokens; ``shown`` is their text as the choice returns it."""
        out = _CompletionLogprobs()
        for token_id, lp, advance in zip(token_ids, logprobs, self._advances(token_ids, shown)):
            self._add(out, token_id, lp, advance)
        return out.json()

    def _advances(self, token_ids: list[int], shown: str) -> list[int]:
        """How far each token moves ``text_offset`` in ``shown``: its text's length where ``shown`` holds
        it there, nothing for a special token the text omits (the BOS of an echoed prompt, a skipped EOS)."""
        out, pos = [], 0
        for token_id in token_ids:
            text = self._texts(token_id)
            if shown.startswith(text, pos):
                step = len(text)
            elif self._texts.is_special(token_id):
                step = 0
            else:                           # part of a character: the whole character is on a later token
                step = min(len(text), len(shown) - pos)
            out.append(step)
            pos += step
        return out

    def _add(self, out: _CompletionLogprobs, token_id: int, lp: pb.TokenLogprob | None, advance: int) -> None:
        text = self._texts(token_id)
        out.tokens.append(text)
        out.text_offset.append(self.offset)
        self.offset += advance
        if lp is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            return
        out.token_logprobs.append(_logprob(lp.logprob))
        top = {self._texts(t.token_id): _logprob(t.logprob) for t in lp.top}
        top.setdefault(text, _logprob(lp.logprob))
        out.top_logprobs.append(top)


def merge_completion_logprobs(parts: list[dict[str, Any]]) -> dict[str, Any]:
    merged: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for part in parts:
        for key, values in part.items():
            merged[key].extend(values)
    return merged


def vllm_prompt_logprobs(prompt_logprobs: list[pb.TokenLogprob], texts: TokenTexts) -> list[dict | None]:
    """vLLM's ``prompt_logprobs``: null for the first prompt token, then per token id its logprob."""
    out: list[dict | None] = [None]
    for lp in prompt_logprobs:
        entry = {str(lp.token_id): {"logprob": _logprob(lp.logprob), "decoded_token": texts(lp.token_id)}}
        for t in lp.top:
            entry.setdefault(str(t.token_id), {"logprob": _logprob(t.logprob), "decoded_token": texts(t.token_id)})
        out.append(entry)
    return out


def chat_logprobs(token_ids: list[int], logprobs: list[pb.TokenLogprob], texts: TokenTexts) -> list[dict]:
    """The chat ``logprobs.content`` entries of these tokens."""
    content = []
    for token_id, lp in zip(token_ids, logprobs):
        text = texts(token_id)
        content.append({
            "token": text, "logprob": _logprob(lp.logprob), "bytes": list(text.encode("utf-8")),
            "top_logprobs": [{"token": texts(t.token_id), "logprob": _logprob(t.logprob),
                              "bytes": list(texts(t.token_id).encode("utf-8"))} for t in lp.top],
        })
    return content
