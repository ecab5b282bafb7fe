"""The interface between the router's gRPC front end and whatever generates.

The router validates and tokenizes a request, then hands a `GenerationInput`
to `Backend.generate` and streams each `GenerationChunk` it yields to the
client. The cluster (Ray prefill/decode pools) implements `Backend`; tests
use a fake. The router never imports ray.

Request lifecycle as the router sees it::

    validate → GenerationInput → backend.generate(inp) ──yield──► chunk …
                                                      └─ last chunk: finish_reason, usage, timing

Contract for implementers:

- `generate` is an async generator. Each of the ``n`` sequences (``params.n``;
  ``params.best_of`` of them are generated when it is set, and the router keeps
  the best ``n``) ends with one chunk whose ``finish_reason`` is one of
  `FINISH_REASONS` (``pdserve.v1.FinishReason`` values; spelled as names only at the
  JSON edge, in logs and in metrics labels); the request's last chunk should carry
  ``usage`` and ``timing``. Logprobs come with the tokens they score.
  ``text`` is a UTF-8-safe delta (never half a character).
- Errors: raise `BackendError(code, message)`; ``code`` is a gRPC status
  name and is sent to the client as that status.
- Cancellation: when the client disconnects or its deadline passes, the
  router cancels the consuming task and closes the generator (``aclose``),
  so a ``CancelledError`` or ``GeneratorExit`` arrives at the backend's
  current ``await``/``yield``. The backend must free the request's state on
  every actor in a ``finally`` (or ``except``) block and let it propagate.
- ``inp.deadline`` (``time.monotonic()`` seconds, or None) is the client's
  deadline; the router enforces it too, but remote steps should not outlive it.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from engine.sampling.params import SamplingParams
from proto.pdserve.v1 import generation_pb2 as pb
from router.roles import role_named
from router.timing import Timing

FINISH_REASONS = (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_ABORT)


def finish_reason_name(reason: int) -> str:
    """"stop" | "length" | "abort": a `pb.FinishReason` as JSON bodies, log lines and metrics labels spell it."""
    return pb.FinishReason.Name(reason).removeprefix("FINISH_REASON_").lower()

# gRPC status names a backend may raise (others are sent as INTERNAL).
BACKEND_ERROR_CODES = (
    "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND",
    "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
    "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS",
)


class Tokenizer(Protocol):
    """What the router needs from a tokenizer."""

    vocab_size: int
    eos_token_id: int | None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...


@dataclass(slots=True)
class GenerationInput:
    """A validated, tokenized request."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    deadline: float | None  # time.monotonic() deadline, or None for no deadline


@dataclass(slots=True)
class Usage:
    """Token counts of a finished request."""

    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    # speculative tokens verified for its sequences on the decode actor that finished them, and accepted
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0


@dataclass(slots=True)
class GenerationChunk:
    """New tokens of one sequence of a request.

    With ``n`` > 1 (or ``best_of``) the sequences' chunks interleave, told apart by
    ``index``; each sequence's last chunk has ``finish_reason`` set, and the request's
    last chunk (the one that finishes its last running sequence) carries ``usage``
    (completion tokens summed over the sequences) and ``timing``.
    """

    token_ids: list[int]
    text: str
    finish_reason: int | None  # None, or a pb.FinishReason: STOP | LENGTH | ABORT
    usage: Usage | None = None
    timing: Timing | None = None
    index: int = 0                                   # which of the n sequences
    logprobs: list[pb.TokenLogprob] | None = None    # one per token id, when sampling.logprobs is set
    prompt_logprobs: list[pb.TokenLogprob] | None = None   # first chunk only, when sampling.prompt_logprobs is set
    matched_stop: str | int | None = None            # finish "stop": the stop string, or the EOS / stop token id


@dataclass(slots=True)
class ActorStats:
    """Load of one actor, as reported by `Backend.stats`."""

    actor_id: str
    role: int  # a pb.ActorRole
    kv_blocks_total: int
    kv_blocks_used: int
    queued_requests: int
    running_requests: int
    # Internal connections it refused since it started, by `REFUSAL_REASONS` (decode actors: its KV
    # receiver and its token stream).
    refused_connections: dict[str, int] = field(default_factory=dict)
    # The tiers below its paged cache, top first (`engine.kv_cache.tiers.KVTiers.stats`: one dict per tier).
    kv_tiers: list[dict] = field(default_factory=list)
    # Speculative decoding (decode and colocated actors): tokens proposed and verified, and of those
    # accepted, since the actor started.
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0

    @classmethod
    def from_report(cls, report: dict) -> ActorStats:
        """From an actor's stats report (its role by name: `router.roles.ROLE_NAMES`)."""
        return cls(**{**report, "role": role_named(report["role"])})


class BackendError(Exception):
    """A request failed in the backend; sent to the client as gRPC status ``code``.

    Args:
        code: a gRPC status name, e.g. "RESOURCE_EXHAUSTED", "UNAVAILABLE",
            "INVALID_ARGUMENT", "DEADLINE_EXCEEDED".
        message: human-readable reason, sent to the client.
    """

    def __init__(self, code: str, message: str) -> None:
        if code not in BACKEND_ERROR_CODES:
            raise ValueError(f"unknown gRPC status name {code!r}")
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class Backend(ABC):
    """What the front doors dispatch to (implemented by the cluster, faked in tests).

    The front doors use only this. The cluster's implementation, `router.dispatcher.Dispatcher`, adds the
    narrow face deploy uses to change its pools and read its records (`FinishedRequest`, `PlacementRecord`).

    Attributes:
        tokenizer: ``encode(str) -> list[int]``, ``decode(list[int]) -> str``,
            ``vocab_size``, ``eos_token_id``.
        max_model_len: most tokens (prompt + output) one request may hold.
        generation_defaults: sampling defaults for fields a request leaves unset
            (``SamplingParams.from_proto(msg, defaults)``); empty = the engine's.
    """

    tokenizer: Tokenizer
    max_model_len: int
    generation_defaults: dict = {}  # the model's generation_config sampling defaults for unset fields (read only)

    @abstractmethod
    async def generate(self, inp: GenerationInput) -> AsyncIterator[GenerationChunk]:
        """Generate for one request, yielding chunks as tokens are produced.

        Args:
            inp: the validated request; ``inp.params`` has passed ``validate()``
                and prompt + max_tokens fits ``max_model_len``.

        Yields:
            `GenerationChunk`s; the last has ``finish_reason``, ``usage``, ``timing``.

        Raises:
            BackendError: the request failed; ``code`` becomes the gRPC status.
        """
        raise NotImplementedError
        yield  # makes this an async generator, like the implementations

    @abstractmethod
    async def stats(self) -> list[ActorStats]:
        """Return the current load of every actor."""

    @abstractmethod
    async def ready(self) -> bool:
        """Return True once every pool can serve (the health check turns SERVING)."""
