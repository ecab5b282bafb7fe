"""Transfer settings shared by both ends (``kv_transfer:`` in pools.yaml), and one constructor per side.

    sender = make_sender(settings, layout, device, kv_cache=cache)                   # a prefill actor
    receiver = make_receiver(settings, layout, kv_cache, allocator, on_complete)     # a decode actor
    sender = make_sender("fake", layout, codec="none", hub=hub)                      # tests, benchmarks

The first argument is either the ``TransferSettings`` (codec, token, chunk size,
deadline, bind host and, for grpc and tcp, the internal TLS, for nixl its ``NixlOptions``, come from them) or
just a transport name from
``kv_transfer.transports.TRANSPORTS`` (then only the keywords given are passed
on, over the transport classes' own defaults).
"""
from __future__ import annotations

from collections.abc import Callable
import dataclasses
from dataclasses import dataclass, field

import torch

from kv_transfer.interface import BlockAllocator, KVReceiver, KVSender, TransferResult
from proto.internal_auth import InternalTLS
from kv_transfer.layout import KVLayout
from kv_transfer.transports import load
from kv_transfer.wire import DEFAULT_CHUNK_BYTES


@dataclass(slots=True)
class NixlOptions:
    """What the nixl transport takes from ``kv_transfer.nixl`` (see docs/kv-transfer.md)."""

    mode: str = "pull"                # pull: the decode side READs | push: the prefill side WRITEs
    ucx_tls: str = "tcp,shm"          # UCX_TLS of both ends' agents
    backend: str = "UCX"              # the NIXL backend plugin
    staging_bytes: int = 64 << 20     # registered staging per end for fp8 / int8 chunks
    workers: int = 2                  # UCX workers per agent (transfers on different workers move at once)


@dataclass(slots=True)
class TransferSettings:
    transport: str = "grpc"           # grpc | tcp | torch | ray | nixl | fake
    codec: str = "fp8"                # fp8 | int8 | none
    token: str = ""                   # internal secret (internal_auth.internal_secret), never the public token
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    deadline_s: float = 30.0
    bind_host: str = "127.0.0.1"      # where a decode actor's receiver listens
    tls: InternalTLS | None = None    # mutual TLS of the grpc and tcp transports (and of the decode token stream)
    layerwise: bool = True            # prefill actors stream each layer's blocks while prefill runs
    nixl: NixlOptions = field(default_factory=NixlOptions)


def layout_of(kv_cache: torch.Tensor, model_fingerprint: str, kv_format=None, shard=None) -> KVLayout:
    """The layout of an engine cache tensor [L, NB, 2, Hkv, bs, D], or of a quantized one: `kv_format` (the
    engine's `engine.kv_cache.kv_format.KVFormat`) says its shape and how it is stored. `shard`: the
    engine's tensor-parallel `engine.parallel.shard.HeadShard` (its degree and first KV head), if any."""
    tp = {"tensor_parallel": shard.size, "kv_head_start": shard.kv_head_start} if shard is not None else {}
    if kv_format is not None and kv_format.quantized:
        return KVLayout(kv_format.num_layers, kv_format.num_kv_heads, kv_format.block_size, kv_format.head_dim,
                        kv_format.dtype, model_fingerprint, kv_format.kind, **tp)
    num_layers, _, _, num_kv_heads, block_size, head_dim = kv_cache.shape
    return KVLayout(num_layers, num_kv_heads, block_size, head_dim, kv_cache.dtype, model_fingerprint, **tp)


def make_sender(
    transport: TransferSettings | str,
    layout: KVLayout,
    device: torch.device | str | None = None,
    kv_cache: torch.Tensor | None = None,
    **options,
) -> KVSender:
    """Build the prefill side of a transport.

    Args:
        transport: the transfer settings, or a transport name (``grpc | tcp | torch | ray | nixl | fake``).
        layout: the local cache's layout (``layout_of``); the receiver must agree on it.
        device: where the torch and nixl transports stage their tensors (the prefill engine's device; default
            CPU). The other transports read the cache where it lives and ignore it.
        kv_cache: the prefill engine's cache tensor: nixl registers it now, once (a piece of another
            cache registers that one when it comes); the others ignore it.
        options: transport keywords, over what the settings give: codec, token, chunk_bytes,
            max_workers, prefetch_depth, encode_workers; grpc: num_streams, tls; tcp: tls, connect_timeout_s;
            torch: max_groups,
            connect_timeout_s, interface; nixl: host, mode, ucx_tls, backend, staging_bytes, workers,
            connect_timeout_s; fake: hub.
    Returns:
        A ``KVSender``. Raises ValueError for an unknown transport.
    """
    if isinstance(transport, TransferSettings):
        side = {"chunk_bytes": transport.chunk_bytes}
        if transport.transport == "nixl":
            side["host"] = transport.bind_host  # the interface its agent uses
        transport, options = transport.transport, {**_options(transport, **side), **options}
    sender_class, _ = load(transport)
    if transport in ("torch", "nixl") and device is not None:
        options["device"] = device
    if transport == "nixl" and kv_cache is not None:
        options["kv_cache"] = kv_cache
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
        transport: the transfer settings, or a transport name (``grpc | tcp | torch | ray | nixl | fake``).
        layout: the local cache's layout (``layout_of``).
        kv_cache: the decode engine's cache tensor, written in place (nixl registers it now, once).
        allocator: the decode actor's block pool (reserve on a first chunk, free on failure).
        on_complete: called once per terminal ``TransferResult``, from a transport thread.
        options: transport keywords, over what the settings give: codec, token, default_timeout_s;
            grpc, tcp, torch and nixl: host, port; grpc: max_streams, max_calls, tls; tcp: max_connections, tls;
            torch: max_groups, interface; nixl: mode, ucx_tls, backend, staging_bytes, workers, max_connections;
            ray: name; fake: hub.
    Returns:
        A ``KVReceiver``. Raises ValueError for an unknown transport.
    """
    if isinstance(transport, TransferSettings):
        side = {"default_timeout_s": transport.deadline_s}
        if transport.transport in ("grpc", "tcp", "torch", "nixl"):
            side["host"] = transport.bind_host
        transport, options = transport.transport, {**_options(transport, **side), **options}
    _, receiver_class = load(transport)
    return receiver_class(layout, kv_cache, allocator, on_complete=on_complete, **options)


def _options(settings: TransferSettings, **side) -> dict:
    """What the settings give both sides of their transport (codec, token, TLS for grpc and tcp, the nixl options),
    plus `side`'s own."""
    options = {"codec": settings.codec, "token": settings.token, **side}
    if settings.transport in ("grpc", "tcp") and settings.tls is not None:
        options["tls"] = settings.tls
    if settings.transport == "nixl":
        options.update(dataclasses.asdict(settings.nixl))
    return options
