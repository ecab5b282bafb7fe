"""The router's view of every actor, by pool (no Ray, no I/O).

The router keeps these views itself: it reserves decode blocks when it
dispatches and releases them when the request ends, and counts the prompt
tokens queued on each prefill actor. What each actor has cached is not here:
the `KVIndex` (router.placement.kv_index) learns it from the actors' own cache events.
`deploy` creates the views; the pool manager marks them (un)healthy.

Roles are `pb.ActorRole` values (router.roles). A colocated actor serves in the decode pool: a
decode-pool view without a KV endpoint is colocated.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from proto.pdserve.v1 import generation_pb2 as pb
from router.actor_protocol import DecodeClient, PrefillClient

POOL_NAMES = ("prefill", "decode", "long_context")
QUARANTINE_AFTER = 3          # consecutive requests failed on a decode actor before it is quarantined
QUARANTINE_BASE_S = 1.0       # first quarantine; doubles with each further failure ...
QUARANTINE_MAX_S = 30.0       # ... up to this


@dataclass(eq=False)
class PrefillView:
    actor_id: str
    client: PrefillClient
    kv_blocks_total: int
    queued_tokens: int = 0
    healthy: bool = True
    draining: bool = False
    incarnation: str = ""
    pid: int = 0                       # its process, as it last said (death reports)

    @property
    def busy(self) -> bool:
        return self.queued_tokens > 0

    @property
    def accepting(self) -> bool:
        """Healthy and not draining: it may take new work."""
        return self.healthy and not self.draining


@dataclass(eq=False)
class DecodeView:
    actor_id: str
    client: DecodeClient
    endpoint: str                      # its KV receiver ("" for a colocated actor)
    kv_blocks_total: int
    reserved_blocks: int = 0
    running: int = 0
    healthy: bool = True
    draining: bool = False
    incarnation: str = ""
    pid: int = 0                       # its process, as it last said (death reports)
    num_failures: int = 0              # consecutive requests that failed here (its receiver or its stream)
    quarantined_until: float = 0.0     # time.monotonic(): alive but failing; skipped until then

    @property
    def free_blocks(self) -> int:
        return self.kv_blocks_total - self.reserved_blocks

    @property
    def quarantined(self) -> bool:
        return time.monotonic() < self.quarantined_until

    def failed(self) -> float:
        """A request failed on this actor; after QUARANTINE_AFTER in a row it is skipped for a while
        (a circuit breaker: an alive actor whose receiver refuses everything is not the 'freest').
        Returns the quarantine it now serves, in seconds (0: none)."""
        self.num_failures += 1
        extra = self.num_failures - QUARANTINE_AFTER
        if extra < 0:
            return 0.0
        seconds = min(QUARANTINE_BASE_S * 2 ** extra, QUARANTINE_MAX_S)
        self.quarantined_until = time.monotonic() + seconds
        return seconds

    def succeeded(self) -> None:
        self.num_failures, self.quarantined_until = 0, 0.0

    @property
    def busy(self) -> bool:
        return self.running > 0

    @property
    def accepting(self) -> bool:
        """Healthy and not draining: it may take new work."""
        return self.healthy and not self.draining


def role_of(pool: str, view: PrefillView | DecodeView) -> int:
    """The `pb.ActorRole` of an actor serving in `pool`."""
    if pool == "prefill":
        return pb.ACTOR_ROLE_PREFILL
    return pb.ACTOR_ROLE_DECODE if view.endpoint else pb.ACTOR_ROLE_COLOCATED


@dataclass
class Pools:
    """The actor pools by name: `prefill`, `decode` and the optional `long_context` decode pool
    (requests longer than `routing.long_request_tokens` go there)."""

    prefill: list[PrefillView] = field(default_factory=list)
    decode: list[DecodeView] = field(default_factory=list)
    long_context: list[DecodeView] = field(default_factory=list)

    def get(self, name: str) -> list:
        if name not in POOL_NAMES:
            raise KeyError(f"unknown pool {name!r}; pools are {', '.join(POOL_NAMES)}")
        return getattr(self, name)

    def items(self) -> list[tuple[str, list]]:
        return [(name, getattr(self, name)) for name in POOL_NAMES]

    def all(self) -> list:
        return [view for _, views in self.items() for view in views]
