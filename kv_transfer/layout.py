"""The KV cache layout both ends agree on, and the startup handshake check.

The engine keeps ONE tensor over layers:

    kv_cache: [num_layers, num_blocks, 2, num_kv_heads, block_size, head_dim]
              (index 0 on dim 2 = K, 1 = V)

or, with `kv_cache.dtype` fp8 / int8, [num_layers, num_blocks, cell bytes] uint8 (the values, then their
scales: engine/kv_cache/kv_format.py), shipped as stored by the `fp8_cache` / `int8_cache` codecs. Both
ends must store the same way: the handshake compares `cache_dtype` and names both values.

A request's blocks are ``kv_cache[:, block_ids]``; the transfer ships exactly
that slab (all layers, or a layer range), so the wire layout follows the cache.

Under tensor parallelism a rank's cache holds the KV heads [kv_head_start, kv_head_start + num_kv_heads)
of the model (engine/parallel/shard.py); each end tells the other its degree and head range, and the
handshake refuses ends whose heads differ, naming both. Between degrees, each transfer carries one head
range (a head view of the cache on both ends, kv_transfer/resharded.py), so the ranges of the two ends
match while their degrees differ.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


class HandshakeError(ValueError):
    """The two ends disagree on model, layout, dtype or codec."""


def dtype_name(dtype: torch.dtype) -> str:
    for name, value in DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"unsupported KV dtype {dtype}; expected one of {sorted(DTYPES)}")


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Shape of one block, as the engine's paged cache stores it."""

    num_layers: int
    num_kv_heads: int
    block_size: int
    head_dim: int
    dtype: torch.dtype
    model_fingerprint: str = ""
    cache_dtype: str = "auto"      # kv_cache.dtype: auto (the model dtype) | fp8 | int8 (byte cells with scales)
    tensor_parallel: int = 1       # the degree of the actor whose rank holds this cache
    kv_head_start: int = 0         # the model's first KV head in this cache

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "block_size", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"KVLayout.{name} must be a positive int, got {value!r}")
        dtype_name(self.dtype)
        if self.cache_dtype not in CACHE_DTYPES:
            raise ValueError(f"KVLayout.cache_dtype must be one of {', '.join(CACHE_DTYPES)}, got {self.cache_dtype!r}")

    @property
    def quantized(self) -> bool:
        return self.cache_dtype != "auto"

    @property
    def cell_nbytes(self) -> int:
        """Bytes of one (layer, block) cell as the cache stores it (a quantized cell: data, then scales)."""
        if not self.quantized:
            return self.block_numel * self.dtype.itemsize
        scales_per_head = 1 if self.cache_dtype == "fp8" else self.block_size
        return self.block_numel + 4 * 2 * self.num_kv_heads * scales_per_head

    @property
    def dtype_name(self) -> str:
        return dtype_name(self.dtype)

    @property
    def block_numel(self) -> int:
        """Elements of one (layer, block) cell: K and V of every head."""
        return 2 * self.num_kv_heads * self.block_size * self.head_dim

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block over all layers as the cache stores it."""
        return self.num_layers * self.cell_nbytes

    @property
    def storage_dtype(self) -> torch.dtype:
        return torch.uint8 if self.quantized else self.dtype

    def cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        if self.quantized:
            return (self.num_layers, num_blocks, self.cell_nbytes)
        return (self.num_layers, num_blocks, 2, self.num_kv_heads, self.block_size, self.head_dim)

    def check_cache(self, kv_cache: torch.Tensor) -> None:
        """Assert that a cache tensor matches this layout (any num_blocks)."""
        expected = self.cache_shape(kv_cache.shape[1]) if kv_cache.dim() >= 2 else None
        if expected is None or tuple(kv_cache.shape) != expected or kv_cache.dtype != self.storage_dtype:
            raise ValueError(
                f"kv_cache {tuple(kv_cache.shape)} {kv_cache.dtype} does not match layout "
                f"[num_layers={self.num_layers}, num_blocks, 2, num_kv_heads={self.num_kv_heads}, "
                f"block_size={self.block_size}, head_dim={self.head_dim}] {self.dtype}, "
                f"kv_cache.dtype {self.cache_dtype}"
            )

    def describe(self, codec: str) -> dict[str, object]:
        """What one end tells the other at handshake time (msgpack-able)."""
        return {
            "model_fingerprint": self.model_fingerprint,
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "block_size": self.block_size,
            "head_dim": self.head_dim,
            "dtype": self.dtype_name,
            "cache_dtype": self.cache_dtype,
            "codec": codec,
            "tensor_parallel": self.tensor_parallel,
            "kv_head_start": self.kv_head_start,
        }


HANDSHAKE_KEYS = ("model_fingerprint", "block_size", "num_layers", "num_kv_heads", "head_dim", "dtype", "cache_dtype",
                  "codec")
CACHE_DTYPES = ("auto", "fp8", "int8")
_INTEGER_KEYS = ("num_layers", "num_kv_heads", "block_size", "head_dim", "tensor_parallel", "kv_head_start")


def check_compatible(sender: dict, receiver: dict) -> None:
    """Refuse a mismatch with an error naming both values.

    Raises:
        HandshakeError: when either description is not a map or holds a non-integer size; on the first key
            whose values differ; first of all when the two ends hold different KV heads (the degrees may
            differ: the heads may not).
    """
    for side, description in (("sender", sender), ("receiver", receiver)):   # a peer's, as it came off the wire
        if not isinstance(description, dict):
            raise HandshakeError(f"KV handshake: the {side}'s layout is not a map (got {type(description).__name__})")
        bad = next((key for key in _INTEGER_KEYS if key in description and type(description[key]) is not int), None)
        if bad is not None:
            raise HandshakeError(f"KV handshake: the {side}'s {bad} is {description[bad]!r:.80}, not an integer")
    heads = [(d.get("kv_head_start", 0), d.get("num_kv_heads")) for d in (sender, receiver)]
    if heads[0] != heads[1] and sender.get("model_fingerprint") == receiver.get("model_fingerprint"):
        (ps, pn), (ds, dn) = heads
        np_, nd = sender.get("tensor_parallel", 1), receiver.get("tensor_parallel", 1)
        raise HandshakeError(
            f"KV handshake mismatch on KV heads: sender holds heads [{ps}, {ps + (pn or 0)}) at tensor_parallel {np_}, "
            f"receiver holds heads [{ds}, {ds + (dn or 0)}) at tensor_parallel {nd} (between tensor-parallel "
            "degrees each transfer carries one head range of a resharding plan: kv_transfer.resharded)")
    for key in HANDSHAKE_KEYS:
        if sender.get(key) != receiver.get(key):
            raise HandshakeError(
                f"KV handshake mismatch on {key}: sender={sender.get(key)!r} receiver={receiver.get(key)!r}"
            )
