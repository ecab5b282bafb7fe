"""The chaos run against a running cluster: steady clients, the drill schedule, the settle and leak check.

    steady clients  keep `concurrency` requests in flight, in request order
    controller      drill i is due once `due[i]` steady requests were sent; it waits until the cluster is
                    whole again, arms, waits for its condition, injects and waits for recovery. The
                    clients do not pass `due[i]` before drill i is armed, so every drill fires inside the
                    run and a new one never starts while the last one is still being recovered from
    progress        one line every `progress_every_s` seconds
    end             every call ends by its own deadline; one still open after the last deadline hung.
                    Then the cluster settles, GetStats must show 0 KV blocks used on every actor, the
                    router's reservations must be back to 0, and a fresh request must be served.

Requests drawn for bursts are kept apart: a burst sends the next `burst` of them at once.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field

import grpc

from bench.chaos.client import Outcome, run_request
from bench.chaos.drills import DRILLS, DrillContext, FaultRecord, RouterEvents, run_drill, wait_until
from bench.chaos.workload import ChaosRequest
from proto.pdserve.v1 import generation_pb2 as pb
from proto.pdserve.v1 import generation_pb2_grpc as pb_grpc

NUM_CHANNELS = 4          # client connections to the router, requests spread over them


@dataclass(slots=True)
class RunSettings:
    concurrency: int = 12
    burst: int = 48
    rounds: int = 1                       # the drill list, this many times (victims alternate)
    drills: tuple[str, ...] = DRILLS
    stream_idle_s: float = 3.0            # the router's silence limit on an actor (a hang must exceed it)
    transfer_deadline_s: float = 3.0
    retries_to_clear: int = 3
    settle_timeout_s: float = 60.0
    leak_wait_s: float = 30.0             # orphaned KV is parked for orphan_lease_s (10 s) before it is freed
    progress_every_s: float = 3.0


@dataclass(slots=True)
class Launched:
    index: int
    task: asyncio.Task


@dataclass
class RunResult:
    outcomes: dict[int, Outcome]
    faults: list[FaultRecord]
    router_events: list[tuple[float, str, str]]
    blocks_used: dict[str, int]                 # actor -> kv_blocks_used after the run (GetStats)
    missing_actors: list[str]                   # actors GetStats did not list
    router_accounting: dict[str, dict]          # view -> what the router still holds for it
    served_after: bool
    started: float
    finished: float
    notes: list[str] = field(default_factory=list)


def schedule(settings: RunSettings, num_steady: int) -> list[tuple[int, str, int]]:
    """[(due after this many steady requests, drill, victim index)], spread evenly over the run."""
    plan = [(kind, r) for r in range(settings.rounds) for kind in settings.drills]
    return [((i + 1) * num_steady // (len(plan) + 1), kind, r) for i, (kind, r) in enumerate(plan)]


def split_requests(requests: list[ChaosRequest], settings: RunSettings) -> tuple[list, list]:
    """(steady, burst): the last `burst` x (number of bursts) requests are the bursts' own."""
    num_burst = settings.burst * settings.rounds * settings.drills.count("burst")
    num_burst = min(num_burst, len(requests) // 2)
    return requests[:len(requests) - num_burst], requests[len(requests) - num_burst:]


class _Clients:
    def __init__(self, address: str, steady: list[ChaosRequest], burst: list[ChaosRequest], concurrency: int):
        self.channels = [grpc.aio.insecure_channel(address) for _ in range(NUM_CHANNELS)]
        self.stubs = [pb_grpc.GenerationServiceStub(c) for c in self.channels]
        self.steady, self.burst = deque(steady), deque(burst)
        self.outcomes: dict[int, Outcome] = {}
        self.tasks: list[asyncio.Task] = []
        self.slots = asyncio.Semaphore(concurrency)
        self.num_steady_sent = 0

    def _send(self, req: ChaosRequest, burst: bool = False) -> Launched:
        out = self.outcomes[req.index] = Outcome(req.index, time.monotonic(), burst=burst)
        task = asyncio.ensure_future(run_request(self.stubs[req.index % len(self.stubs)], req, out))
        self.tasks.append(task)
        return Launched(req.index, task)

    async def launch_burst(self, n: int) -> list[Launched]:
        return [self._send(self.burst.popleft(), burst=True) for _ in range(min(n, len(self.burst)))]

    async def run_steady(self, gate) -> None:
        while self.steady:
            await gate(self.num_steady_sent)
            await self.slots.acquire()
            launched = self._send(self.steady.popleft())
            self.num_steady_sent += 1
            launched.task.add_done_callback(lambda _: self.slots.release())

    def in_flight(self) -> int:
        return sum(1 for o in self.outcomes.values() if o.ended is None)

    async def close(self) -> None:
        for channel in self.channels:
            await channel.close()


async def run_chaos(cluster, requests: list[ChaosRequest], settings: RunSettings, say=print) -> RunResult:
    """Run `requests` through `cluster` (a `deploy.running.RunningCluster`) with the drills injected."""
    backend = cluster.backend
    backend.routing.stream_idle_s = settings.stream_idle_s
    backend.routing.transfer_deadline_s = settings.transfer_deadline_s
    events = RouterEvents()
    router_log = logging.getLogger("pdserve.router")
    router_log.addHandler(events)
    steady, burst = split_requests(requests, settings)
    plan = schedule(settings, len(steady))
    armed = [asyncio.Event() for _ in plan]
    faults = [FaultRecord(kind, due_at_request=due) for due, kind, _ in plan]
    clients = _Clients(cluster.address, steady, burst, settings.concurrency)
    ctx = DrillContext(backend.pools, events, clients.launch_burst, settings.burst, settings.transfer_deadline_s,
                       settings.stream_idle_s, settings.retries_to_clear, say=lambda line: say(f"  {line}"))
    state = {"drill": "none yet"}
    started = time.monotonic()

    async def gate(num_sent: int) -> None:
        for (due, _, _), event in zip(plan, armed):
            if num_sent >= due and not event.is_set():
                await event.wait()

    async def controller() -> None:
        for (due, kind, victim), rec, event in zip(plan, faults, armed):
            await wait_until(lambda: clients.num_steady_sent >= due or not clients.steady, float("inf"), 0.01)
            state["drill"] = f"{kind} (armed at request {clients.num_steady_sent})"
            await run_drill(ctx, rec, victim, event)
            state["drill"] = f"{kind} done" if not rec.skipped else f"{kind} skipped: {rec.skipped}"
            say(f"  drill {kind} on {rec.victim or '-'}: " + (f"skipped ({rec.skipped})" if rec.skipped else
                f"detected {_s(rec.detect_s)}, whole again {_s(rec.recover_s)}"))

    async def progress() -> None:
        while True:
            await asyncio.sleep(settings.progress_every_s)
            ended = [o for o in clients.outcomes.values() if o.ended is not None]
            errors = sum(1 for o in ended if o.code is not None)
            say(f"[chaos {time.monotonic() - started:6.1f}s] sent {len(clients.outcomes)}/{len(requests)}, "
                f"ended {len(ended)} ({errors} with a status), in flight {clients.in_flight()}, "
                f"router retries/migrations {len(events.records)}, drill: {state['drill']}")

    ticker = asyncio.ensure_future(progress())
    notes: list[str] = []
    try:
        await asyncio.gather(clients.run_steady(gate), controller())
        last_deadline = max((r.deadline_s for r in requests), default=0.0)
        done, pending = await asyncio.wait(clients.tasks, timeout=last_deadline + 10.0) if clients.tasks else ((), ())
        for task in pending:             # still open after every deadline passed: hung
            task.cancel()
        if pending:
            notes.append(f"{len(pending)} requests still open {last_deadline + 10:.0f}s after the last was sent")
        finished = time.monotonic()
        say(f"[chaos {finished - started:6.1f}s] all {len(clients.outcomes)} requests ended or given up; settling")
        blocks_used, missing, served = await _settle(cluster, settings, notes, say)
    finally:
        ticker.cancel()
        router_log.removeHandler(events)
        await clients.close()
    accounting = {v.actor_id: _view_accounting(v) for v in backend.pools.all()}
    accounting["admission"] = {"waiting": backend.admission.num_waiting}
    return RunResult(clients.outcomes, faults, list(events.records), blocks_used, missing, accounting, served,
                     started, finished, notes)


def _view_accounting(view) -> dict:
    if hasattr(view, "reserved_blocks"):
        return {"reserved_blocks": view.reserved_blocks, "running": view.running}
    return {"queued_tokens": view.queued_tokens}


async def _settle(cluster, settings: RunSettings, notes: list[str], say) -> tuple[dict[str, int], list[str], bool]:
    """Wait for every actor in rotation, then for GetStats to show no KV block used; serve one request."""
    pools = cluster.backend.pools
    if not await wait_until(lambda: all(v.healthy for v in pools.all()), settings.settle_timeout_s, 0.1):
        notes.append("not every actor was back in rotation after the run: "
                     + ", ".join(v.actor_id for v in pools.all() if not v.healthy))
    channel = grpc.aio.insecure_channel(cluster.address)
    stub = pb_grpc.GenerationServiceStub(channel)
    expected = {v.actor_id for v in pools.all()}
    stats, error = None, ""

    async def all_free() -> bool:
        nonlocal stats, error
        try:
            stats, error = await stub.GetStats(pb.GetStatsRequest(), timeout=10), ""
        except grpc.aio.AioRpcError as e:
            error = f"GetStats failed: {e.code().name} {e.details()}"
            return False
        return {a.actor_id for a in stats.actors} >= expected and all(a.kv_blocks_used == 0 for a in stats.actors)
    t0 = time.monotonic()
    await wait_until(all_free, settings.leak_wait_s, 0.2)
    if error:
        notes.append(error)
    say(f"  GetStats after {time.monotonic() - t0:.1f}s: "
        + ", ".join(f"{a.actor_id} {a.kv_blocks_used} blocks used" for a in (stats.actors if stats else [])))
    blocks_used = {a.actor_id: a.kv_blocks_used for a in stats.actors} if stats else {}
    missing = sorted(expected - set(blocks_used))
    served = False
    try:
        request = pb.GenerateRequest(prompt="after the chaos", sampling=pb.SamplingParams(max_tokens=4, temperature=0))
        async for msg in stub.Generate(request, timeout=30):
            served = served or bool(msg.finish_reason)
    except grpc.aio.AioRpcError as e:
        notes.append(f"a fresh request after the run failed: {e.code().name} {e.details()}")
    await channel.close()
    return blocks_used, missing, served


def _s(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.2f}s"
