"""Fault injection for the failure drills: make this decode (or colocated) actor hang.

    hang  the engine loop stops for `seconds`: no step runs, no token is streamed, no command
          (new job, abort) is served, while the actor itself stays up (its Ray methods and its
          token-stream server answer) — alive but silent, which the router must detect
          (`stream_idle_s`) and migrate away from. Afterwards the loop catches up on its inbox.

`set_fault(worker, None)` ends a hang early. Off unless a test (or an operator drill)
turns it on through the actor.
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from decode_worker.colocated import ColocatedWorker
    from decode_worker.worker import DecodeWorker

FAULTS = ("hang",)


def set_fault(worker: DecodeWorker | ColocatedWorker, kind: str | None, seconds: float = 0.0) -> None:
    release = worker.__dict__.pop("_fault_release", None)
    if release is not None:                     # end an earlier hang
        release.set()
    if kind is None:
        return
    if kind not in FAULTS:
        raise ValueError(f"fault must be one of {FAULTS}, got {kind!r}")
    release = worker.__dict__["_fault_release"] = threading.Event()
    worker.loop.call(lambda: release.wait(seconds))     # blocks the loop thread between two steps
