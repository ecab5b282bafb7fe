"""The transports, one module (or package) each, behind ``KVSender`` / ``KVReceiver``:

    grpc    client-streaming KV service on each decode actor (raw-bytes frames)
    tcp     plain TCP connections; sends from and receives into the cache's rows (sendmsg / recvmsg_into)
    torch   lazy 2-rank torch.distributed groups per prefill–decode pair: NCCL on CUDA, gloo on CPU
    ray     payloads through the Ray object store (same node); ray is imported on first use
    nixl    one-sided READ / WRITE between registered cache regions (NIXL over UCX); the library on first use
    fake    in-process hub for tests and warm-up: the real wire format, no socket

``hello_slots.HelloSlots`` bounds the tcp and torch listeners' connections that have not authenticated yet.

``TRANSPORTS`` maps a config name to (module, sender class, receiver class);
``load`` imports a transport's module on demand, so asking for ``grpc`` never
imports ray, ``fake`` needs neither grpc nor torch.distributed, and only ``nixl`` needs the NIXL library.
"""

from __future__ import annotations

import importlib

TRANSPORTS = {
    "grpc": ("kv_transfer.transports.grpc", "GrpcSender", "GrpcReceiver"),
    "tcp": ("kv_transfer.transports.tcp", "TcpSender", "TcpReceiver"),
    "torch": ("kv_transfer.transports.torch", "TorchSender", "TorchReceiver"),
    "ray": ("kv_transfer.transports.ray", "RaySender", "RayReceiver"),
    "nixl": ("kv_transfer.transports.nixl", "NixlSender", "NixlReceiver"),
    "fake": ("kv_transfer.transports.fake", "FakeSender", "FakeReceiver"),
}


def load(name: str) -> tuple[type, type]:
    """(sender class, receiver class) of transport ``name``; ValueError for an unknown name."""
    try:
        module_name, sender_name, receiver_name = TRANSPORTS[name]
    except KeyError:
        raise ValueError(f"unknown KV transport {name!r}; expected one of {sorted(TRANSPORTS)}") from None
    module = importlib.import_module(module_name)
    return getattr(module, sender_name), getattr(module, receiver_name)
