"""Block-level tensor helpers for the receiver: checked views over received bytes, cache writes."""

from __future__ import annotations

import warnings

import torch

from kv_transfer.wire import ChunkHeader, WireError, checksum


def write_blocks(dst: torch.Tensor, index: torch.Tensor, data: torch.Tensor) -> None:
    """dst[:, index] = data for dst [l, N, 2, H, B, D], data [l, n, 2, H, B, D].

    index_copy_ moves elements one by one, so both sides are viewed as the
    widest integer words that divide a cell (8-byte words copy twice as fast
    as bf16); a cache that cannot be viewed that way is written as is.
    """
    try:
        dst_flat = dst.view(dst.shape[0], dst.shape[1], -1)
        data_flat = data.contiguous().view(data.shape[0], data.shape[1], -1)
        cell_bytes = dst_flat.shape[-1] * dst_flat.element_size()
        word = next(w for w in (torch.int64, torch.int32, torch.int16, dst.dtype) if cell_bytes % w.itemsize == 0 and dst.element_size() <= w.itemsize)
        dst_flat.view(word).index_copy_(1, index, data_flat.view(word))
    except RuntimeError:  # not viewable (a strided cache): element-wise on the original shape
        dst.index_copy_(1, index, data)


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
