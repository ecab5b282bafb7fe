"""Turn a `GenerateRequest` into a `GenerationInput`, or reject it naming the field.

Checks run cheapest first: request id, input presence, sampling ranges (via
`SamplingParams.validate`, the one source of truth for them), token ids,
tokenization, then the context-length budget.
"""
from __future__ import annotations

import uuid
from collections.abc import Container

from engine.sampling_params import SamplingParams
from proto.pdserve.v1 import generation_pb2 as pb
from router.backend import GenerationInput, Tokenizer

MAX_REQUEST_ID_CHARS = 256


class RequestError(Exception):
    """A request the router refuses; ``code`` is the gRPC status name to send."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


def invalid(message: str) -> RequestError:
    """An INVALID_ARGUMENT rejection."""
    return RequestError("INVALID_ARGUMENT", message)


def validate_request(
    request: pb.GenerateRequest,
    tokenizer: Tokenizer,
    max_model_len: int,
    in_flight: Container[str] = (),
    deadline: float | None = None,
) -> GenerationInput:
    """Validate and tokenize one request.

    Args:
        request: the client's request.
        tokenizer: encodes ``prompt``; its ``vocab_size`` bounds ``token_ids``.
        max_model_len: prompt tokens + max_tokens must not exceed it.
        in_flight: request ids already being served (duplicate → ALREADY_EXISTS).
        deadline: ``time.monotonic()`` deadline to carry into the input.

    Returns:
        The `GenerationInput` for the backend; ``request_id`` is a fresh uuid
        when the request left it empty.

    Raises:
        RequestError: INVALID_ARGUMENT or ALREADY_EXISTS, naming the field.
    """
    request_id = _request_id(request.request_id, in_flight)
    which = request.WhichOneof("input")
    if which is None:
        raise invalid("input: set either prompt or token_ids")
    if which == "prompt" and not request.prompt:
        raise invalid("prompt must not be empty")
    if which == "token_ids" and not request.token_ids.ids:
        raise invalid("token_ids.ids must not be empty")
    params = sampling_params_from_proto(request.sampling)
    if which == "token_ids":
        prompt_token_ids = list(request.token_ids.ids)
        _check_token_ids(prompt_token_ids, tokenizer.vocab_size)
    else:
        prompt_token_ids = list(tokenizer.encode(request.prompt))
        if not prompt_token_ids:
            raise invalid("prompt encodes to zero tokens")
    num_prompt_tokens = len(prompt_token_ids)
    if num_prompt_tokens + params.max_tokens > max_model_len:
        raise invalid(
            f"prompt ({num_prompt_tokens} tokens) + sampling.max_tokens ({params.max_tokens}) = "
            f"{num_prompt_tokens + params.max_tokens} exceeds max_model_len ({max_model_len})"
        )
    return GenerationInput(request_id, prompt_token_ids, params, deadline)


def sampling_params_from_proto(sampling: pb.SamplingParams) -> SamplingParams:
    """Proto → engine `SamplingParams` (unset fields take its defaults), validated.

    Raises:
        RequestError: INVALID_ARGUMENT with ``sampling.<field>`` in the message.
    """
    params = SamplingParams.from_proto(sampling)
    try:
        params.validate()
    except ValueError as e:
        raise invalid(f"sampling.{e}") from None
    return params


def _request_id(request_id: str, in_flight: Container[str]) -> str:
    if not request_id:
        return uuid.uuid4().hex
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise invalid(f"request_id must be at most {MAX_REQUEST_ID_CHARS} characters, got {len(request_id)}")
    if not request_id.isprintable() or request_id.strip() != request_id:
        raise invalid("request_id must be printable characters without leading or trailing whitespace")
    if request_id in in_flight:
        raise RequestError("ALREADY_EXISTS", f"request_id {request_id!r} is already in flight")
    return request_id


def _check_token_ids(token_ids: list[int], vocab_size: int) -> None:
    for i, token_id in enumerate(token_ids):
        if token_id >= vocab_size:
            raise invalid(f"token_ids.ids[{i}] = {token_id} is out of range: vocab_size is {vocab_size}")
