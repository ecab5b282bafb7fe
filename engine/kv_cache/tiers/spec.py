"""What one tier below the paged cache is: its kind, size and (disk) directory."""
from __future__ import annotations

from dataclasses import dataclass

TIER_KINDS = ("host", "disk")
FSYNC_POLICIES = ("never", "always")


@dataclass(slots=True, frozen=True)
class TierSpec:
    """Args:
        kind: `host` (a pool of blocks in host memory) or `disk` (one file per block in `path`).
        capacity_bytes: the most block bytes the tier holds; the least recently used block leaves first.
        path: the disk tier's directory (created if missing; it must be writable).
        fsync: disk only: `never` (the OS writes back when it likes: a crash may lose or truncate the
            newest blocks, which the checksum then rejects) or `always` (each block is fsynced before it is
            findable: slower offload, nothing findable is ever lost).
        reopen: disk only: an actor that starts over keeps (and publishes) the blocks a previous run of the
            same model left in `path`; off, the directory's blocks are deleted at start.
    """

    kind: str
    capacity_bytes: int
    path: str | None = None
    fsync: str = "never"
    reopen: bool = False

    def check(self) -> None:
        """Raise ValueError naming the field when the spec cannot be used."""
        if self.kind not in TIER_KINDS:
            raise ValueError(f"kind: must be one of {', '.join(TIER_KINDS)}, got {self.kind!r}")
        if not isinstance(self.capacity_bytes, int) or self.capacity_bytes <= 0:
            raise ValueError(f"capacity: must be a positive number of bytes, got {self.capacity_bytes!r}")
        if self.kind == "disk" and not self.path:
            raise ValueError("path: a disk tier needs a directory")
        if self.fsync not in FSYNC_POLICIES:
            raise ValueError(f"fsync: must be one of {', '.join(FSYNC_POLICIES)}, got {self.fsync!r}")
