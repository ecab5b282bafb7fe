"""Dispatch policies over the router's own view of each actor (no Ray, no I/O).

Prefill: the actor holding the longest cached prefix of the prompt, then the
fewest queued prompt tokens. Decode: admission first (free KV blocks >= the
blocks prompt + max_tokens can fill), then the most free blocks.
"""
from __future__ import annotations

from router.pools import DecodeView, PrefillView


def pick_prefill(views: list[PrefillView], hashes: list[bytes],
                 exclude: set[str] = frozenset()) -> tuple[PrefillView | None, int]:
    """(actor, cached blocks): longest cached prefix, then fewest queued prompt tokens."""
    best, best_key = None, None
    for v in views:
        if not v.healthy or v.actor_id in exclude:
            continue
        cached = v.cached_blocks(hashes)
        key = (-cached, v.queued_tokens)
        if best_key is None or key < best_key:
            best, best_key = v, key
    return best, (-best_key[0] if best_key else 0)


def pick_decode(views: list[DecodeView], need_blocks: int, exclude: set[str] = frozenset()) -> DecodeView | None:
    """An actor with room for `need_blocks` (most free first), or None. Quarantined actors (failing
    requests while alive) are skipped while any other actor of the pool is open, so a black hole is
    never the 'freest' choice; when every actor is quarantined they are tried (half-open)."""
    candidates = [v for v in views if v.healthy and not v.draining and v.actor_id not in exclude]
    open_ = [v for v in candidates if not v.quarantined]
    fits = [v for v in (open_ or candidates) if v.free_blocks >= need_blocks]
    return max(fits, key=lambda v: v.free_blocks) if fits else None
