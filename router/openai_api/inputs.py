"""OpenAI request bodies → the router's `GenerateRequest` → `GenerationInput` (the gRPC path's validation).

Both endpoints build a `pdserve.v1.GenerateRequest` and pass it through
`router.validation.validate_request`, so every range check, the context budget and the sampling
defaults (`Backend.generation_defaults`) are the gRPC front door's. What is HTTP's own:

- /v1/completions: ``prompt`` is a string (tokenized with the tokenizer's special tokens, e.g.
  BOS), token ids, or a list of either (a batch: one request per prompt, `split_prompts`);
  ``max_tokens`` defaults to 16 (OpenAI's documented default); ``echo`` with ``logprobs`` asks for prompt logprobs too,
  and ``max_tokens: 0`` with ``echo`` scores the prompt alone (no completion text or tokens).
  ``add_special_tokens: false`` tokenizes a string prompt without them (a client that wrote the BOS itself).
- /v1/chat/completions: the messages go through the chat template (``add_generation_prompt``,
  ``continue_final_message``, ``chat_template_kwargs`` as in vLLM), and the text is tokenized
  without special tokens unless ``add_special_tokens`` (the template holds the BOS); ``max_completion_tokens`` (else
  ``max_tokens``) defaults to the context left after the prompt; ``logprobs: true`` +
  ``top_logprobs`` k become ``sampling.logprobs`` k.
- ``truncate_prompt_tokens`` k keeps the prompt's last k tokens (-1: the last max_model_len).
- ``top_k: -1`` (vLLM's old "off") is 0; ``logit_bias`` keys are token ids as strings.
- ``response_format`` / ``guided_*`` become ``sampling.structured`` (router/openai_api/structured.py);
  a chat request's ``tools`` reach the template, and a forced ``tool_choice`` becomes the grammar of a
  call (router/openai_api/tools.py); assistant messages' ``tool_calls`` and ``tool`` messages go back
  through the template.

Errors name the OpenAI parameter (`api_error`).
"""
from __future__ import annotations

from collections.abc import Container

from engine.sampling.structured import StructuredOutput
from proto.pdserve.v1 import generation_pb2 as pb
from router.backend import GenerationInput, Tokenizer
from router.openai_api.chat_template import ChatTemplate, ChatTemplateError
from router.openai_api.errors import APIError
from router.openai_api.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, TokenizeRequest
from router.openai_api.structured import structured_output
from router.openai_api.tools import ToolRequest, template_tool_calls
from router.validation import RequestError, check_text_fits, invalid, validate_request

UINT32_MAX = 2**32 - 1
UINT64_MAX = 2**64 - 1
_UINT32_FIELDS = ("max_tokens", "top_k", "min_tokens", "logprobs", "prompt_logprobs", "n", "best_of")
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty")


def split_prompts(prompt: object) -> list[str | list[int]]:
    """The prompts of a /v1/completions ``prompt``: a string, token ids, or a list of either (a batch).

    Raises:
        RequestError: INVALID_ARGUMENT naming ``prompt``.
    """
    if isinstance(prompt, str) or _is_token_ids(prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) or _is_token_ids(p) for p in prompt):
        return list(prompt)
    raise invalid("prompt must be a string, a list of token ids, or a non-empty list of either", "prompt")


def _is_token_ids(value: object) -> bool:
    return isinstance(value, list) and bool(value) and \
        all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def completion_input(body: CompletionRequest, tokenizer: Tokenizer, max_model_len: int, defaults: dict,
                     request_id: str, in_flight: Container[str]) -> GenerationInput:
    """Validate a /v1/completions body with one prompt (`split_prompts`) into a `GenerationInput`.

    Raises:
        RequestError: naming the field.
    """
    [prompt] = split_prompts(body.prompt)
    max_tokens = body.max_tokens
    if max_tokens == 0:                 # scoring: the echoed prompt's logprobs only (`CompletionView.score_only`)
        if not body.echo:
            raise invalid("max_tokens: 0 asks for no output; it is only for scoring the prompt with echo",
                          "sampling.max_tokens")
        max_tokens = 1                  # the prompt's pass yields one token, which the answer leaves out
    structured, _ = structured_output(body)
    request = _request(body, request_id, _sampling(body, logprobs=body.logprobs, max_tokens=max_tokens,
                                                   best_of=body.best_of, echo=bool(body.echo), structured=structured))
    if isinstance(prompt, str) and body.add_special_tokens is not False and body.truncate_prompt_tokens is None:
        request.prompt = prompt         # validate_request tokenizes it, special tokens (BOS) included
    else:
        if isinstance(prompt, str):
            check_text_fits(prompt, tokenizer, max_model_len, "prompt")
            prompt = list(tokenizer.encode(prompt, add_special_tokens=body.add_special_tokens is not False))
        elif min(prompt) < 0 or max(prompt) > UINT32_MAX:
            raise invalid("prompt: token ids must be non-negative integers", "prompt")
        request.token_ids.ids.extend(truncate_prompt(prompt, body.truncate_prompt_tokens, max_model_len))
    return validate_request(request, tokenizer, max_model_len, in_flight, None, defaults)


