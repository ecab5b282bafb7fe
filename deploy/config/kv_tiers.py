"""One entry of ``kv_cache.tiers``: a tier below the paged KV cache (host memory or a disk directory)."""
from __future__ import annotations

import os
from typing import Literal, Optional

from pydantic import Field, ValidationInfo, field_validator, model_validator

from deploy.config.base import GIB, FieldProblem, Float, Section, resolve_path


def _nearest_existing(path: str) -> str:
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


class KVTierSection(Section):
    """A tier below each actor's paged cache: evicted full blocks are offloaded into it, and a prompt prefix
    found there is loaded back before the prompt is computed (docs/kv-tiers.md)."""

    kind: Literal["host", "disk"] = Field(
        description="host: a pool of blocks in host memory (pinned on GPU actors), as stored in the paged "
        "cache; disk: one checked file per block (model fingerprint, chained hash, checksum) in `path`.")
    capacity_gib: Float = Field(gt=0, description="The tier's size per actor, GiB (least recently used "
                                "blocks leave first; a block leaving the last tier is gone).")
    path: Optional[str] = Field(None, description="disk: the directory (relative to the config file); each "
                                "actor keeps its blocks in a subdirectory named after it.")
    fsync: Literal["never", "always"] = Field(
        "never", description="disk: never (the OS writes back when it likes; a crash may cut the newest "
        "blocks, which their checksum then rejects) or always (each block is fsynced before it is findable).")
    reopen: bool = Field(False, description="disk: an actor that restarts keeps and publishes the blocks its "
                         "previous run left (same model and cache layout); false: they are deleted at start.")

    @field_validator("path")
    @classmethod
    def _absolute(cls, value: str | None, info: ValidationInfo) -> str | None:
        return None if value is None else resolve_path(value, info)

    @model_validator(mode="after")
    def _usable(self) -> "KVTierSection":
        if self.kind == "host":
            if self.path is not None:
                raise FieldProblem("path", "only a disk tier has a directory")
            return self
        if self.path is None:
            raise FieldProblem("path", "a disk tier needs a directory")
        existing = _nearest_existing(self.path)
        if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
            raise FieldProblem("path", f"{self.path} cannot be created or written ({existing} is not a "
                               "writable directory)")
        return self

    @property
    def capacity_bytes(self) -> int:
        return int(self.capacity_gib * GIB)
