"""Fault injection for the failure tests: corrupt or stall this actor's outgoing KV chunks.

Wraps the sender's per-chunk hook, after the checksum is computed, so the
receiver sees exactly what a flipped bit or a stuck link would give it.
Off unless a test (or an operator drill) turns it on through the actor.
"""
from __future__ import annotations

import time

from kv_transfer import KVSender

FAULTS = ("corrupt", "stall")


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
        else:
            time.sleep(seconds)                             # a link that stops moving
        return clean(chunk)
    sender._prepare = faulty
