"""One simulated serving run: a workload at a rate through a simulated cluster, timed as `bench serve` times it.

The load generator is `bench.serving.load.run_load`, unchanged: the same arrivals for the same seed,
the same per-request records, summarized by `bench.serving.metrics.summarize` into the report
`pdserve bench serve` prints. Requests enter through the router's `RequestCore` (the in-flight
limit, admission) and its `Dispatcher`, as both front doors hand them over; only the socket between
client and router is left out.
"""
from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import math
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from prometheus_client import generate_latest

from bench.serving.clients import FINISH_NAMES, Piece
from bench.serving.load import RequestRecord, arrival_gaps, one_request, run_load
from bench.serving.metrics import parse_counters, summarize
from bench.serving.workloads import Conversation, RequestSpec
from bench.simulate.clock import run_virtual
from bench.serving.runs import sample_roles
from bench.simulate.sim_cluster import SimCluster, build_cluster
from bench.simulate.sim_control import ACTOR_START_S, start_autoscaler, wants_autoscaler
from bench.simulate.step_time import StepTimeModel
from deploy.autoscaler import AutoscaleSettings
from deploy.config import PDServeConfig
from deploy.running import max_in_flight
from engine.model.config import ModelConfig
from engine.sampling.params import SamplingParams
from router.backend import GenerationInput
from router.request_core import RequestCore
from router.validation import RequestError


ROLE_SAMPLE_S = 1.0          # how often the actors per role are recorded (simulated seconds)
GC_YOUNG_THRESHOLD = 50_000    # allocations between collections of the young generation during a run


class CoreClient:
    """The load generator's client over a `RequestCore` in this process (`bench.serving.clients` shape)."""

    api = "sim"

    def __init__(self, core: RequestCore, keep_answers: bool = False):
        self.core = core
        self.answers: dict[str, list[int]] | None = {} if keep_answers else None   # request id -> its tokens

    async def stream(self, spec: RequestSpec, request_id: str, timeout: float) -> AsyncIterator[Piece]:
        params = SamplingParams(max_tokens=spec.output_len, temperature=0.0, ignore_eos=True)
        deadline = time.monotonic() + timeout

        def validate(_in_flight) -> GenerationInput:
            return GenerationInput(request_id, list(spec.prompt_token_ids), params, deadline)
        admitted = await self.core.admit(validate, api=self.api)
        try:
            # the client's deadline ends the request, as a gRPC client's does (one timer a request, not a token)
            async with asyncio.timeout(max(deadline - time.monotonic(), 0.0)), \
                    contextlib.aclosing(admitted.chunks()) as chunks:
                async for chunk in chunks:
                    if self.answers is not None:
                        self.answers.setdefault(request_id, []).extend(chunk.token_ids)
                    piece = Piece(len(chunk.token_ids))
                    if chunk.finish_reason:
                        piece.finish_reason = FINISH_NAMES.get(chunk.finish_reason, str(chunk.finish_reason))
                    if chunk.usage is not None:
                        piece.completion_tokens = chunk.usage.completion_tokens
                        piece.cached_prompt_tokens = chunk.usage.cached_prompt_tokens
                    if chunk.timing is not None:
                        piece.timing = chunk.timing.to_proto()
                    yield piece
        except TimeoutError:
            raise RequestError("DEADLINE_EXCEEDED", f"the client's deadline of {timeout:g} s passed") from None
        finally:
            admitted.finish()


PER_REQUEST_EVENTS = frozenset({"request_finished", "request_rejected", "client_disconnected"})


def per_request_lines(record: logging.LogRecord) -> bool:
    """The router's log filter during a run: its line per request is left out, also a failed request's warning
    (the run's own line counts the failures and gives the first reason; `--json` has each one)."""
    return getattr(record, "event", None) not in PER_REQUEST_EVENTS


@dataclass
class SimRun:
    """What one simulated run produced."""

    label: str
    records: list[RequestRecord]
    duration_s: float          # virtual seconds, first send to last response
    wall_s: float
    summary: dict
    actors: list[dict]         # per actor: id, role, steps, busy share
    roles: list[dict]          # actors per role over time (with the autoscaler's view when one runs)
    flips: list[dict]          # role flips the autoscaler made

    @property
    def requests_per_wall_s(self) -> float:
        return len(self.records) / self.wall_s if self.wall_s > 0 else math.inf


async def run_conversations(client: CoreClient, conversations: list[Conversation], *, rate: float,
                            burstiness: float = 1.0, seed: int = 0, timeout: float = 600.0
                            ) -> tuple[list[RequestRecord], float]:
    """Conversations arrive at `rate`; each sends its turns in order, the next as soon as the last answered,
    its prompt the previous prompt + the answer + the next user message (`workloads.make_conversations`)."""
    gaps = arrival_gaps(len(conversations), rate, burstiness, seed)
    records: list[RequestRecord] = []
    t0 = time.monotonic()

    async def talk(index: int, conv: Conversation) -> None:
        prompt, answer = list(conv.first_prompt), []
        for k, output_len in enumerate(conv.output_lens):
            if k:
                prompt = prompt + answer + conv.user_messages[k - 1]
            rid = f"sim-{seed}-c{index}-t{k}"
            record = RequestRecord(len(records), rid, f"turn-{k}", len(prompt), output_len)
            records.append(record)
            await one_request(client, RequestSpec(prompt, output_len, kind=record.kind), record, t0, timeout)
            answer = client.answers.pop(rid, [])
            if not record.ok:
                return

    tasks = []
    for gap, (i, conv) in zip(gaps, enumerate(conversations)):
        tasks.append(asyncio.ensure_future(talk(i, conv)))
        if gap:
            await asyncio.sleep(gap)
    await asyncio.gather(*tasks)
    return records, time.monotonic() - t0