def truncate_prompt(ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """``truncate_prompt_tokens``: the prompt's last ``keep`` ids (-1: the last ``max_model_len``; None: all).

    Raises:
        RequestError: INVALID_ARGUMENT naming ``truncate_prompt_tokens``.
    """
    if keep is None:
        return ids
    if keep == -1:
        keep = max_model_len
    if not 1 <= keep <= max_model_len:
        raise invalid(f"truncate_prompt_tokens must be -1 or in [1, max_model_len ({max_model_len})], got {keep}",
                      "truncate_prompt_tokens")
    return ids[-keep:]


def chat_input(body: ChatCompletionRequest, template: ChatTemplate, tokenizer: Tokenizer, max_model_len: int,
               defaults: dict, request_id: str, in_flight: Container[str],
               tools: ToolRequest | None = None) -> GenerationInput:
    """Render, tokenize and validate a /v1/chat/completions body (raises `RequestError`); ``tools``: its
    checked tools (`router.openai_api.tools.tool_request`)."""
    structured, _ = structured_output(body)
    if tools is not None and tools.forced is not None:
        structured = tools.forced
    prompt_ids = truncate_prompt(chat_prompt_ids(body, template, tokenizer, max_model_len,
                                                 tools.tools if tools is not None else None),
                                 body.truncate_prompt_tokens, max_model_len)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if max_tokens is None:
        max_tokens = max_model_len - len(prompt_ids)
        if max_tokens < 1:
            raise invalid(f"messages: the prompt is {len(prompt_ids)} tokens, which leaves no room for "
                                f"output within max_model_len ({max_model_len})", "messages")
    if body.top_logprobs is not None and not body.logprobs:
        raise invalid("top_logprobs: set logprobs to true to use top_logprobs", "top_logprobs")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    request = _request(body, request_id, _sampling(body, logprobs=logprobs, max_tokens=max_tokens,
                                                   structured=structured))
    if (body.skip_special_tokens is None and tools is not None and tools.parser() is not None
            and tools.format.tags_are_special(tokenizer)):
        request.sampling.skip_special_tokens = False    # keep the call markers in the text the parser reads
    request.token_ids.ids.extend(prompt_ids)
    return validate_request(request, tokenizer, max_model_len, in_flight, None, defaults)


def chat_prompt_ids(body: ChatCompletionRequest | TokenizeRequest, template: ChatTemplate,
                    tokenizer: Tokenizer, max_model_len: int, tools: list[dict] | None = None) -> list[int]:
    """The token ids of the rendered conversation of ``body``.

    ``add_generation_prompt``, ``continue_final_message``, ``chat_template_kwargs`` and ``tools`` go to
    the template; the text is tokenized with ``add_special_tokens`` (default False: the template holds
    the BOS).
    """
    if not body.messages:
        raise invalid("messages must not be empty", "messages")
    extra = body.chat_template_kwargs or {}
    try:
        text = template.render(template_messages(body.messages), body.add_generation_prompt,
                               body.continue_final_message, extra, tools)
    except ChatTemplateError as e:
        raise invalid(f"messages: {e}", "messages") from None
    check_text_fits(text, tokenizer, max_model_len, "messages")
    return list(tokenizer.encode(text, add_special_tokens=bool(body.add_special_tokens)))


def template_messages(messages: list[ChatMessage]) -> list[dict]:
    """Messages as the template reads them: content as one string (text parts joined by newlines), an
    assistant's ``tool_calls`` with their arguments as objects (`template_tool_calls`)."""
    out = []
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                kind = part.get("type")
                if kind != "text" or not isinstance(part.get("text"), str) or set(part) - {"type", "text"}:
                    what = f"type {kind!r} is not supported (only text parts)" if kind != "text" else \
                        "a text part holds exactly 'type' and a string 'text'"
                    raise invalid(f"messages[{i}].content[{j}]: {what}", "messages")
                texts.append(part["text"])
            content = "\n".join(texts)
        message = {"role": m.role, "content": content if content is not None else ""}
        if m.name is not None:
            message["name"] = m.name
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            message["tool_calls"] = template_tool_calls(m, i)
        out.append(message)
    return out


def _request(body, request_id: str, sampling: pb.SamplingParams) -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id=request_id, sampling=sampling, user=body.user or "")


