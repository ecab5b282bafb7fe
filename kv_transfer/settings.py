"""Transfer settings shared by both ends (``kv_transfer:`` in pools.yaml), and one constructor per side.

    sender = make_sender(settings, layout, device)                                   # a prefill actor
    receiver = make_receiver(settings, layout, kv_cache, allocator, on_complete)     # a decode actor
    sender = make_sender("fake", layout, codec="none", hub=hub)                      # tests, benchmarks

The first argument is either the ``TransferSettings`` (codec, token, chunk size,
deadline, bind host and, for grpc and tcp, the internal TLS come from them) or just a transport name from
``kv_transfer.transports.TRANSPORTS`` (then only the keywords given are passed
on, over the transport classes' own defaults).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kv_transfer.interface import BlockAllocator, KVReceiver, KVSender, TransferResult
from proto.internal_auth import InternalTLS
from kv_transfer.layout import KVLayout
from kv_transfer.transports import load
from kv_transfer.wire import DEFAULT_CHUNK_BYTES


@dataclass(slots=True)
class TransferSettings:
    transport: str = "grpc"           # grpc | tcp | torch | ray | fake
    codec: str = "fp8"                # fp8 | int8 | none
    token: str = ""                   # internal secret (internal_auth.internal_secret), never the public token
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    deadline_s: float = 30.0
    bind_host: str = "127.0.0.1"      # where a decode actor's receiver listens
    tls: InternalTLS | None = None    # mutual TLS of the grpc and tcp transports (and of the decode token stream)
    layerwise: bool = True            # prefill actors stream each layer's blocks while prefill runs


def layout_of(kv_cache: torch.Tensor, model_fingerprint: str) -> KVLayout:
    """The layout of an engine cache tensor [L, NB, 2, Hkv, bs, D]."""
    num_layers, _, _, num_kv_heads, block_size, head_dim = kv_cache.shape
    return KVLayout(num_layers, num_kv_heads, block_size, head_dim, kv_cache.dtype, model_fingerprint)


def make_sender(
    transport: TransferSettings | str,
    layout: KVLayout,
    device: torch.device | str | None = None,
    **options,
) -> KVSender:
    """Build the prefill side of a transport.

    Args:
        transport: the transfer settings, or a transport name (``grpc | tcp | torch | ray | fake``).
        layout: the local cache's layout (``layout_of``); the receiver must agree on it.
        device: where the torch transport stages its tensors (the prefill engine's device; default
            CPU). The other transports read the cache where it lives and ignore it.
        options: transport keywords, over what the settings give: codec, token, chunk_bytes,
            max_workers, prefetch_depth, encode_workers; grpc: num_streams, tls; tcp: tls, connect_timeout_s;
            torch: max_groups,
            connect_timeout_s, interface; fake: hub.
    Returns:
        A ``KVSender``. Raises ValueError for an unknown transport.
    """
    if isinstance(transport, TransferSettings):
        transport, options = transport.transport, {**_options(transport, chunk_bytes=transport.chunk_bytes), **options}
    sender_class, _ = load(transport)
    if transport == "torch" and device is not None:
        options["device"] = device
    return sender_class(layout, **options)


def make_receiver(
    transport: TransferSettings | str,
    layout: KVLayout,
    kv_cache: torch.Tensor,
    allocator: BlockAllocator,
    on_complete: Callable[[TransferResult], None] | None = None,
    **options,
) -> KVReceiver:
    """Build the decode side of a transport, listening at once (see ``receiver.endpoint``).

    Args:
        transport: the transfer settings, or a transport name (``grpc | tcp | torch | ray | fake``).
        layout: the local cache's layout (``layout_of``).
        kv_cache: the decode engine's cache tensor, written in place.
        allocator: the decode actor's block pool (reserve on a first chunk, free on failure).
        on_complete: called once per terminal ``TransferResult``, from a transport thread.
        options: transport keywords, over what the settings give: codec, token, default_timeout_s;
            grpc, tcp and torch: host, port; grpc: max_streams, max_calls, tls; tcp: max_connections, tls;
            torch: max_groups, interface;
            ray: name; fake: hub.
    Returns:
        A ``KVReceiver``. Raises ValueError for an unknown transport.
    """
    if isinstance(transport, TransferSettings):
        side = {"default_timeout_s": transport.deadline_s}
        if transport.transport in ("grpc", "tcp", "torch"):
            side["host"] = transport.bind_host
        transport, options = transport.transport, {**_options(transport, **side), **options}
    _, receiver_class = load(transport)
    return receiver_class(layout, kv_cache, allocator, on_complete=on_complete, **options)


def _options(settings: TransferSettings, **side) -> dict:
    """What the settings give both sides of their transport (codec, token, TLS for grpc and tcp), plus `side`'s own."""
    options = {"codec": settings.codec, "token": settings.token, **side}
    if settings.transport in ("grpc", "tcp") and settings.tls is not None:
        options["tls"] = settings.tls
    return options
