"""The faults of the chaos run, one drill per kind; each waits for a condition, never for a time.

    burst        router queue: `burst` extra requests at once, beyond what admission holds (some must
                 wait in the admission queue, the rest get RESOURCE_EXHAUSTED at once)
    kill_prefill kill -9 a prefill actor while the router has prompts queued or computing on it
    stall        mid-transfer: the prefill actor's chunks stop moving (each held past the transfer deadline)
    corrupt      mid-transfer: one byte of every chunk flipped after its checksum was taken
    drop         mid-transfer: the prefill actor's KV connections are cut at a transfer's last chunk
    kill_decode  kill -9 a decode actor while it reports requests in its running batch (mid-stream)
    hang_decode  a decode actor's engine loop stops (alive but silent) while it has requests running

Every drill arms on a condition (the victim has requests in flight: the router's view of it or the
actor's own `stats()`), injects, then waits until the cluster is whole again (the killed actor
restarted and back in rotation, the fault cleared) so the next drill starts from a healthy cluster.
A transfer fault stays on until the router has retried `retries_to_clear` requests since it began.
Client cancels and deadlines are not drills: they are drawn per request (`workload.py`).
"""
from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

DRILLS = ("burst", "kill_prefill", "stall", "corrupt", "drop", "kill_decode", "hang_decode")
SERVER_FAULTS = DRILLS[1:]                    # faults the cluster must ride out for the client
POLL_S = 0.005


@dataclass(slots=True)
class FaultRecord:
    """One injected fault: where, when, what it took to notice and to recover."""

    kind: str
    victim: str = ""
    condition: str = ""
    due_at_request: int = 0
    armed_at: float | None = None        # the drill started waiting for its condition
    injected_at: float | None = None
    cleared_at: float | None = None      # the fault was turned off (transfer faults, hang)
    window_end: float | None = None      # requests in flight before this may have been hit
    detected_at: float | None = None     # the router marked the view unhealthy, or retried / migrated a request
    detected_by: str = ""
    recovered_at: float | None = None    # the cluster was whole again
    skipped: str = ""                    # why it never fired (its condition never held)
    burst_indexes: list[int] = field(default_factory=list)

    @property
    def detect_s(self) -> float | None:
        return None if self.detected_at is None or self.injected_at is None else self.detected_at - self.injected_at

    @property
    def recover_s(self) -> float | None:
        return None if self.recovered_at is None or self.injected_at is None else self.recovered_at - self.injected_at


class RouterEvents(logging.Handler):
    """The router's own account of retries and migrations (its WARNING log records), timestamped."""

    PATTERN = re.compile(r"request (\S+?): ")

    def __init__(self):
        super().__init__(logging.WARNING)
        self.records: list[tuple[float, str, str]] = []      # (monotonic time, request id, message)

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        match = self.PATTERN.match(message)
        if match:
            self.records.append((time.monotonic(), match.group(1), message))

    def since(self, t: float) -> list[tuple[float, str, str]]:
        return [r for r in self.records if r[0] >= t]



@dataclass
class DrillContext:
    """What a drill reaches: the router's pools, the load, the settings."""

    pools: object                                   # router.pools.Pools of the running cluster
    events: RouterEvents
    launch_burst: Callable[[int], Awaitable[list]]  # send n requests at once; returns their tasks
    burst: int
    transfer_deadline_s: float
    stream_idle_s: float
    retries_to_clear: int = 3
    arm_timeout_s: float = 60.0
    recover_timeout_s: float = 120.0
    say: Callable[[str], None] = print


async def wait_until(condition: Callable[[], object], timeout: float, interval: float = POLL_S) -> bool:
    """Poll `condition` (a plain or async callable) until it holds; False after `timeout`."""
    end = time.monotonic() + timeout
    while True:
        value = condition()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return True
        if time.monotonic() >= end:
            return False
        await asyncio.sleep(interval)


async def _actor_running(view) -> int:
    try:
        stats = await asyncio.wait_for(view.client.handle.stats.remote(), 2.0)
    except Exception:                   # restarting, or not answering: no requests to hit there
        return 0
    return stats["running_requests"]


async def _pool_whole(ctx: DrillContext) -> bool:
    """Every actor answers and the router has it in rotation."""
    views = ctx.pools.all()
    if not views or not all(v.healthy for v in views):
        return False
    try:
        await asyncio.wait_for(asyncio.gather(*(v.client.handle.info.remote() for v in views)), 5.0)
    except Exception:
        return False
    return True


async def run_drill(ctx: DrillContext, rec: FaultRecord, victim_index: int, armed: asyncio.Event) -> None:
    """Wait until the cluster is whole, arm (set `armed`), wait for the condition, inject, recover."""
    if not await wait_until(lambda: _pool_whole(ctx), ctx.recover_timeout_s, 0.05):
        rec.skipped = "the cluster was not whole again in time"
        armed.set()
        return
    rec.armed_at = time.monotonic()
    armed.set()
    if rec.kind == "burst":
        await _burst(ctx, rec)
    elif rec.kind in ("kill_prefill", "kill_decode"):
        await _kill(ctx, rec, victim_index)
    elif rec.kind in ("stall", "corrupt", "drop"):
        await _transfer_fault(ctx, rec, victim_index)
    elif rec.kind == "hang_decode":
        await _hang(ctx, rec, victim_index)
    else:
        raise ValueError(f"unknown drill {rec.kind!r}; drills are {', '.join(DRILLS)}")
    if rec.injected_at is not None:
        await wait_until(lambda: _pool_whole(ctx), ctx.recover_timeout_s, 0.05)
        rec.recovered_at = time.monotonic()