def _sampling(body, *, logprobs: int | None, max_tokens: int | None, best_of: int | None = None,
              echo: bool = False, structured: StructuredOutput | None = None) -> pb.SamplingParams:
    """The proto's sampling fields from the body (unset stays unset, so the defaults apply)."""
    values = {
        "max_tokens": max_tokens, "temperature": body.temperature, "top_p": body.top_p, "n": body.n,
        "best_of": best_of, "seed": body.seed, "presence_penalty": body.presence_penalty,
        "frequency_penalty": body.frequency_penalty, "top_k": 0 if body.top_k == -1 else body.top_k,
        "min_p": body.min_p, "repetition_penalty": body.repetition_penalty, "min_tokens": body.min_tokens,
        "logprobs": logprobs, "skip_special_tokens": body.skip_special_tokens,
        "prompt_logprobs": body.prompt_logprobs if body.prompt_logprobs is not None or not echo else logprobs,
    }
    msg = pb.SamplingParams()
    for name, value in values.items():
        if value is None:
            continue
        if name in _UINT32_FIELDS and not 0 <= value <= UINT32_MAX:
            raise invalid(f"sampling.{name} must be in [0, {UINT32_MAX}], got {value}", f"sampling.{name}")
        if name == "seed" and not 0 <= value <= UINT64_MAX:
            raise invalid(f"sampling.seed must be in [0, {UINT64_MAX}], got {value}", "sampling.seed")
        setattr(msg, name, float(value) if name in _FLOAT_FIELDS else value)
    if body.stop is not None:
        msg.stop.extend([body.stop] if isinstance(body.stop, str) else body.stop)
    for token_id in body.stop_token_ids or ():
        if not 0 <= token_id <= UINT32_MAX:
            raise invalid(f"sampling.stop_token_ids: {token_id} is not a token id", "sampling.stop_token_ids")
        msg.stop_token_ids.append(token_id)
    for key, bias in (body.logit_bias or {}).items():
        try:
            token_id = int(key)
        except ValueError:
            token_id = -1
        if not 0 <= token_id <= UINT32_MAX:
            raise invalid(f"sampling.logit_bias: key {key!r} is not a token id", "sampling.logit_bias")
        msg.logit_bias[token_id] = float(bias)
    msg.ignore_eos = bool(body.ignore_eos)
    msg.include_stop_str_in_output = bool(body.include_stop_str_in_output)
    if structured is not None:
        msg.structured.CopyFrom(structured.to_proto())
    return msg


def api_error(error: RequestError, body) -> APIError:
    """A `RequestError` as the HTTP answer, its field and message in the OpenAI parameter's name."""
    field = error.field or ""
    message = error.message
    param = field or None
    if field.startswith("sampling."):
        name = field.removeprefix("sampling.")
        param = _openai_name(name, body)
        message = message.replace(f"sampling.{name}", param, 1).replace("sampling.", "")
    elif field in ("prompt", "token_ids"):
        param = "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
        message = message.replace("token_ids.ids", param, 1)
    elif field == "request_id":
        param = "X-Request-Id"
        message = message.replace("request_id", "X-Request-Id header", 1)
    return APIError.from_status(error.code, message, param)


def _openai_name(name: str, body) -> str:
    chat = isinstance(body, ChatCompletionRequest)
    if name == "max_tokens" and chat and body.max_completion_tokens is not None:
        return "max_completion_tokens"
    if name == "logprobs" and chat:
        return "top_logprobs"
    if name == "prompt_logprobs" and not chat and body.prompt_logprobs is None and body.echo:
        return "logprobs"
    return name
