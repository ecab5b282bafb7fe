"""The ``ray`` section: which Ray cluster the pools run on."""
from __future__ import annotations

from typing import Optional

from pydantic import Field

from deploy.config.base import Float, Section


class RaySection(Section):
    """Which Ray cluster the pools run on."""

    address: Optional[str] = Field(None, description="Ray address: unset = start a local "
                                   "Ray; 'auto' = join the running cluster (ray up).")
    namespace: str = Field("pdserve", description="Ray namespace of the actors.")
    placement_timeout_s: Float = Field(60.0, gt=0, description="Longest wait for Ray to place an actor (find it "
                                       "a node with its resources) before startup fails naming the pool, what it "
                                       "asks and what the cluster has. On a local Ray the actors' num_cpus are "
                                       "scaled to fit the node instead; raise it when Ray's autoscaler must "
                                       "start nodes first.")
