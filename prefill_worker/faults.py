"""Fault injection for the failure tests: corrupt, stall or drop this actor's outgoing KV chunks.

Wraps the sender's per-chunk hook, after the checksum is computed, so the
receiver sees exactly what a flipped bit, a stuck link or a cut connection
would give it:

    corrupt  one byte of every chunk's payload flipped (the receiver's checksum must catch it)
    stall    every chunk held `seconds` before it goes out (the transfer deadline must catch it)
    drop     the sender's connections are cut while a transfer is on the wire: at its last chunk,
             so a transfer of several chunks has already delivered some (the receiver must free
             what it reserved); the gRPC transport loses its channels (every open stream breaks,
             the next transfer connects afresh), other transports fail the chunk with a reset

Off unless a test (or an operator drill) turns it on through the actor.
"""
from __future__ import annotations

import time

from kv_transfer import KVSender

FAULTS = ("corrupt", "stall", "drop")


def set_fault(sender: KVSender, kind: str | None, seconds: float = 0.0) -> None:
    sender.__dict__.pop("_prepare", None)       # drop an earlier fault: back to the class's own hook
    if kind is None:
        return
    if kind not in FAULTS:
        raise ValueError(f"fault must be one of {FAULTS}, got {kind!r}")
    clean = sender._prepare

    def faulty(chunk):
        if kind == "corrupt":
            payload = chunk.payload.view(-1)
            payload[payload.numel() // 2] ^= 0x5A           # one flipped byte mid-payload
        elif kind == "stall":
            time.sleep(seconds)                             # a link that stops moving
        elif chunk.header.chunk_index == chunk.header.num_chunks - 1:
            _drop_connections(sender)
        return clean(chunk)
    sender._prepare = faulty


def _drop_connections(sender: KVSender) -> None:
    """Cut every connection the sender holds; calls on them fail as a dead link would."""
    channels = getattr(sender, "_channels", None)       # the gRPC sender: dest -> [grpc.Channel]
    if channels is None:
        raise ConnectionResetError("fault drill: connection dropped mid-transfer")
    with sender._channels_lock:
        dropped = [channel for per_dest in channels.values() for channel in per_dest]
        channels.clear()
    for channel in dropped:
        channel.close()
