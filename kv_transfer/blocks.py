"""Received bytes as tensors: read-only views and checksum-checked payloads."""

from __future__ import annotations

import warnings

import torch

from kv_transfer.wire import ChunkHeader, WireError, checksum


def readonly_tensor(buffer) -> torch.Tensor:
    """uint8 view over received bytes or a read-only numpy array (decode only reads it)."""
    if len(buffer) == 0:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        if hasattr(buffer, "__array_interface__"):
            return torch.from_numpy(buffer)
        return torch.frombuffer(buffer, dtype=torch.uint8)


def checked_payload(header: ChunkHeader, payload) -> torch.Tensor:
    """The chunk's payload as a uint8 tensor once its checksum matches the header's.

    ``payload``: received bytes-like, or a tensor (device tensors carry no checksum).
    Raises WireError on a mismatch.
    """
    if isinstance(payload, torch.Tensor):
        ok = header.checksum < 0 or payload.device.type != "cpu" or checksum(payload.numpy()) == header.checksum
    else:
        ok = header.checksum < 0 or checksum(payload) == header.checksum
        payload = readonly_tensor(payload)
    if not ok:
        raise WireError(f"checksum mismatch in chunk {header.chunk_index}")
    return payload
