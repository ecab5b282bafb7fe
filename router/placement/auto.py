"""Per-request placement for ``routing.mode: auto`` (pure functions over typed inputs; no Ray, no I/O).

For each request the router weighs two ways to compute its prompt:

    remote  prefill on a prefill actor, then ship the KV to the decode actor
            TTFT = overhead + (prefill actor's queued + this prompt's uncached tokens) / its prefill rate
                   + KV bytes / link bytes/s + one decode step at the running batch
            TPOT = time per output token at (running + 1) + the decode actor's local-prefill backlog, spread
                   over the tokens its batch still streams
    local   chunked prefill on the decode actor itself (conditional disaggregation), reusing the prefix
            that actor already holds
            TTFT = (its local-prefill backlog + this prompt's tokens it lacks) / its chunked-prefill rate
                   + one decode step at the running batch per chunk
            TPOT = time per output token at (running + 1) + (backlog + this prompt) prefill seconds, spread
                   over the tokens the batch still streams (the running requests absorb the prefill chunks)

The time per output token is the decode step's, or with speculative decoding the step the engine would
run over the tokens it yields per sequence at the decode actor's acceptance (`DecodeProfile.token_s`).

Each option's slack is ``1 - estimate / SLO`` for TTFT and for TPOT. An option *keeps* the SLOs when
both slacks are >= 0. The choice: the options that keep both SLOs first; among them the most headroom
(TTFT slack + TPOT slack); when neither keeps both, the smaller violation (the larger of the two
options' worst slack). Ties go local (no transfer, no second actor). No prefill actor: local.

Whether the cluster needs a prefill actor at all is a separate question, asked of every placement:
a request *needs* one when the local option breaks an SLO and the rule above would send it remote
(`Placement.needs_prefill_actor`; the autoscaler's role balance weighs prefill actors by the share
of prompt tokens that need one). It is asked at one layout whatever the current split: every actor
decoding, so the local option sees the decode actor's running batch as it would be spread over all
actors (`all_decode_running`; with prefill actors in the pool the batch each decode actor carries
is larger, and asking at the current split would lean toward keeping them). With the prefill pool
flipped to zero, the remote option is priced against a `ShadowPrefill`: the queue a prefill actor
would hold had it taken every prompt that needed it, drained at the measured prefill rate. The
request still runs local; the answer says whether flipping an actor back to prefill would help.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from enum import Enum


class Choice(str, Enum):
    REMOTE = "remote"        # prefill actor + KV transfer
    LOCAL = "local"          # chunked prefill on the decode actor


@dataclass(slots=True, frozen=True)
class PrefillProfile:
    """A prefill actor's measured rate, and the fixed cost of a remote prefill."""

    tokens_per_s: float          # prompt tokens/s it computes
    overhead_s: float = 0.0      # dispatch + handoff time the actor's own stages do not show


@dataclass(slots=True, frozen=True)
class LinkProfile:
    """The configured KV link (transport + codec) as measured."""

    kv_bytes_per_s: float        # uncompressed KV bytes moved per second
    kv_bytes_per_token: float    # KV bytes of one prompt token (all layers, K and V)


@dataclass(slots=True, frozen=True)
class DecodeProfile:
    """A decode actor's step time and time per output token vs running batch (at the request's context), and
    its chunked-prefill rate."""

    step_s: Callable[[float], float]   # a decode step's seconds at a running batch
    prefill_tokens_per_s: float  # prompt tokens/s it prefills between decode steps
    chunk_tokens: int = 512      # prompt tokens per step when it prefills in chunks
    token_s: Callable[[float], float] | None = None   # seconds per output token (None: one per step)

    def seconds_per_token(self, batch: float) -> float:
        return (self.token_s or self.step_s)(batch)

    @classmethod
    def linear(cls, step_base_s: float, step_per_seq_s: float, prefill_tokens_per_s: float,
               chunk_tokens: int = 512) -> DecodeProfile:
        """A step of `step_base_s` + `step_per_seq_s` per running sequence."""
        return cls(lambda batch: step_base_s + step_per_seq_s * max(batch, 0.0), prefill_tokens_per_s, chunk_tokens)


