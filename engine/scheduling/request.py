"""A request owns its state: tokens, block table, computed-token count and status."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.sampling.params import SamplingParams
from engine.tokenizer import IncrementalDetokenizer
from proto.pdserve.v1 import generation_pb2 as pb

if TYPE_CHECKING:
    from engine.sampling.grammar import SequenceGrammar


class RequestStatus(enum.Enum):
    WAITING = "waiting"                  # queued for (re)prefill
    RUNNING = "running"                  # in the batch: prefilling in chunks or decoding
    WAITING_FOR_KV = "waiting_for_kv"    # decode side: KV blocks still arriving
    PREFILLED = "prefilled"              # prefill side: first token sampled, blocks held for transfer
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    def __init__(self, value: str) -> None:
        # The FINISHED_ statuses; a plain attribute, not a property: it is read for every sequence of every step.
        self.finished: bool = self._name_.startswith("FINISHED_")


@dataclass(slots=True, eq=False)
class Request:
    """One sequence. A request with n > 1 is sequence 0 (the one `Engine.requests` holds, which
    prefills the prompt) plus, once the prompt is computed, its forks: `sequences` on sequence 0
    lists them all in index order; each fork has the same request_id, its own `index`, `seed`,
    output and block table, and `parent` pointing at sequence 0."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int                                  # per-request draw seed (params.seed or a random one)
    prefill_only: bool = False
    # Its prompt KV went through the lossy transfer codec (engine/kv_cache/prompt_kv.py): recomputing the
    # prompt here goes through the same codec.
    prompt_kv_lossy: bool = False
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)   # of full computed blocks, chained
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0                 # prompt tokens served from the prefix cache
    status: RequestStatus = RequestStatus.WAITING
    detokenizer: IncrementalDetokenizer | None = None
    text: str = ""                             # output text so far (stop strings cut off)
    num_emitted_chars: int = 0                 # how much of `text` was already streamed
    stop_reason: str | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    # Decode side of disaggregation: the transfer this request waits for (WAITING_FOR_KV), and
    # until when it may wait for the transfer to begin (time.monotonic()).
    kv_transfer_id: str | None = None
    kv_deadline: float | None = None
    index: int = 0                             # which of the request's sequences this is
    parent: Request | None = None              # sequence i > 0: sequence 0 of its request
    sequences: list[Request] = field(default_factory=list)   # sequence 0, once forked: all, index order
    cumulative_logprob: float = 0.0            # of the sampled tokens (when params.needs_logprobs)
    matched_stop: str | int | None = None      # the stop string or token id that ended the sequence
    # While the prompt is prefilled with params.prompt_logprobs: entry p scores prompt[p + 1].
    prompt_logprobs: list[pb.TokenLogprob] = field(default_factory=list)
    # params.structured: this sequence's matcher (its compiled grammar may still be on its way).
    grammar: SequenceGrammar | None = None
    # Speculative decoding (engine/spec): tokens proposed to follow this sequence's last token, verified by
    # the next step, and with a draft model the draft's distribution each was drawn from ([k, V]; None for
    # n-gram proposals, a point mass). Empty between steps.
    spec_token_ids: list[int] = field(default_factory=list)
    spec_draft_probs: object | None = None
    spec_state: object | None = None           # the proposer's state for this sequence (engine/spec: ngram, draft)
    num_spec_proposed: int = 0                 # draft tokens this sequence had verified, over its life
    num_spec_accepted: int = 0                 # of those, accepted

    @property
    def root(self) -> Request:
        """Sequence 0: the request as `Engine.requests` knows it."""
        return self.parent if self.parent is not None else self

    @property
    def grammar_ready(self) -> bool:
        """No grammar, or its compiled grammar is here: the request may be scheduled."""
        return self.grammar is None or self.grammar.ready

    @property
    def owes_prompt_logprobs(self) -> bool:
        """Its prompt is being computed and its first output must carry prompt logprobs."""
        return self.params.prompt_logprobs is not None and self.parent is None and not self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output without building the whole list."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n]

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids


@dataclass(slots=True)
class RequestOutput:
    """What one engine step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finish_reason: str | None          # None while running; "stop" | "length" | "abort"
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    prefilled: bool = False            # prefill-only request: KV ready to ship in `block_ids`
    block_ids: list[int] = field(default_factory=list)
    first_scheduled_time: float | None = None
    index: int = 0                     # which of the request's sequences (n > 1)
    logprobs: list[pb.TokenLogprob] | None = None          # one per new token (params.needs_logprobs)
    prompt_logprobs: list[pb.TokenLogprob] | None = None   # first output of sequence 0 (params.prompt_logprobs)
    matched_stop: str | int | None = None                  # finish "stop": the stop string, EOS or stop token id
    num_spec_proposed: int = 0         # speculative tokens verified for the sequence so far (engine/spec)
    num_spec_accepted: int = 0         # of those, accepted


@dataclass(slots=True)
class Completion:
    """The whole result of one sequence from `Engine.generate` (a prompt gives num_sequences of them)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    num_cached_tokens: int = 0
    index: int = 0
    logprobs: list[pb.TokenLogprob] | None = None
    prompt_logprobs: list[pb.TokenLogprob] | None = None
    matched_stop: str | int | None = None
    cumulative_logprob: float = 0.0
