"""The router's live profile of its actors, learned from what each request reports (no Ray, no I/O).

`routing.mode: auto` places requests from these figures (`router.placement.auto`). They start from a seed
(the deploy profile, `pdserve profile`, when one exists; else generic figures) and follow the cluster
as it serves, by exponential moving averages over what the router already receives:

    PrefillResult (remote prefill)   uncached tokens / prefill_s        → prefill tokens/s
                                     kv_bytes / transfer_s              → link bytes/s; kv_bytes per token
                                     router TTFT − actor stages         → remote overhead
    first event of a local prefill   uncached tokens / the actor's compute_s → chunked-prefill tokens/s
    finished request                 (mean running batch, its TPOT)     → decode step = base + per_seq · batch

Per decode actor it also keeps what placement needs now: the prompt tokens it is prefilling locally
(the router's own count). What each decode actor holds cached comes from the cache-event index
(`router.placement.kv_index`), not from here.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from router.placement.auto import DecodeProfile, LinkProfile, PrefillProfile

SMOOTHING = 0.2              # EMA weight of the newest observation
STEP_SAMPLES = 64            # recent (batch, TPOT) pairs the decode step fit uses
MIN_BATCH_SPREAD = 2.0       # batches must span this much before the slope is fitted (else the seed's)


@dataclass(slots=True)
class ProfileSeed:
    """Starting figures (deploy fills them from a measured profile)."""

    prefill_tokens_per_s: float = 2000.0
    remote_overhead_s: float = 0.005
    kv_bytes_per_s: float = 1e9
    kv_bytes_per_token: float = 0.0
    step_base_s: float = 0.02
    step_per_seq_s: float = 0.001
    local_prefill_tokens_per_s: float | None = None     # None: the prefill actors' rate
    chunk_tokens: int = 512


def _ema(old: float, new: float) -> float:
    return (1.0 - SMOOTHING) * old + SMOOTHING * new


@dataclass(slots=True)
class _DecodeActorState:
    local_prefill_tokens: int = 0


class LiveProfile:
    """Learned figures for every actor of a role, and per-decode-actor state."""

    def __init__(self, seed: ProfileSeed | None = None, block_size: int = 16):
        s = seed or ProfileSeed()
        self.block_size = block_size
        self.prefill_tokens_per_s = s.prefill_tokens_per_s
        self.remote_overhead_s = s.remote_overhead_s
        self.kv_bytes_per_s = s.kv_bytes_per_s
        self.kv_bytes_per_token = s.kv_bytes_per_token
        self.step_base_s, self.step_per_seq_s = s.step_base_s, s.step_per_seq_s
        self.local_prefill_tokens_per_s = s.local_prefill_tokens_per_s
        self.chunk_tokens = s.chunk_tokens
        self.output_tokens: float | None = None       # mean output length of finished requests
        self._steps: deque[tuple[float, float]] = deque(maxlen=STEP_SAMPLES)
        self._decode: dict[str, _DecodeActorState] = {}

    # ---- the figures placement reads ------------------------------------
    def prefill_profile(self) -> PrefillProfile:
        return PrefillProfile(self.prefill_tokens_per_s, self.remote_overhead_s)

    def link(self) -> LinkProfile:
        return LinkProfile(self.kv_bytes_per_s, self.kv_bytes_per_token)

    def decode_profile(self) -> DecodeProfile:
        rate = self.local_prefill_tokens_per_s or self.prefill_tokens_per_s
        return DecodeProfile(self.step_base_s, self.step_per_seq_s, rate, self.chunk_tokens)

    def local_backlog(self, actor_id: str) -> int:
        return self._actor(actor_id).local_prefill_tokens

    # ---- observations ---------------------------------------------------
    def prefill_done(self, uncached_tokens: int, prefill_s: float, kv_bytes: int, transfer_s: float,
                     num_prompt_tokens: int) -> None:
        """A remote prefill's result (the actor's own figures)."""
        if uncached_tokens >= self.block_size and prefill_s > 0:
            self.prefill_tokens_per_s = _ema(self.prefill_tokens_per_s, uncached_tokens / prefill_s)
        if kv_bytes > 0 and transfer_s > 0:
            self.kv_bytes_per_s = _ema(self.kv_bytes_per_s, kv_bytes / transfer_s)
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
            old = self.local_prefill_tokens_per_s or self.prefill_tokens_per_s
            self.local_prefill_tokens_per_s = _ema(old, tokens / compute_s)

    def finished(self, mean_batch: float, tpot_s: float, num_output_tokens: int) -> None:
        """A request finished: its TPOT at the batch it decoded in refits the decode step."""
        self.output_tokens = num_output_tokens if self.output_tokens is None else \
            _ema(self.output_tokens, num_output_tokens)
        if num_output_tokens < 2 or tpot_s <= 0:
            return
        self._steps.append((max(mean_batch, 1.0), tpot_s))
        xs = [b for b, _ in self._steps]
        ys = [t for _, t in self._steps]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        if max(xs) - min(xs) >= MIN_BATCH_SPREAD:
            var = sum((x - mx) ** 2 for x in xs)
            self.step_per_seq_s = max(sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var, 0.0)
        self.step_base_s = max(my - self.step_per_seq_s * mx, 0.0)

    def forget(self, actor_id: str) -> None:
        """The actor left the decode pool (flipped, replaced or removed)."""
        self._decode.pop(actor_id, None)

    def _actor(self, actor_id: str) -> _DecodeActorState:
        state = self._decode.get(actor_id)
        if state is None:
            state = self._decode[actor_id] = _DecodeActorState()
        return state
