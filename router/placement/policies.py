"""Placement policies: small pure functions over candidates (no Ray, no I/O), and the pickers that
build the candidates from the router's views and its `KVIndex`.

A candidate carries what a policy weighs: the index's answer (the prompt's leading blocks
that actor has cached, from its own cache events, and what onboarding those held in a tier
below its paged cache costs, in blocks of recompute) and the actor's load as the router counts
it. Policies are chosen by name (`routing.prefill_policy`, `routing.decode_policy`):

    prefill  prefix_vs_queue   least cost in tokens: uncached prompt tokens + the onboarding's price in
                               tokens + prompt tokens queued there
             prefix_then_load  longest priced cached prefix, then fewest queued tokens
    decode   kv_aware          among actors with room for the request: least cost in blocks, i.e. prompt
                               blocks it lacks (the KV shipped) + the onboarding's price +
                               DECODE_RUNNING_COST_BLOCKS per running request; ties to the most free blocks
             most_free_blocks  among actors with room: the most free blocks

Admission comes first for decode: an actor qualifies only when its free blocks hold what the
request can fill (prompt + max_tokens).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from router.placement.kv_index import KVIndex
from router.pools import DecodeView, PrefillView

DECODE_RUNNING_COST_BLOCKS = 8.0   # one more running request weighs as much as shipping this many blocks


@dataclass(frozen=True, slots=True)
class PrefillCandidate:
    actor_id: str
    cached_blocks: int       # leading prompt blocks in its prefix cache or a tier below (the index's answer)
    queued_tokens: int       # prompt tokens it has queued (dispatched, not finished)
    onboard_blocks: float = 0.0   # the price of loading the tier-held ones, in blocks of recompute


@dataclass(frozen=True, slots=True)
class DecodeCandidate:
    actor_id: str
    free_blocks: int         # KV blocks not reserved by the router
    cached_blocks: float     # leading prompt blocks it holds, less the price of onboarding those in a tier
    running: int             # requests running there


# ---- prefill ---------------------------------------------------------------
def usable_cached_tokens(cached_blocks: int, num_prompt_tokens: int, block_size: int) -> int:
    """Prompt tokens a prefix hit saves: the engine computes at least the last prompt token."""
    return min(cached_blocks, max(num_prompt_tokens - 1, 0) // block_size) * block_size


def prefill_cost_tokens(c: PrefillCandidate, num_prompt_tokens: int, block_size: int) -> int:
    """Tokens the prompt waits for and computes on `c`: its uncached tokens + the onboarding's price in tokens
    + the tokens queued ahead."""
    return (num_prompt_tokens - usable_cached_tokens(c.cached_blocks, num_prompt_tokens, block_size)
            + c.onboard_blocks * block_size + c.queued_tokens)


def choose_prefill_prefix_vs_queue(candidates: list[PrefillCandidate], num_prompt_tokens: int,
                                   block_size: int) -> PrefillCandidate | None:
    """Least `prefill_cost_tokens`; ties: the longer cached prefix, then the first candidate."""
    return min(candidates, default=None,
               key=lambda c: (prefill_cost_tokens(c, num_prompt_tokens, block_size), -c.cached_blocks))


def choose_prefill_prefix_then_load(candidates: list[PrefillCandidate], num_prompt_tokens: int,
                                    block_size: int) -> PrefillCandidate | None:
    """Longest cached prefix (priced by tier), then fewest queued tokens."""
    return min(candidates, default=None, key=lambda c: (c.onboard_blocks - c.cached_blocks, c.queued_tokens))


PREFILL_POLICIES: dict[str, Callable[[list[PrefillCandidate], int, int], PrefillCandidate | None]] = {
    "prefix_vs_queue": choose_prefill_prefix_vs_queue,
    "prefix_then_load": choose_prefill_prefix_then_load,
}


# ---- decode ----------------------------------------------------------------
def decode_cost_blocks(c: DecodeCandidate, num_prompt_blocks: int) -> float:
    """Prompt blocks `c` lacks (shipped over the wire) + the weight of its running batch."""
    return num_prompt_blocks - min(c.cached_blocks, num_prompt_blocks) + DECODE_RUNNING_COST_BLOCKS * c.running


def choose_decode_kv_aware(candidates: list[DecodeCandidate], need_blocks: int,
                           num_prompt_blocks: int) -> DecodeCandidate | None:
    """Among candidates with `need_blocks` free: least `decode_cost_blocks`, then the most free blocks."""
    fits = [c for c in candidates if c.free_blocks >= need_blocks]
    return min(fits, default=None, key=lambda c: (decode_cost_blocks(c, num_prompt_blocks), -c.free_blocks))


def choose_decode_most_free(candidates: list[DecodeCandidate], need_blocks: int,
                            num_prompt_blocks: int) -> DecodeCandidate | None:
    """Among candidates with `need_blocks` free: the most free blocks."""
    fits = [c for c in candidates if c.free_blocks >= need_blocks]
    return max(fits, default=None, key=lambda c: c.free_blocks)


DECODE_POLICIES: dict[str, Callable[[list[DecodeCandidate], int, int], DecodeCandidate | None]] = {
    "kv_aware": choose_decode_kv_aware,
    "most_free_blocks": choose_decode_most_free,
}


# ---- pickers over the router's views -----------------------------------------
def pick_prefill(views: list[PrefillView], hashes: list[bytes], num_prompt_tokens: int, block_size: int,
                 index: KVIndex, exclude: set[str] = frozenset(),
                 policy: str = "prefix_vs_queue") -> tuple[PrefillView | None, int]:
    """(actor, its cached prefix in blocks) by `policy` among healthy actors not in `exclude`."""
    by_id = {v.actor_id: v for v in views if v.healthy and v.actor_id not in exclude}
    cached = index.prefix_by_actor(hashes)
    candidates = [PrefillCandidate(i, n, v.queued_tokens, index.onboard_cost(i, hashes, n))
                  for i, v in by_id.items() for n in [cached.get(i, 0)]]
    best = PREFILL_POLICIES[policy](candidates, num_prompt_tokens, block_size)
    return (None, 0) if best is None else (by_id[best.actor_id], best.cached_blocks)


def pick_decode(views: list[DecodeView], need_blocks: int, exclude: set[str] = frozenset(),
                cached: Mapping[str, float] | None = None, num_prompt_blocks: int = 0,
                policy: str = "kv_aware") -> DecodeView | None:
    """An actor with room for `need_blocks` by `policy`, or None. `cached`: actor id → the prompt's
    cached blocks there, priced by tier (`KVIndex.priced_prefix_by_actor`). Quarantined actors (failing
    requests while alive) are skipped while any other actor of the pool is open, so a black hole is never
    the 'best' choice; when every actor is quarantined they are tried (half-open)."""
    candidates = [v for v in views if v.accepting and v.actor_id not in exclude]
    open_ = [v for v in candidates if not v.quarantined]
    by_id = {v.actor_id: v for v in (open_ or candidates)}
    cached = cached or {}
    best = DECODE_POLICIES[policy](
        [DecodeCandidate(i, v.free_blocks, cached.get(i, 0), v.running) for i, v in by_id.items()],
        need_blocks, num_prompt_blocks)
    return None if best is None else by_id[best.actor_id]
