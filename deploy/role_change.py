"""Changing an actor's role in place, over the same engine: the one procedure that the Ray actor
(`deploy.actor.ServingActor.set_role`) and the simulator's actors (bench/simulate/sim_cluster.py) run.

    wait until the worker holds nothing (checked on its engine loop, between steps)
      → past `timeout_s`, hand off what is left: a decode or colocated worker's requests get a
        retryable error (the router migrates them), a prefill worker's jobs are aborted (the router
        retries them elsewhere); then wait up to `HAND_OFF_WAIT_S` for them to leave
      → stop the old worker (its loop, KV receiver or sender; parked KV is freed) and check that no
        request and no KV block is left
      → the new role's worker over the same engine (`make_worker`: it also sets the scheduler's
        limits of the role), started

The caller runs one change at a time and decides whether a change is allowed at all.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Protocol

from prefill_worker.worker import PrefillWorker

log = logging.getLogger(f"pdserve.{__name__}")

IDLE_POLL_S = 0.02         # how often a draining worker is asked whether it holds nothing yet
HAND_OFF_WAIT_S = 5.0      # how long the work handed off may take to leave the worker


class RoleHolder(Protocol):
    """An actor whose role can change: one engine, the worker of its current role over it."""

    actor_id: str
    engine: object
    worker: object
    role: str


async def change_role(actor: RoleHolder, role: str, timeout_s: float, make_worker: Callable[[str], object]) -> int:
    """Switch `actor` to `role` (module docstring): sets ``actor.worker`` and ``actor.role``.

    Args:
        actor: the actor (its current worker is running).
        role: the new role (not the current one).
        timeout_s: how long the work in hand may take to finish before it is handed off.
        make_worker: the new role's worker over ``actor.engine`` (not started).

    Returns:
        How many requests were handed off.

    Raises:
        RuntimeError: requests or KV blocks are still held after the old worker stopped (nothing
            is started then).
    """
    start = time.monotonic()
    old, old_role = actor.worker, actor.role
    handed_off = 0
    if not await _wait_idle(actor.engine, old, start + timeout_s):
        handed_off = await old.loop.run_async(lambda: _hand_off(actor.engine, old))
        await _wait_idle(actor.engine, old, time.monotonic() + HAND_OFF_WAIT_S)
    old.stop()
    used = actor.engine.block_manager.num_used_blocks
    if actor.engine.requests or used:
        raise RuntimeError(f"{actor.actor_id}: {len(actor.engine.requests)} requests and {used} KV blocks "
                           f"still held after the {old_role} worker stopped")
    actor.worker = make_worker(role)
    actor.role = role
    actor.worker.start()
    log.info("actor %s flipped %s -> %s in %.2fs (%d requests handed off)", actor.actor_id, old_role, role,
             time.monotonic() - start, handed_off)
    return handed_off


def holds_nothing(worker) -> bool:
    """No request queued, running, waiting for KV, or sending KV on this worker (loop thread)."""
    stats = worker.stats()
    return stats["queued_requests"] == 0 and stats["running_requests"] == 0


async def _wait_idle(engine, worker, deadline: float) -> bool:
    """Until the worker holds no request (read on its loop, between steps), or `deadline`."""
    while True:
        if await worker.loop.run_async(lambda: not engine.requests and holds_nothing(worker)):
            return True
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(IDLE_POLL_S)


def _hand_off(engine, worker) -> int:
    """Loop thread: give up the work left (decode: retryable errors, the router migrates; prefill:
    aborted, the router retries elsewhere)."""
    if isinstance(worker, PrefillWorker):
        request_ids = list(engine.requests)
        for rid in request_ids:
            worker.abort(rid)            # runs on this loop before the next idle check
        return len(request_ids)
    return worker.evict("the actor is changing role")
