"""The ``ray`` section: which Ray cluster the pools run on."""
from __future__ import annotations

from typing import Optional

from pydantic import Field, field_validator

from deploy.config.base import Float, Section


class RaySection(Section):
    """Which Ray cluster the pools run on."""

    address: Optional[str] = Field(None, description="Ray address: unset (or none, local) = start a local "
                                   "Ray on 127.0.0.1; 'auto' = join the running cluster (ray up).")
    namespace: str = Field("pdserve", description="Ray namespace of the actors.")
    placement_timeout_s: Float = Field(60.0, gt=0, description="Longest wait for Ray to place an actor (find it "
                                       "a node with its resources) before startup fails naming the pool, what it "
                                       "asks and what the cluster has. On a local Ray the actors' num_cpus are "
                                       "scaled to fit the node instead; raise it when Ray's autoscaler must "
                                       "start nodes first.")

    @field_validator("address", mode="before")
    @classmethod
    def _local(cls, value: object) -> object:
        # `--address none` (as --help says) or `local` = a local Ray on 127.0.0.1, like unset: Ray's own
        # "local" would start one on the node's address; an empty address (--address "$UNSET") is refused
        if isinstance(value, str):
            if not value.strip():
                raise ValueError("must not be empty (unset or none = a local Ray on 127.0.0.1; auto = join the "
                                 "running cluster)")
            if value.strip().lower() in ("none", "null", "local"):
                return None
        return value
