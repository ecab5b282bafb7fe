"""The ``kv_transfer`` section: how prefill actors ship KV blocks to decode actors."""
from __future__ import annotations

import re
from typing import Annotated, Literal, Optional

from pydantic import BeforeValidator, Field

from deploy.config.base import GIB, MIB, Float, Int, Section

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


class KVTransferSection(Section):
    """How prefill actors ship KV blocks to decode actors."""

    transport: Literal["grpc", "tcp", "torch", "ray"] = Field(
        "grpc", description="grpc (streaming service on the decode actor), tcp (plain TCP straight from and into "
        "the cache rows: the fastest on CPU), torch (torch.distributed: NCCL on CUDA, gloo on CPU) or ray "
        "(object store, same node).")
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