@dataclass(slots=True, frozen=True)
class PrefillState:
    """The prefill actor the request would go to, now."""

    actor_id: str
    queued_tokens: int           # prompt tokens queued there (the router's own count)
    cached_tokens: int           # prompt tokens of this request it already holds


@dataclass(slots=True, frozen=True)
class DecodeState:
    """The decode actor holding the request's reservation, now."""

    actor_id: str
    running: int                 # requests decoding there
    local_prefill_tokens: int    # prompt tokens it is still prefilling locally for other requests
    cached_tokens: int           # prompt tokens of this request it already holds (where known)


@dataclass(slots=True, frozen=True)
class PlacementInputs:
    num_prompt_tokens: int
    output_tokens: float         # tokens the decode batch still streams (the TPOT horizon), >= 1
    ttft_slo_s: float
    tpot_slo_s: float
    decode: DecodeState
    decode_profile: DecodeProfile
    prefill: PrefillState | None         # None: no healthy prefill actor
    prefill_profile: PrefillProfile
    link: LinkProfile


@dataclass(slots=True, frozen=True)
class Estimate:
    """One option's predicted TTFT and TPOT, and its slack against the SLOs."""

    choice: Choice
    ttft_s: float
    tpot_s: float
    ttft_slack: float            # 1 - ttft / SLO (negative: the SLO is missed)
    tpot_slack: float

    @property
    def keeps_slo(self) -> bool:
        return self.ttft_slack >= 0.0 and self.tpot_slack >= 0.0

    @property
    def headroom(self) -> float:
        return self.ttft_slack + self.tpot_slack

    @property
    def worst_slack(self) -> float:
        return min(self.ttft_slack, self.tpot_slack)


@dataclass(slots=True, frozen=True)
class Placement:
    """The decision for one request and what it was made from."""

    choice: Choice
    reason: str                  # "keeps_slo" | "least_violation" | "no_prefill_actor"
    local: Estimate
    remote: Estimate | None      # None: no prefill actor, none shadowed either
    inputs: PlacementInputs
    needs_prefill_actor: bool = False    # local breaks an SLO and the rule picks remote (or would)

    def log_fields(self) -> dict[str, object]:
        """Flat key/values for the request's log line."""
        fields: dict[str, object] = {
            "placement": self.choice.value, "placement_reason": self.reason,
            "est_local_ttft_s": self.local.ttft_s, "est_local_tpot_s": self.local.tpot_s,
            "decode_running": self.inputs.decode.running,
            "decode_local_backlog": self.inputs.decode.local_prefill_tokens,
            "decode_cached_tokens": self.inputs.decode.cached_tokens,
            "needs_prefill_actor": self.needs_prefill_actor,
        }
        if self.remote is not None:
            fields.update(est_remote_ttft_s=self.remote.ttft_s, est_remote_tpot_s=self.remote.tpot_s,
                          prefill_queued_tokens=self.inputs.prefill.queued_tokens,
                          prefill_cached_tokens=self.inputs.prefill.cached_tokens)
        return fields


def _estimate(choice: Choice, ttft_s: float, tpot_s: float, inp: PlacementInputs) -> Estimate:
    return Estimate(choice, ttft_s, tpot_s, 1.0 - ttft_s / inp.ttft_slo_s, 1.0 - tpot_s / inp.tpot_slo_s)


def estimate_local(inp: PlacementInputs) -> Estimate:
    """Chunked prefill on the decode actor: its backlog first, then this prompt's tokens it lacks."""
    dp, ds = inp.decode_profile, inp.decode
    uncached = max(inp.num_prompt_tokens - ds.cached_tokens, 1)        # the last token is always computed
    tokens = ds.local_prefill_tokens + uncached
    num_chunks = math.ceil(tokens / max(dp.chunk_tokens, 1))
    prefill_s = tokens / dp.prefill_tokens_per_s
    ttft = prefill_s + num_chunks * dp.step_s(ds.running)
    tpot = dp.seconds_per_token(ds.running + 1) + prefill_s / max(inp.output_tokens, 1.0)
    return _estimate(Choice.LOCAL, ttft, tpot, inp)


