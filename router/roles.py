"""Actor roles: the `pb.ActorRole` values (proto/pdserve/v1/generation.proto) everywhere inside, names only
at the edges (an actor's stats report, metrics labels, the pool manager's flip API and logs).

A colocated actor serves in the decode pool: it prefills its own prompts.
"""
from __future__ import annotations

from proto.pdserve.v1 import generation_pb2 as pb

ROLE_NAMES = {pb.ACTOR_ROLE_PREFILL: "prefill", pb.ACTOR_ROLE_DECODE: "decode", pb.ACTOR_ROLE_COLOCATED: "colocated"}
ROLE_OF_NAME = {name: role for role, name in ROLE_NAMES.items()}
POOL_OF_ROLE = {pb.ACTOR_ROLE_PREFILL: "prefill", pb.ACTOR_ROLE_DECODE: "decode", pb.ACTOR_ROLE_COLOCATED: "decode"}


def role_named(name: str) -> int:
    """The `pb.ActorRole` spelled `name`; ValueError naming the roles for any other name."""
    try:
        return ROLE_OF_NAME[name]
    except KeyError:
        raise ValueError(f"role must be one of {', '.join(ROLE_OF_NAME)}, got {name!r}") from None
