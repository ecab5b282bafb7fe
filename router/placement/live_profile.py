"""The router's live performance model: a base model corrected by what the cluster reports (no Ray, no I/O).

Auto placement (`router.placement.auto`) and the autoscaler (`deploy.autoscaler`, through the planner) ask
this one object, so they cannot disagree about the cluster. It answers the questions of
`engine.performance.PerformanceModel` from a base model (the measured profile, `pdserve profile`, when
one exists; else `LinearPerformance`'s figures), corrected by exponential moving averages over what the
router already receives:

    PrefillResult (remote prefill)   base time of the uncached tokens / prefill_s  → prefill speed factor
                                     kv_bytes / transfer_s              → link bytes/s; kv_bytes per token
                                     router TTFT − actor stages         → remote overhead
    first event of a local prefill   base time of its tokens / the actor's compute_s → chunked-prefill factor
    finished request                 (mean running batch, its context, its TPOT) → decode time per token
                                     = a · base time per token(batch, context) + b, refitted over recent
                                     requests (without speculation the base's time per token is its step)
                                     its speculative tokens proposed and accepted → the acceptance rate of
                                     its decode actor (decayed), which the base's speculative step takes

The decode fit keeps `a` at 1 (only `b` moves, a fixed per-step cost the profile does not see) until the
recent requests' batches spread by `MIN_BATCH_SPREAD`; then both are fitted. With speculative decoding
(`base.speculation`) each finished request is fitted at its own acceptance, and placement asks at the
decode actor's: what the decode actors report replaces the acceptance the base started from (the plan's
or the profile's). Per decode actor it also keeps what placement needs now: the prompt tokens it is
prefilling locally (the router's own count).
What each decode actor holds cached comes from the cache-event index (`router.placement.kv_index`).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from engine.performance import DecodeStep, LinearPerformance, MeasuredPerformance, PerformanceModel, Speculation
from router.placement.auto import DecodeProfile, LinkProfile, PrefillProfile

SMOOTHING = 0.2              # EMA weight of the newest observation
STEP_SAMPLES = 64            # recent (batch, base step, TPOT) triples the decode step fit uses
MIN_BATCH_SPREAD = 2.0       # batches must span this much before the slope is fitted
MIN_STEP_S = 1e-6
SPEC_DECAY = 0.9             # weight of the past per finished request, in an actor's speculative counts
MIN_SPEC_PROPOSED = 16.0     # proposed tokens (decayed) before an acceptance rate is trusted
DEFAULT_REMOTE_OVERHEAD_S = 0.005
DEFAULT_CHUNK_TOKENS = 512


def _ema(old: float, new: float) -> float:
    return (1.0 - SMOOTHING) * old + SMOOTHING * new


@dataclass(slots=True)
class _SpecCounts:
    """Speculative tokens proposed and accepted, decayed per report."""
    proposed: float = 0.0
    accepted: float = 0.0

    def add(self, proposed: int, accepted: int) -> None:
        self.proposed = SPEC_DECAY * self.proposed + proposed
        self.accepted = SPEC_DECAY * self.accepted + accepted

    @property
    def ratio(self) -> float | None:
        return self.accepted / self.proposed if self.proposed >= MIN_SPEC_PROPOSED else None


@dataclass(slots=True)
class _DecodeActorState:
    local_prefill_tokens: int = 0
    spec: _SpecCounts | None = None


class LiveProfile(PerformanceModel):
    """`base`'s answers, corrected live; and per-decode-actor state.

    Args:
        base: the model the corrections start from (none yet: `LinearPerformance()`).
        block_size: prefills shorter than a block teach nothing (their time is overhead).
        chunk_tokens: prompt tokens a decode actor prefills per step when it prefills locally.
        remote_overhead_s: the starting dispatch + handoff time of a remote prefill, until measured.
    """

    def __init__(self, base: PerformanceModel | None = None, block_size: int = 16,
                 chunk_tokens: int = DEFAULT_CHUNK_TOKENS, remote_overhead_s: float = DEFAULT_REMOTE_OVERHEAD_S):
        self.base = base or LinearPerformance()
        self.block_size, self.chunk_tokens = block_size, chunk_tokens
        self.prefill_speed = 1.0                     # base prefill time / observed (EMA)
        self.local_prefill_speed: float | None = None    # the same for local prefill; None: prefill_speed
        self.step_scale, self.step_offset_s = 1.0, 0.0   # decode time per token = scale · base's + offset
        self.remote_overhead_s = remote_overhead_s
        self._kv_bytes_per_s = self.base.kv_bytes_per_s
        self.kv_bytes_per_token = self.base.kv_bytes_per_token
        self.output_tokens: float | None = None       # mean output length of finished requests
        self._steps: deque[tuple[float, float, float]] = deque(maxlen=STEP_SAMPLES)
        self._decode: dict[str, _DecodeActorState] = {}
        self._spec = _SpecCounts()                      # every decode actor's reports together

    # ---- the performance model ------------------------------------------
    @property
    def measured(self) -> MeasuredPerformance | None:
        return self.base.measured

    @property
    def kv_bytes_per_s(self) -> float:
        return self._kv_bytes_per_s

    def prefill_seconds(self, prompt_len: float) -> float:
        return self.base.prefill_seconds(prompt_len) / self.prefill_speed

    def prefill_capacity(self, prompt_len: float) -> float:
        return self.base.prefill_capacity(prompt_len) * self.prefill_speed

    @property
    def speculation(self) -> Speculation | None:
        """The base's speculative settings at the acceptance the decode actors report (once they have)."""
        spec, live = self.base.speculation, self.acceptance()
        return spec if spec is None or live is None else spec.with_acceptance(live)

    def decode_step_seconds(self, batch: float, context: float) -> float:
        return self._corrected(self.base.decode_step_seconds(batch, context))

    def spec_step_seconds(self, batch: float, context: float, num_tokens: int) -> float:
        return self._corrected(self.base.spec_step_seconds(batch, context, num_tokens))

    def decode_step(self, batch: float, context: float, acceptance: float | None = None) -> DecodeStep:
        """The base's step at `acceptance` (None: the decode actors' reported one, else the base's), its time
        per token corrected by the fit."""
        step = self.base.decode_step(batch, context, self.acceptance() if acceptance is None else acceptance)
        return DecodeStep(step.num_tokens, self._corrected(step.token_s) * step.tokens_per_step, step.tokens_per_step)

    def _corrected(self, seconds: float) -> float:
        return max(self.step_scale * seconds + self.step_offset_s, MIN_STEP_S)

    def acceptance(self, actor_id: str | None = None) -> float | None:
        """The speculative acceptance rate `actor_id` reports (None, or an actor that has not reported enough:
        every decode actor's together); None when none has."""
        state = self._decode.get(actor_id) if actor_id is not None else None
        ratio = state.spec.ratio if state is not None and state.spec is not None else None
        return self._spec.ratio if ratio is None else ratio

    def local_prefill_seconds(self, prompt_len: float) -> float:
        """A prompt prefilled in chunks on a decode actor, between its decode steps."""
        return self.base.prefill_seconds(prompt_len) / (self.local_prefill_speed or self.prefill_speed)

    # ---- the figures placement reads (at one request's lengths) ---------
    def prefill_profile(self, prompt_len: float) -> PrefillProfile:
        return PrefillProfile(prompt_len / self.prefill_seconds(prompt_len), self.remote_overhead_s)

    def link(self) -> LinkProfile:
        return LinkProfile(self.kv_bytes_per_s, self.kv_bytes_per_token)

    def decode_profile(self, prompt_len: float, context: float, actor_id: str | None = None) -> DecodeProfile:
        """Decode actor `actor_id`'s step and time per output token vs batch at `context` (with speculation, at
        its reported acceptance), and its chunked-prefill rate at `prompt_len`."""
        acceptance = self.acceptance(actor_id)
        return DecodeProfile(lambda batch: self.decode_step(batch, context, acceptance).step_s,
                             prompt_len / self.local_prefill_seconds(prompt_len), self.chunk_tokens,
                             lambda batch: self.token_seconds(batch, context, acceptance))

    def local_backlog(self, actor_id: str) -> int:
        return self._actor(actor_id).local_prefill_tokens

    # ---- observations ---------------------------------------------------
    def prefill_done(self, uncached_tokens: int, prefill_s: float, kv_bytes: int, transfer_s: float,
                     num_prompt_tokens: int) -> None:
        """A remote prefill's result (the actor's own figures)."""
        if uncached_tokens >= self.block_size and prefill_s > 0:
            predicted = self.base.prefill_share_seconds(max(num_prompt_tokens, uncached_tokens), uncached_tokens)
            self.prefill_speed = _ema(self.prefill_speed, predicted / prefill_s)
        if kv_bytes > 0 and transfer_s > 0:
            self._kv_bytes_per_s = _ema(self._kv_bytes_per_s, kv_bytes / transfer_s)
            if num_prompt_tokens > 0:
                self.kv_bytes_per_token = kv_bytes / num_prompt_tokens      # a property of the model: exact

    def remote_first_token(self, router_ttft_s: float, actor_s: float) -> None:
        """A remote request's first token: the router's window less the actors' stages is overhead."""
        self.remote_overhead_s = _ema(self.remote_overhead_s, max(router_ttft_s - actor_s, 0.0))

    def local_started(self, actor_id: str, tokens: int) -> None:
        self._actor(actor_id).local_prefill_tokens += tokens

    def local_ended(self, actor_id: str, tokens: int, compute_s: float | None = None) -> None:
        """A local prefill ended (first token, or failure: compute_s None)."""
        state = self._actor(actor_id)
        state.local_prefill_tokens = max(state.local_prefill_tokens - tokens, 0)
        if compute_s and compute_s > 0 and tokens >= self.block_size:
            old = self.local_prefill_speed or self.prefill_speed
            self.local_prefill_speed = _ema(old, self.base.prefill_seconds(tokens) / compute_s)

    def finished(self, mean_batch: float, tpot_s: float, num_output_tokens: int, context: float,
                 actor_id: str | None = None, spec_proposed: int = 0, spec_accepted: int = 0) -> None:
        """A request finished on decode actor `actor_id`: its TPOT at the batch it decoded in (at `context`, its
        prompt and half its output) refits the decode time per token; the speculative tokens its sequences had
        verified there (`spec_proposed`) and accepted count in that actor's acceptance rate, and the fit takes
        the base's time per token at the request's own rate."""
        self.output_tokens = num_output_tokens if self.output_tokens is None else \
            _ema(self.output_tokens, num_output_tokens)
        acceptance = None                   # (without speculation: the plain step)
        if self.base.speculation is not None:      # a request that proposed nothing decoded plain steps
            acceptance = spec_accepted / spec_proposed if spec_proposed > 0 else 0.0
        if spec_proposed > 0:
            self._spec.add(spec_proposed, spec_accepted)
            if actor_id is not None:
                state = self._actor(actor_id)
                state.spec = state.spec or _SpecCounts()
                state.spec.add(spec_proposed, spec_accepted)
        if num_output_tokens < 2 or tpot_s <= 0:
            return
        batch = max(mean_batch, 1.0)
        self._steps.append((batch, self.base.token_seconds(batch, context, acceptance), tpot_s))
        batches = [b for b, _, _ in self._steps]
        xs = [x for _, x, _ in self._steps]
        ys = [y for _, _, y in self._steps]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        var = sum((x - mx) ** 2 for x in xs)
        if max(batches) - min(batches) >= MIN_BATCH_SPREAD and var > 1e-18:
            self.step_scale = max(sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var, 0.0)
        self.step_offset_s = my - self.step_scale * mx

    def forget(self, actor_id: str) -> None:
        """The actor left the decode pool (flipped, replaced or removed)."""
        self._decode.pop(actor_id, None)

    def _actor(self, actor_id: str) -> _DecodeActorState:
        state = self._decode.get(actor_id)
        if state is None:
            state = self._decode[actor_id] = _DecodeActorState()
        return state