def estimate_remote(inp: PlacementInputs) -> Estimate | None:
    """Prefill actor + KV transfer; None without a prefill actor."""
    if inp.prefill is None:
        return None
    pp, ps, dp, ds = inp.prefill_profile, inp.prefill, inp.decode_profile, inp.decode
    uncached = max(inp.num_prompt_tokens - ps.cached_tokens, 1)
    prefill_s = (ps.queued_tokens + uncached) / pp.tokens_per_s
    transfer_s = inp.num_prompt_tokens * inp.link.kv_bytes_per_token / inp.link.kv_bytes_per_s
    ttft = pp.overhead_s + prefill_s + transfer_s + dp.step_s(ds.running)
    backlog_s = ds.local_prefill_tokens / dp.prefill_tokens_per_s      # the decode actor's, either way
    tpot = dp.seconds_per_token(ds.running + 1) + backlog_s / max(inp.output_tokens, 1.0)
    return _estimate(Choice.REMOTE, ttft, tpot, inp)


def _choose(local: Estimate, remote: Estimate) -> tuple[Choice, str]:
    keeping = [e for e in (local, remote) if e.keeps_slo]
    if keeping:
        return max(keeping, key=lambda e: (e.headroom, e.choice is Choice.LOCAL)).choice, "keeps_slo"
    return max((local, remote), key=lambda e: (e.worst_slack, e.choice is Choice.LOCAL)).choice, "least_violation"


def needs_prefill_actor(inp: PlacementInputs, all_decode_running: int | None = None) -> bool:
    """Whether the request needs a prefill actor (module docstring), asked with the decode actor running
    `all_decode_running` requests (None: as many as it runs now)."""
    if all_decode_running is not None and all_decode_running != inp.decode.running:
        inp = replace(inp, decode=replace(inp.decode, running=all_decode_running))
    return _needs(estimate_local(inp), estimate_remote(inp))


def _needs(local: Estimate, remote: Estimate | None) -> bool:
    return remote is not None and not local.keeps_slo and _choose(local, remote)[0] is Choice.REMOTE


def place(inp: PlacementInputs, shadow: bool = False, all_decode_running: int | None = None) -> Placement:
    """Remote or local for one request (the rule in the module docstring). `shadow`: `inp.prefill` is a
    `ShadowPrefill`'s state, not an actor: the request goes local, and the answer says whether it needed one.
    `all_decode_running`: the decode actor's batch were every actor decoding (for `needs_prefill_actor`)."""
    local, remote = estimate_local(inp), estimate_remote(inp)
    if remote is None:
        return Placement(Choice.LOCAL, "no_prefill_actor", local, None, inp)
    choice, reason = _choose(local, remote)
    same_batch = all_decode_running is None or all_decode_running == inp.decode.running
    needs = _needs(local, remote) if same_batch else needs_prefill_actor(inp, all_decode_running)
    if shadow:
        return Placement(Choice.LOCAL, "no_prefill_actor", local, remote, inp, needs)
    return Placement(choice, reason, local, remote, inp, needs)


@dataclass(slots=True)
class ShadowPrefill:
    """The prefill actor the cluster does not have (mode auto, prefill pool at zero): the prompt tokens
    it would have queued, had it taken every request that needed it, drained at the prefill rate."""

    queued_tokens: float = 0.0
    at: float = 0.0              # time.monotonic() of the last update

    def state(self, now: float, tokens_per_s: float) -> PrefillState:
        """Its queue now, as a prefill actor's state (it caches nothing)."""
        self._drain(now, tokens_per_s)
        return PrefillState("shadow", math.ceil(self.queued_tokens), 0)

    def take(self, tokens: int, now: float, tokens_per_s: float) -> None:
        """A request that needed a prefill actor: its tokens join the shadow queue."""
        self._drain(now, tokens_per_s)
        self.queued_tokens += tokens

    def _drain(self, now: float, tokens_per_s: float) -> None:
        self.queued_tokens = max(self.queued_tokens - max(now - self.at, 0.0) * tokens_per_s, 0.0)
        self.at = now
