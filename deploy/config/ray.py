"""The ``ray`` section: which Ray cluster the pools run on."""
from __future__ import annotations

from typing import Optional

from pydantic import Field

from deploy.config.base import Section


class RaySection(Section):
    """Which Ray cluster the pools run on."""

    address: Optional[str] = Field(None, description="Ray address: unset = start a local "
                                   "Ray; 'auto' = join the running cluster (ray up).")
    namespace: str = Field("pdserve", description="Ray namespace of the actors.")
