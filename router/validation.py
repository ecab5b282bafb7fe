"""Turn a `GenerateRequest` into a `GenerationInput`, or reject it naming the field.

Checks run cheapest first: request id, input presence, sampling ranges (via
`SamplingParams.validate`, the one source of truth for them), a structured-output spec
(`check_structured`: the engine's own grammar check, bounded in size first, cached), the count of
token ids against the context-length budget (before a single id is copied, so
millions of ids cost nothing), the ids' range, tokenization, then the budget.

Token ids are copied and range-checked in slices of `TOKEN_IDS_SLICE`: each
slice is one short C call, so a worker thread that validates a large input
(the servicer hands inputs of `THREAD_TOKEN_IDS` ids or more to one) never
holds the GIL long enough to stall the event loop.
"""
from __future__ import annotations

import functools
import uuid
from collections.abc import Container, Sequence

from engine.sampling.params import SamplingParams
from engine.sampling.structured import StructuredOutput, to_llguidance
from proto.pdserve.v1 import generation_pb2 as pb
from router.backend import GenerationInput, Tokenizer

MAX_REQUEST_ID_CHARS = 256
TOKEN_IDS_SLICE = 65536     # ids copied and range-checked per C call
STRUCTURED_CACHE_SIZE = 256     # specs whose check is remembered (a client reuses its schemas)
THREAD_TOKEN_IDS = 32768    # inputs of at least this many ids are worth validating off the event loop


class RequestError(Exception):
    """A request the router refuses; ``code`` is the gRPC status name to send.

    ``field`` names the offending request field when one is to blame (``sampling.<name>`` for a
    sampling parameter, ``prompt``, ``token_ids``, ``request_id``); the HTTP front door maps it
    to the OpenAI parameter name.
    """

    def __init__(self, code: str, message: str, field: str | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.field = field


def invalid(message: str, field: str | None = None) -> RequestError:
    """An INVALID_ARGUMENT rejection."""
    return RequestError("INVALID_ARGUMENT", message, field)


def validate_request(
    request: pb.GenerateRequest,
    tokenizer: Tokenizer,
    max_model_len: int,
    in_flight: Container[str] = (),
    deadline: float | None = None,
    defaults: dict | None = None,
) -> GenerationInput:
    """Validate and tokenize one request.

    Args:
        request: the client's request.
        tokenizer: encodes ``prompt``; its ``vocab_size`` bounds ``token_ids``.
        max_model_len: prompt tokens + max_tokens must not exceed it.
        in_flight: request ids already being served (duplicate → ALREADY_EXISTS).
        deadline: ``time.monotonic()`` deadline to carry into the input.
        defaults: the model's sampling defaults for unset fields (`Backend.generation_defaults`).

    Returns:
        The `GenerationInput` for the backend; ``request_id`` is a fresh uuid
        when the request left it empty.

    Raises:
        RequestError: INVALID_ARGUMENT or ALREADY_EXISTS, naming the field.
    """
    request_id = _request_id(request.request_id, in_flight)
    which = request.WhichOneof("input")
    if which is None:
        raise invalid("input: set either prompt or token_ids", "prompt")
    if which == "prompt" and not request.prompt:
        raise invalid("prompt must not be empty", "prompt")
    if which == "token_ids" and not request.token_ids.ids:
        raise invalid("token_ids.ids must not be empty", "token_ids")
    params = sampling_params_from_proto(request.sampling, defaults)
    _check_sampling_token_ids(params, tokenizer.vocab_size)
    if which == "token_ids":
        _check_budget(len(request.token_ids.ids), params.max_tokens, max_model_len)   # O(1): nothing copied yet
        prompt_token_ids = _copy_token_ids(request.token_ids.ids, tokenizer.vocab_size)
    else:
        check_text_fits(request.prompt, tokenizer, max_model_len, "prompt")
        prompt_token_ids = list(tokenizer.encode(request.prompt))
        if not prompt_token_ids:
            raise invalid("prompt encodes to zero tokens", "prompt")
        _check_budget(len(prompt_token_ids), params.max_tokens, max_model_len)
    return GenerationInput(request_id, prompt_token_ids, params, deadline)


def num_token_ids(request: pb.GenerateRequest) -> int:
    """How many token ids the request carries (0 for a text prompt); O(1), copies nothing."""
    return len(request.token_ids.ids) if request.WhichOneof("input") == "token_ids" else 0


def sampling_params_from_proto(sampling: pb.SamplingParams, defaults: dict | None = None) -> SamplingParams:
    """Proto → engine `SamplingParams` (unset fields take ``defaults``, then its own), validated.

    Raises:
        RequestError: INVALID_ARGUMENT with ``sampling.<field>`` in the message and as ``field``.
    """
    params = SamplingParams.from_proto(sampling, defaults)
    try:
        params.validate()
        if params.structured is not None:
            check_structured(params.structured)
    except RecursionError:      # validate() parsed a JSON schema text nested deeper than json.loads goes
        raise invalid(f"sampling.{_nested_too_deeply(params.structured)}",
                      f"sampling.structured.{params.structured.kind}") from None
    except ValueError as e:
        name = str(e).split(" ", 1)[0].strip(":,.")   # validate() starts each message with the field's name
        raise invalid(f"sampling.{e}", f"sampling.{name}") from None
    return params


def check_structured(spec: StructuredOutput) -> None:
    """Refuse a structured-output spec that is malformed or too large (`StructuredOutput.validate`) or that
    the grammar library cannot express (an unsupported JSON Schema keyword, look-around in a regex, an
    undefined grammar rule): the engine's own check (`to_llguidance`), without a tokenizer, ~1 ms for a
    typical schema; a spec checked before costs a dictionary lookup.

    Raises:
        ValueError: starting ``structured.<kind>``, naming the problem.
    """
    try:
        spec.validate()
    except RecursionError:      # a JSON schema text nested deeper than json.loads goes
        raise ValueError(_nested_too_deeply(spec)) from None
    error = _grammar_error(spec)
    if error is not None:
        raise ValueError(error)


def _nested_too_deeply(spec: StructuredOutput) -> str:
    return f"structured.{spec.kind}: recursion limit exceeded: nested too deeply"


@functools.lru_cache(maxsize=STRUCTURED_CACHE_SIZE)
def _grammar_error(spec: StructuredOutput) -> str | None:
    try:
        to_llguidance(spec)
    except ValueError as e:
        return str(e)
    return None


def _check_sampling_token_ids(params: SamplingParams, vocab_size: int) -> None:
    """stop_token_ids and logit_bias keys must be token ids of the model's vocabulary."""
    for name, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias)):
        bad = next((t for t in ids if not 0 <= int(t) < vocab_size), None)
        if bad is not None:
            raise invalid(f"sampling.{name}: token id {bad} is out of range: vocab_size is {vocab_size}",
                          f"sampling.{name}")


