"""The ``kv_transfer`` section: how prefill actors ship KV blocks to decode actors."""
from __future__ import annotations

import re
from typing import Annotated, Literal, Optional

from pydantic import BeforeValidator, Field, field_validator, model_validator

from deploy.config.base import GIB, MIB, FieldProblem, Float, Int, Section

MAX_CHUNK_BYTES = 64 * MIB


def _parse_bytes(value: object) -> object:
    """Accept ints or strings like ``4MiB``, ``512KiB``, ``1048576``."""
    if isinstance(value, str):
        match = re.fullmatch(r"\s*(\d+)\s*(B|KiB|MiB|GiB)?\s*", value)
        if not match:
            raise ValueError(f"expected bytes (an integer or e.g. '4MiB'), got {value!r}")
        scale = {"B": 1, "KiB": 1 << 10, "MiB": MIB, "GiB": GIB}[match.group(2) or "B"]
        return int(match.group(1)) * scale
    return value


_UCX_TLS = re.compile(r"\^?[a-z][a-z0-9_]*(,[a-z][a-z0-9_]*)*")


class NixlSection(Section):
    """The nixl transport's settings (``kv_transfer.transport: nixl``)."""

    backend: Literal["UCX"] = Field("UCX", description="The NIXL backend plugin that moves the bytes.")
    ucx_tls: str = Field(
        "tcp,shm", description="UCX_TLS of both ends' agents: tcp,shm (default: shared memory between actors "
        "on one node, TCP between nodes), tcp (TCP only), rc,cuda_copy (RDMA between GPU nodes); cuda_copy is "
        "added for a CUDA cache.")
    mode: Literal["pull", "push"] = Field(
        "pull", description="pull: the decode actor READs the blocks (it alone writes into its cache; ahead on "
        "small pieces, level on large ones); push: the prefill actor WRITEs them where the decode actor says (for "
        "fabrics where a READ is emulated and a WRITE is not). docs/kv-transfer.md has the figures.")
    staging_bytes: Annotated[Int, BeforeValidator(_parse_bytes)] = Field(
        64 * MIB, ge=MIB, le=4 * GIB, description="Registered staging memory per actor that fp8 / int8 "
        "chunks are encoded into and read into, bytes (also '64MiB'); at least 2 x kv_transfer.chunk_bytes.")
    workers: Int = Field(
        2, ge=1, le=16, description="UCX workers per actor's agent: transfers on different workers move at once "
        "(a shared-memory READ copies on the thread that starts it, so two workers use two cores).")

    def options(self) -> dict:
        """The transport's keywords these settings give (``kv_transfer.settings.NixlOptions`` fields)."""
        return {"mode": self.mode, "ucx_tls": self.ucx_tls, "backend": self.backend,
                "staging_bytes": self.staging_bytes, "workers": self.workers}

    @field_validator("ucx_tls")
    @classmethod
    def _known_shape(cls, value: str) -> str:
        if not _UCX_TLS.fullmatch(value):
            raise ValueError(f"expected comma-separated UCX transport names such as 'tcp,shm', got {value!r}")
        return value


class KVTransferSection(Section):
    """How prefill actors ship KV blocks to decode actors."""

    transport: Literal["grpc", "tcp", "torch", "ray", "nixl"] = Field(
        "grpc", description="grpc (streaming service on the decode actor), tcp (plain TCP straight from and into "
        "the cache rows: the fastest CPU socket path), torch (torch.distributed: NCCL on CUDA, gloo on CPU), "
        "ray (object store, same node) or nixl (NIXL one-sided READ / WRITE between registered caches over "
        "UCX: shared memory, TCP or RDMA; pip install 'pdserve[nixl]').")
    compression: Literal["fp8", "int8", "none"] = Field(
        "fp8", description="fp8 (float8_e4m3fn + one scale per block × layer × K/V × head: "
        "1 + 4/(block_size · head_dim) bytes per value), int8 (one scale per token × layer × K/V × head: "
        "1 + 4/head_dim bytes per value, about 4x less error) or none (bit-exact).")
    chunk_bytes: Annotated[Int, BeforeValidator(_parse_bytes)] = Field(
        4 * MIB, gt=0, le=MAX_CHUNK_BYTES,
        description="Largest message on the wire, bytes (also '4MiB'); at most 64 MiB.")
    deadline_s: Float = Field(30.0, gt=0, description="Seconds before a transfer fails and "
                              "the router re-dispatches the request.")
    layerwise: bool = Field(
        True, description="Stream each layer's KV blocks as prefill finishes that layer (the last layer's last "
        "block goes with the first token); false: ship the whole prompt's KV once the first token is sampled.")
    link_gbps: Optional[Float] = Field(
        None, gt=0, description="Bandwidth between the prefill and decode pools, Gbit/s, for the planner's "
        "network term; unset: what `pdserve profile` measured with this transport and compression.")
    nixl: NixlSection = Field(default_factory=NixlSection, description="The nixl transport's settings.")

    @model_validator(mode="after")
    def _staging_holds_chunks(self) -> KVTransferSection:
        if self.transport == "nixl" and self.nixl.staging_bytes < 2 * self.chunk_bytes:
            raise FieldProblem("nixl.staging_bytes", f"must hold two chunks: at least 2 x kv_transfer.chunk_bytes "
                               f"({2 * self.chunk_bytes} bytes), got {self.nixl.staging_bytes}")
        return self
