"""Request bodies of the OpenAI-compatible API (pydantic, strict: unknown fields and mistyped values
such as ``"max_tokens": "5"`` are refused, as OpenAI refuses them; an integer is a valid float).

OpenAI's fields, plus the vLLM extensions clients send (top_k, min_p, repetition_penalty,
min_tokens, stop_token_ids, include_stop_str_in_output, skip_special_tokens, ignore_eos,
prompt_logprobs, guided_json / guided_regex / guided_choice / guided_grammar). `parse_body` turns a
validation failure into an `APIError` (400) naming the field.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from router.openai_api.errors import APIError


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Body):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None     # vLLM: usage on every chunk (with include_usage)


class JSONSchemaFormat(_Body):
    """``response_format.json_schema``: the schema the output must match (``strict`` is accepted; the
    schema is always enforced)."""

    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class _Sampling(_Body):
    """Fields both generation endpoints take."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    # vLLM extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    ignore_eos: bool | None = None
    prompt_logprobs: int | None = None
    add_special_tokens: bool | None = None      # completions: True (BOS added); chat: False (the template has it)
    truncate_prompt_tokens: int | None = None   # keep the prompt's last k tokens
    # structured outputs (router/openai_api/structured.py): at most one of these
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # Accepted and ignored (they have no meaning here), logged once per set of names: `ignored_fields`.
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None


def ignored_fields(body: BaseModel) -> list[str]:
    """The fields of ``body`` that were sent but have no effect here (chat's ``echo``, completions' ``suffix``)."""
    names = [n for n in ("store", "metadata", "service_tier") if getattr(body, n, None) is not None]
    if isinstance(body, ChatCompletionRequest) and body.echo:
        names.append("echo")
    if isinstance(body, CompletionRequest) and body.suffix:
        names.append("suffix")
    return names


class CompletionRequest(_Sampling):
    """POST /v1/completions. ``prompt``: a string, token ids, or a one-element list of either."""

    prompt: Any
    best_of: int | None = None
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None


class FunctionCall(_Body):
    name: str
    arguments: str                              # JSON text, as OpenAI returns it
    parsed_arguments: Any = None                # the openai SDK's parse() result, sent back with it: ignored


class ToolCall(_Body):
    """A call an assistant message made (as a response carried it, sent back in the conversation)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_call_id: str | None = None             # role tool: the call it answers
    tool_calls: list[ToolCall] | None = None    # role assistant: the calls it made
    refusal: str | None = None                  # as responses carry them back: ignored
    parsed: Any = None


class FunctionDefinition(_Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    echo: bool | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None


class TokenizeRequest(_Body):
    """POST /tokenize: ``prompt`` or ``messages`` (vLLM's shape)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None             # rendered by the chat template, as for chat completions
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Body):
    """POST /detokenize."""

    model: str | None = None
    tokens: list[int]


def parse_body(model: type[BaseModel], raw: bytes) -> Any:
    """``raw`` JSON as ``model``.

    Raises:
        APIError: 400 naming the first offending field (an unknown one: "Unrecognized request
            argument supplied: <name>", as OpenAI words it).
    """
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        loc = err["loc"]
        if err["type"] == "json_invalid":
            raise APIError(400, f"request body is not valid JSON: {err['msg']}") from None
        if not loc:
            raise APIError(400, "request body must be a JSON object") from None
        if err["type"] == "extra_forbidden":
            path = _path(loc[:-1], model) + ("." if len(loc) > 1 else "") + str(loc[-1])
            raise APIError(400, f"Unrecognized request argument supplied: {path}", param=path) from None
        raise APIError(400, f"{_path(loc, model)}: {err['msg']}", param=str(loc[0])) from None


_NESTED = (ChatMessage, StreamOptions, ResponseFormat, JSONSchemaFormat, ToolCall, FunctionCall, Tool,
           FunctionDefinition, NamedToolChoice, FunctionName)


def _path(loc: tuple, model: type[BaseModel]) -> str:
    """``messages[0].content``: field names and list positions, without pydantic's union labels."""
    known = set(model.model_fields) | {"schema"} | set().union(*(m.model_fields for m in _NESTED))
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in known:
            out += f".{part}" if out else str(part)
    return out