def _request_id(request_id: str, in_flight: Container[str]) -> str:
    if not request_id:
        return uuid.uuid4().hex
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise invalid(f"request_id must be at most {MAX_REQUEST_ID_CHARS} characters, got {len(request_id)}",
                      "request_id")
    if not request_id.isprintable() or request_id.strip() != request_id:
        raise invalid("request_id must be printable characters without leading or trailing whitespace",
                      "request_id")
    if request_id in in_flight:
        raise RequestError("ALREADY_EXISTS", f"request_id {request_id!r} is already in flight", "request_id")
    return request_id


# A normaliser may drop characters (accents, controls) before tokenizing: the bound leaves room for that.
TEXT_SLACK = 2


def check_text_fits(text: str, tokenizer: Tokenizer, max_model_len: int, field: str) -> None:
    """Refuse, from its length alone, a text too long to be a prompt: with a token standing for at most
    ``tokenizer.max_token_chars`` characters, it would be more than ``max_model_len`` tokens. Costs
    nothing, so a multi-megabyte prompt is never tokenized (tokenizers without the bound skip it).

    Raises:
        RequestError: INVALID_ARGUMENT naming ``field``.
    """
    per_token = getattr(tokenizer, "max_token_chars", None)
    if not isinstance(per_token, int):
        return
    limit = max_model_len * per_token * TEXT_SLACK
    if len(text) > limit:
        raise invalid(f"{field}: {len(text)} characters is more than max_model_len ({max_model_len}) tokens "
                      f"of this model can hold (at most {limit} characters)", field)


def _check_budget(num_prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
    if num_prompt_tokens + max_tokens > max_model_len:
        raise invalid(
            f"prompt ({num_prompt_tokens} tokens) + sampling.max_tokens ({max_tokens}) = "
            f"{num_prompt_tokens + max_tokens} exceeds max_model_len ({max_model_len})", "sampling.max_tokens"
        )


def _copy_token_ids(ids: Sequence[int], vocab_size: int) -> list[int]:
    """The ids as a list, each checked against ``vocab_size`` (uint32 on the wire: never negative)."""
    token_ids: list[int] = []
    for start in range(0, len(ids), TOKEN_IDS_SLICE):
        part = ids[start:start + TOKEN_IDS_SLICE]
        if max(part) >= vocab_size:
            i = next(i for i, token_id in enumerate(part) if token_id >= vocab_size)
            raise invalid(f"token_ids.ids[{start + i}] = {part[i]} is out of range: vocab_size is {vocab_size}",
                          "token_ids")
        token_ids.extend(part)
    return token_ids