async def _burst(ctx: DrillContext, rec: FaultRecord) -> None:
    rec.victim = "router admission"
    rec.condition = "the decode pool has requests running (router view)"
    if not await wait_until(lambda: sum(v.running for v in ctx.pools.decode) >= 1, ctx.arm_timeout_s):
        rec.skipped = "no request ever ran"
        return
    rec.injected_at = time.monotonic()
    tasks = await ctx.launch_burst(ctx.burst)
    rec.burst_indexes = [t.index for t in tasks]
    await asyncio.gather(*(t.task for t in tasks), return_exceptions=True)
    rec.window_end = rec.cleared_at = time.monotonic()


async def _kill(ctx: DrillContext, rec: FaultRecord, victim_index: int) -> None:
    role = "prefill" if rec.kind == "kill_prefill" else "decode"
    pool = ctx.pools.prefill if role == "prefill" else ctx.pools.decode
    view = pool[victim_index % len(pool)]
    rec.victim = view.actor_id
    info = await asyncio.wait_for(view.client.handle.info.remote(), 30.0)
    incarnation = view.incarnation
    if role == "prefill":
        rec.condition = "prompts queued or computing on it (router view: queued_tokens > 0)"
        ready = await wait_until(lambda: view.queued_tokens > 0 and view.healthy, ctx.arm_timeout_s)
    else:
        rec.condition = "it reports >= 2 requests in its running batch (actor stats)"
        ready = await wait_until(lambda: _running_at_least(view, 2), ctx.arm_timeout_s)
    if not ready:
        rec.skipped = f"condition never held: {rec.condition}"
        return
    rec.injected_at = time.monotonic()
    os.kill(info["pid"], signal.SIGKILL)
    ctx.say(f"kill -9 {view.actor_id} (pid {info['pid']})")
    await _watch_detection(ctx, rec, view)
    await wait_until(lambda: view not in pool or (view.healthy and view.incarnation != incarnation),
                     ctx.recover_timeout_s, 0.05)
    rec.window_end = time.monotonic()


async def _running_at_least(view, n: int) -> bool:
    return view.healthy and await _actor_running(view) >= n


async def _watch_detection(ctx: DrillContext, rec: FaultRecord, view) -> None:
    """Until the router shows it noticed: the view marked unhealthy, or a request retried or migrated
    (no other fault is on while a drill runs, so the first retry after the injection is its doing)."""
    def noticed() -> bool:
        if not view.healthy:
            rec.detected_at, rec.detected_by = time.monotonic(), "view marked unhealthy"
            return True
        moved = ctx.events.since(rec.injected_at)
        if moved:
            rec.detected_at, rec.detected_by = moved[0][0], f"router: {moved[0][2][:160]}"
            return True
        return False
    await wait_until(noticed, ctx.recover_timeout_s, 0.002)


async def _transfer_fault(ctx: DrillContext, rec: FaultRecord, victim_index: int) -> None:
    view = ctx.pools.prefill[victim_index % len(ctx.pools.prefill)]
    rec.victim = view.actor_id
    rec.condition = "prompts queued or computing on it (router view: queued_tokens > 0)"
    if not await wait_until(lambda: view.queued_tokens > 0 and view.healthy, ctx.arm_timeout_s):
        rec.skipped = f"condition never held: {rec.condition}"
        return
    seconds = ctx.transfer_deadline_s + 1.0 if rec.kind == "stall" else 0.0
    await asyncio.wait_for(view.client.handle.set_fault.remote(rec.kind, seconds), 30.0)
    rec.injected_at = time.monotonic()
    ctx.say(f"{rec.kind} on {view.actor_id}'s KV transfers")
    try:
        await wait_until(lambda: len(ctx.events.since(rec.injected_at)) >= ctx.retries_to_clear, ctx.arm_timeout_s)
        first = ctx.events.since(rec.injected_at)
        if first:
            rec.detected_at, rec.detected_by = first[0][0], f"router: {first[0][2][:160]}"
    finally:
        await asyncio.wait_for(view.client.handle.set_fault.remote(None), 30.0)
        rec.cleared_at = time.monotonic()
    rec.window_end = rec.cleared_at + ctx.transfer_deadline_s + 1.0     # transfers begun before the clear


async def _hang(ctx: DrillContext, rec: FaultRecord, victim_index: int) -> None:
    # The victim is whichever decode actor first holds a running batch (starting at victim_index):
    # after a kill the router may quarantine or avoid the restarted actor, so a fixed one may stay idle.
    views = ctx.pools.decode[victim_index % len(ctx.pools.decode):] + ctx.pools.decode[:victim_index]
    chosen = []
    rec.condition = "a decode actor reports >= 2 requests in its running batch (actor stats)"

    async def some_actor_busy() -> bool:
        for candidate in views:
            if await _running_at_least(candidate, 2):
                chosen.append(candidate)
                return True
        return False
    if not await wait_until(some_actor_busy, ctx.arm_timeout_s):
        rec.victim = "decode pool"
        rec.skipped = f"condition never held: {rec.condition}"
        return
    view = chosen[0]
    rec.victim = view.actor_id
    seconds = ctx.stream_idle_s + 2.0          # past the router's idle limit: it must migrate
    await asyncio.wait_for(view.client.handle.set_fault.remote("hang", seconds), 30.0)
    rec.injected_at = time.monotonic()
    ctx.say(f"hang {view.actor_id}'s engine loop for {seconds:.1f}s")
    await _watch_detection(ctx, rec, view)
    await wait_until(lambda: time.monotonic() >= rec.injected_at + seconds, seconds + 1.0, 0.05)
    rec.cleared_at = time.monotonic()
    rec.window_end = rec.cleared_at
