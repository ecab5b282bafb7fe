"""Transfer settings shared by both ends (from `kv_transfer:` in pools.yaml)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kv_transfer.layout import KVLayout
from kv_transfer.wire import DEFAULT_CHUNK_BYTES


@dataclass(slots=True)
class TransferSettings:
    transport: str = "grpc"           # grpc | torch | ray | fake
    codec: str = "fp8"                # fp8 | none
    token: str = ""                   # cluster token for internal endpoints
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    deadline_s: float = 30.0
    bind_host: str = "127.0.0.1"      # where a decode actor's receiver listens


def layout_of(kv_cache: torch.Tensor, model_fingerprint: str) -> KVLayout:
    """The layout of an engine cache tensor [L, NB, 2, Hkv, bs, D]."""
    num_layers, _, _, num_kv_heads, block_size, head_dim = kv_cache.shape
    return KVLayout(num_layers, num_kv_heads, block_size, head_dim, kv_cache.dtype, model_fingerprint)


def build_sender(settings: TransferSettings, layout: KVLayout, device: torch.device | str = "cpu", **extra):
    from kv_transfer.factory import make_sender
    kwargs = dict(codec=settings.codec, token=settings.token, chunk_bytes=settings.chunk_bytes, **extra)
    if settings.transport == "torch":
        kwargs["device"] = device
    return make_sender(settings.transport, layout, **kwargs)


def build_receiver(settings: TransferSettings, layout: KVLayout, kv_cache: torch.Tensor, allocator,
                   on_complete=None, **extra):
    from kv_transfer.factory import make_receiver
    kwargs = dict(codec=settings.codec, token=settings.token, on_complete=on_complete,
                  default_timeout_s=settings.deadline_s, **extra)
    if settings.transport in ("grpc", "torch"):
        kwargs["host"] = settings.bind_host
    return make_receiver(settings.transport, layout, kv_cache, allocator, **kwargs)