def simulate(cfg: PDServeConfig, model: StepTimeModel, sim_cfg: ModelConfig,
             specs: list[RequestSpec] | list[Conversation], *,
             rate: float, mode: str = "disaggregated", chunked: bool = True, seed: int = 0, burstiness: float = 1.0,
             slo_ttft_s: float, slo_tpot_s: float, counts: dict[str, int] | None = None, label: str = "",
             progress: bool = False, timeout_s: float = 600.0, autoscale: AutoscaleSettings | None = None,
             actor_start_s: float = ACTOR_START_S, spec_acceptance: float | None = None) -> SimRun:
    """Run `specs` at `rate` requests/s (Poisson for burstiness 1) through the simulated cluster of `cfg`;
    `Conversation`s arrive at `rate` conversations/s (`run_conversations`). With pools of `count: auto` or
    `routing.role_flips: auto` the autoscaler runs (`autoscale`, default its settings; new actors take
    `actor_start_s` to come up). With `speculative:` on, the proposals meet `spec_acceptance` (accepted /
    proposed tokens; None: the measured profile's, `bench.simulate.sim_spec`)."""
    label = label or mode
    roles: list[dict] = []
    started: list[float] = []        # the virtual time the load began (the zero of roles' and flips' times)

    async def main() -> tuple[list[RequestRecord], float, SimCluster]:
        cluster = build_cluster(cfg, model, sim_cfg, mode, chunked, counts, spec_acceptance)
        # What exists now (the actors' block pools, the workload) lives the whole run: out of the collector's
        # sight, a full collection walks only what the run allocates (as a serving process freezes after
        # start-up); and the young generation is collected every GC_YOUNG_THRESHOLD allocations, not 700.
        gc.collect()
        gc.freeze()
        gc.set_threshold(GC_YOUNG_THRESHOLD, *thresholds[1:])
        cluster.start()
        d = cluster.dispatcher
        core = RequestCore(d, max_in_flight(cfg, d.pools))
        core.ready = True
        loop = asyncio.get_running_loop()
        tasks = [loop.create_task(d.poll_kv_events())]
        if wants_autoscaler(cluster):
            cluster.autoscaler = start_autoscaler(cluster, autoscale or AutoscaleSettings(), actor_start_s)
            tasks.append(cluster.autoscaler.task)
        tasks.append(loop.create_task(sample_roles(d.pools, roles, cluster.autoscaler, ROLE_SAMPLE_S)))
        started.append(time.monotonic())
        try:
            if specs and isinstance(specs[0], Conversation):
                records, duration = await run_conversations(CoreClient(core, keep_answers=True), specs, rate=rate,
                                                            burstiness=burstiness, seed=seed, timeout=timeout_s)
            else:
                records, duration = await run_load(CoreClient(core), specs, request_rate=rate, burstiness=burstiness,
                                                   seed=seed, label=f"simulate {label}", tag="sim",
                                                   progress=progress, timeout=timeout_s)
        finally:
            for task in tasks:
                task.cancel()
            cluster.stop()
        return records, duration, cluster

    random.seed(seed)
    thresholds = gc.get_threshold()
    quiet = logging.getLogger("pdserve")
    level, quiet.level = quiet.level, max(quiet.level, logging.WARNING)   # no line per request at scale
    router_log = logging.getLogger("pdserve.router")
    router_log.addFilter(per_request_lines)
    wall = time.perf_counter()
    try:
        records, duration, cluster = run_virtual(main())
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)
        quiet.setLevel(level)
        router_log.removeFilter(per_request_lines)
    wall = time.perf_counter() - wall
    summary = summarize(records, duration, slo_ttft_s, slo_tpot_s)
    summary.update(parse_counters(generate_latest(cluster.metrics.registry).decode()))  # as bench serve's /metrics
    actors = [{"actor_id": a.actor_id, "role": a.role, "steps": a.num_steps,
               "busy": a.busy_s / duration if duration > 0 else 0.0} for a in cluster.actors]
    scaler = cluster.autoscaler
    flips = [] if scaler is None else [dict(actor_id=f.actor_id, from_role=f.from_role, to_role=f.to_role,
                                            at_s=f.ended_at - started[0], seconds=f.seconds, drain_s=f.drain_s,
                                            handed_off=f.handed_off) for f in scaler.manager.flips]
    return SimRun(label, records, duration, wall, summary, actors, roles, flips)
