"""Pick a transport from a config string: ``grpc | torch | ray | fake``.

    sender = make_sender("grpc", layout, codec="fp8", token=token)
    receiver = make_receiver("grpc", layout, kv_cache, allocator, codec="fp8", token=token)

Transport modules are imported on demand, so asking for ``grpc`` never
imports ray and ``fake`` needs neither grpc nor torch.distributed.
"""

from __future__ import annotations

import importlib

import torch

from kv_transfer.base import KVReceiver, KVSender
from kv_transfer.layout import KVLayout
from kv_transfer.pool import BlockAllocator

TRANSPORTS = {
    "grpc": ("kv_transfer.grpc_transport", "GrpcSender", "GrpcReceiver"),
    "torch": ("kv_transfer.torch_transport", "TorchSender", "TorchReceiver"),
    "ray": ("kv_transfer.ray_transport", "RaySender", "RayReceiver"),
    "fake": ("kv_transfer.fake", "FakeSender", "FakeReceiver"),
}


def _classes(kind: str) -> tuple[type, type]:
    try:
        module_name, sender_name, receiver_name = TRANSPORTS[kind]
    except KeyError:
        raise ValueError(f"unknown KV transport {kind!r}; expected one of {sorted(TRANSPORTS)}") from None
    module = importlib.import_module(module_name)
    return getattr(module, sender_name), getattr(module, receiver_name)


def make_sender(kind: str, layout: KVLayout, **kwargs) -> KVSender:
    """kwargs: codec, token, chunk_bytes, max_workers; torch: device, max_groups; fake: hub."""
    return _classes(kind)[0](layout, **kwargs)


def make_receiver(kind: str, layout: KVLayout, kv_cache: torch.Tensor, allocator: BlockAllocator, **kwargs) -> KVReceiver:
    """kwargs: codec, token, on_complete, default_timeout_s; grpc/torch: host, port; fake: hub."""
    return _classes(kind)[1](layout, kv_cache, allocator, **kwargs)
