"""A simulated cluster: the real router over the real workers, each worker's engine a `SimEngine`.

One `SimActor` per actor of the config's pools, as `deploy.launcher.start_pools` would start them
(in colocated mode: prefill + decode count colocated engines with the decode pool's settings). Each
actor's steps are timed by its pool's model at the pool's `tensor_parallel` (`PoolModels`; colocated
actors at the decode pool's degree), the KV handoff by the model of the lower of the two degrees:

    SimActor ── drives ──► PrefillWorker | DecodeWorker | ColocatedWorker   (prefill_worker/, decode_worker/)
                               └─ SimEngine (real Engine bookkeeping, Scheduler, BlockManager)
    the router's Dispatcher ── bench.serving.local_actors clients ──► the workers (the actor protocol)
    PrefillWorker ── SimSender ─► SimReceiver ─► DecodeWorker            (bench.simulate.sim_transport)

A worker's engine loop is a thread in a real actor; here `SimEngineLoop` makes it a task on the
virtual clock: the actor drains the worker's inbox and runs one step (`EngineLoop.run_once`, the same
call the thread makes), then sleeps the step's simulated time. What the worker sends back to the
router once the step's forward pass is priced (tokens, prefill results) is held until the step's
time has passed, so the router sees it when a real actor would have sent it; what it sends before
(a first token adopted with its KV, an error) goes at once, as a real worker sends it before its
forward pass. Commands the router posts meanwhile wait in the inbox for the next step, as they do
for a real engine thread.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from bench.serving.local_actors import LocalDecodeClient, LocalPrefillClient
from bench.simulate.measured import MeasuredModel
from bench.simulate.sim_engine import SimEngine, SimTokenizer
from bench.simulate.sim_spec import speculation_for
from bench.simulate.sim_transport import SimNetwork, SimReceiver, SimSender
from bench.simulate.plan_profile import performance_of
from bench.simulate.step_time import PoolModels, StepTimeModel, sim_args
from decode_worker.colocated import ColocatedWorker
from decode_worker.worker import DecodeWorker
from deploy.config import PDServeConfig
from deploy.launcher import colocated_engine_args, engine_args, role_engine_args, tensor_parallel_degrees
from deploy.performance import live_model
from deploy.role_change import change_role
from deploy.running import routing_settings
from engine.model.config import ModelConfig
from engine.scheduling.loop import EngineLoop
from prefill_worker.worker import PrefillWorker
from kv_transfer import wire_bytes_per_kv_byte
from router.dispatcher import Dispatcher
from router.metrics import Metrics
from router.pools import DecodeView, Pools, PrefillView

log = logging.getLogger(f"pdserve.{__name__}")

IDLE_QUANTUM_S = 0.01     # an engine with work it cannot schedule yet (no free block) looks again after this


class SimEngineLoop(EngineLoop):
    """A worker's `EngineLoop` without its thread: `SimActor` calls `run_once`; posting wakes the actor, so
    `run_async` (a role change's checks) is answered between simulated steps, as the thread answers it."""

    def __init__(self, actor: SimActor, step: Callable[[], float]):
        super().__init__(f"{actor.actor_id}-loop", step)
        self.actor = actor

    def call(self, fn: Callable[[], None]) -> None:
        self._inbox.put(fn)
        self.actor.poke()

    def wake(self) -> None:
        self.actor.poke()

    def start(self) -> None:
        self.actor.start()

    def stop(self, timeout: float = 5.0) -> None:
        self.actor.stop()


class SimActor:
    """One simulated actor: its worker, driven step by step on the virtual clock (module docstring)."""

    def __init__(self, actor_id: str, role: str, engine: SimEngine, cluster: SimCluster,
                 limits: dict | None = None):
        """limits: the scheduler limits of each role (`deploy.actor.RoleLimits`) of a role-flippable actor."""
        self.actor_id, self.role, self.engine, self.cluster, self.limits = actor_id, role, engine, cluster, limits
        self.retired = False
        self.busy_until = 0.0        # when the step in progress ends (virtual seconds)
        self.step_s = 0.0            # that step's length
        self.num_steps = 0
        self.busy_s = 0.0            # virtual seconds spent in steps
        self._held: list[tuple[Callable, object]] = []
        self._stepping = False       # in the worker's run_once ...
        self._computing = False      # ... past the pricing of its forward pass: sends wait for the step's end
        self._stretch = 1.0          # the step's slow-down on a shared host (`_shared`) ...
        self.step_prefill = False    # ... and whether the step holds a prompt chunk
        self._poked = False
        self._wake: asyncio.Future | None = None
        self._task: asyncio.Task | None = None
        engine.runner.on_step = self._priced
        self.worker = self._make_worker(role)

    def _make_worker(self, role: str):
        """The worker of `role` over this actor's engine, as `deploy.actor.ServingActor` makes it."""
        engine, cluster = self.engine, self.cluster
        if self.limits is not None:
            limits, sched = self.limits[role], engine.scheduler
            sched.max_num_seqs, sched.max_num_batched_tokens = limits.max_num_seqs, limits.max_num_batched_tokens
            sched.chunk_size = limits.chunk_size
        engine.layer_hook = None
        if role == "prefill":
            sender = SimSender(cluster.network, self, cluster.models.link, engine.kv_bytes_per_block,
                               cluster.wire_ratio, cluster.cfg.kv_transfer.layerwise)
            worker = PrefillWorker(engine, sender, self.actor_id, layerwise=cluster.cfg.kv_transfer.layerwise)
        elif role == "decode":
            worker = DecodeWorker(engine, lambda on_complete: SimReceiver(cluster.network, engine.block_manager,
                                                                          on_complete), self.actor_id)
        else:
            worker = ColocatedWorker(engine, self.actor_id)
        worker.loop = SimEngineLoop(self, worker.loop._step)
        return worker

    async def set_role(self, role: str, timeout_s: float) -> int:
        """Change role with `deploy.role_change.change_role`, the procedure `deploy.actor.ServingActor.set_role`
        runs: wait for the work in hand (past `timeout_s`, hand it off: decode requests migrate, prefills are
        retried elsewhere), then a worker of the new role over the same engine. Returns how many requests
        were handed off."""
        if self.limits is None:
            raise RuntimeError(f"{self.actor_id} cannot change role (routing.role_flips is off)")
        if role == self.role:
            return 0
        return await change_role(self, role, timeout_s, self._make_worker)

    def _priced(self, step_s: float) -> None:
        """The step the worker is taking lasts `step_s` from now (on a shared host, longer while other actors
        are in a step: `_shared`): what a KV send of its output waits for. Until the actor sleeps it, the
        engine's stamps read the step's end (`VirtualClock.ahead`)."""
        if step_s > 0:
            loop = asyncio.get_running_loop()
            if self.cluster.shared_host:
                self._stretch = self._shared(loop.time(), self.engine.runner.last_prefill)
                step_s = self.engine.runner.last_step_s = step_s * self._stretch
            self.busy_until, self.step_s = loop.time() + step_s, step_s
            loop.clock.ahead = step_s
            self._computing = self._stepping

    def _shared(self, now: float, prefill: bool) -> float:
        """How much longer a step starting `now` (with a prompt chunk if `prefill`) takes on the shared host:
        1 + k·(factor − 1), the factor `StepTimeModel.shared_factor` of its kind, k the other actors in a step;
        for a decode step only those in a step with a prompt chunk (decode steps side by side share the host
        without slowing each other, each a memory-bound loop on a core of its own)."""
        self.step_prefill = prefill
        others = sum(1 for a in self.cluster.actors if a is not self and not a.retired and a.busy_until > now
                      and (prefill or a.step_prefill))
        return 1.0 + others * (self.cluster.model.shared_factor(prefill) - 1.0) if others else 1.0

    def lengthen(self, seconds: float) -> None:
        """The step in progress takes `seconds` more: a KV send's work on this actor's cores (the prefill worker
        sends from its step), on a shared host stretched as the step it is part of."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        if self.busy_until <= now:
            self.busy_until, self.step_s = now, 0.0
            if self.cluster.shared_host:
                self._stretch = self._shared(now, True)          # (a send is the prefill's work)
        seconds *= self._stretch
        self.busy_until += seconds
        self.step_s += seconds
        self.engine.runner.last_step_s += seconds
        if self._stepping:
            loop.clock.ahead += seconds

    def bridge(self, fn: Callable) -> Callable:
        """The worker → router path: held while a step computes, delivered when its time has passed; at once
        before the step's forward pass (and between steps)."""
        def deliver(value) -> None:
            if self._computing:
                self._held.append((fn, value))
            else:
                fn(value)
        return deliver

    def poke(self) -> None:
        self._poked = True
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name=f"sim-{self.actor_id}")

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def _run(self) -> None:
        engine_loop = self.worker.loop
        while True:
            self._poked = False
            self._stepping = True
            try:
                wait_s = engine_loop.run_once(0.0)
            except Exception as e:      # as the engine thread does: log, keep serving
                log.exception("simulated engine loop error on %s: %s", self.actor_id, e)
                wait_s = 0.05
            finally:
                asyncio.get_running_loop().clock.ahead = 0.0     # the step's time passes in the sleep below
            step_s = self.engine.runner.take_step_s()
            if step_s > 0:                  # busy_until: set when the step was priced (`_priced`)
                self.num_steps += 1
                self.busy_s += step_s
                await asyncio.sleep(step_s)
            self._stepping = self._computing = False
            held, self._held = self._held, []
            for fn, value in held:
                fn(value)
            if step_s > 0 or self._poked:
                continue
            await self._idle(wait_s if wait_s > 0 else IDLE_QUANTUM_S)

    async def _idle(self, timeout: float) -> None:
        loop = asyncio.get_running_loop()
        self._wake = loop.create_future()
        timer = loop.call_later(timeout, lambda f=self._wake: f.done() or f.set_result(None))
        try:
            await self._wake
        finally:
            timer.cancel()
            self._wake = None


class SimCluster:
    """The simulated actors and the router over them; it makes actors as the deploy factory would.

    `model` times degree 1; `models` holds each pool's model at its configured degree. `speculation`: the
    config's speculative decoding with the acceptance the simulated proposals meet (`sim_spec.speculation_for`:
    `spec_acceptance`, else the measured profile's); None with it off."""

    def __init__(self, cfg: PDServeConfig, model: StepTimeModel, shape: ModelConfig, mode: str, chunked: bool,
                 spec_acceptance: float | None = None):
        self.cfg, self.model, self.shape, self.mode, self.chunked = cfg, model, shape, mode, chunked
        self.models = PoolModels.of(model, tensor_parallel_degrees(cfg, mode), colocated=mode == "colocated")
        profile = model.profile.data if isinstance(model, MeasuredModel) else None
        self.speculation = speculation_for(cfg, shape, profile, spec_acceptance)
        self.network = SimNetwork()
        self.shared_host = model.shared_host         # every actor on one host: steps slow each other
        dtype_bytes = max(model.kv_bytes_per_token // max(shape.kv_bytes_per_token(1), 1), 1)
        self.wire_ratio = wire_bytes_per_kv_byte(cfg.transfer_codec(), dtype_bytes, cfg.kv_cache.block_size,
                                                 shape.head_dim)
        self.actors: list[SimActor] = []
        self.dispatcher: Dispatcher | None = None
        self.autoscaler = None                       # deploy.autoscaler.Autoscaler, when the run has one
        self.metrics = Metrics()                     # the dispatcher's per-request counters, as a router's
        self._next_index: dict[str, int] = {}

    def flippable(self, pool: str) -> bool:
        """As `deploy.launcher.ActorFactory.flippable`: role flips on, and a prefill or decode actor."""
        return self.mode != "colocated" and self.cfg.routing.role_flips != "off" and pool in ("prefill", "decode")

    def new_actor(self, pool: str) -> SimActor:
        """An actor of `pool` with the engine `deploy.launcher.ActorFactory.spawn` would give it (not started)."""
        cfg, name = self.cfg, self.cfg.model.name
        index = self._next_index.get(pool, 0)
        self._next_index[pool] = index + 1
        limits = None
        if self.mode == "colocated":
            role, args = "colocated", colocated_engine_args(cfg, name, self.chunked, self.shape)
        else:
            role = "prefill" if pool == "prefill" else "decode"
            if self.flippable(pool):
                args, limits = role_engine_args(cfg, name, self.shape)
            else:
                args = engine_args(cfg, pool, name, self.shape)
        actor_id = f"{role if role == 'colocated' else pool}-{index}"
        kv_pool = "decode" if role == "colocated" or self.flippable(pool) else pool     # (as their engine args take)
        model = self.models.of_pool(pool).for_engine(args, cfg.pool_kv_cache(kv_pool))
        if args.speculative.enabled:       # (decode, colocated and role-flippable actors, as the launcher sets)
            model = model.with_speculation(self.speculation)
        actor = SimActor(actor_id, role, SimEngine(sim_args(args, model), self.shape, model), self, limits)
        self.actors.append(actor)
        return actor

    def view_of(self, pool: str, actor: SimActor):
        """The router's view of `actor` serving in `pool`."""
        worker, blocks = actor.worker, actor.engine.block_manager.num_blocks
        if pool == "prefill":
            return PrefillView(actor.actor_id, LocalPrefillClient(worker, actor.bridge), blocks)
        return DecodeView(actor.actor_id, LocalDecodeClient(worker, actor.bridge), worker.endpoint, blocks)

    def actor(self, actor_id: str) -> SimActor:
        return next(a for a in self.actors if a.actor_id == actor_id and not a.retired)

    def start(self) -> None:
        for actor in self.actors:
            actor.start()

    def stop(self) -> None:
        for actor in self.actors:
            actor.stop()


def pool_sizes(cfg: PDServeConfig, counts: dict[str, int] | None = None) -> dict[str, int]:
    """Actors per pool at start, as `deploy.launcher.start_pools` counts them."""
    counts = counts or {}
    return {pool: p.bounds()[0] if counts.get(pool) is None else counts[pool] for pool, p in cfg.pools.items()}


def build_cluster(cfg: PDServeConfig, model: StepTimeModel, sim_cfg: ModelConfig, mode: str = "disaggregated",
                  chunked: bool = True, counts: dict[str, int] | None = None,
                  spec_acceptance: float | None = None) -> SimCluster:
    """The simulated actors of `cfg` (in `mode`: disaggregated or colocated, as `deploy.launcher.start_pools`
    lays them out) and the router over them. Call inside the virtual loop; `SimCluster.start` starts them.
    spec_acceptance: with `speculative:` on, the acceptance rate its proposals meet (`SimCluster`).
    ValueError naming `kv_cache.tiers` where a pool has tiers: the simulated engines have none, and a run
    without them would be reported as the config's."""
    for pool, section in cfg.pools.items():
        if cfg.pool_kv_cache(pool).tiers:
            key = f"pools.{pool}.kv_cache.tiers" if section.kv_cache is not None and section.kv_cache.tiers \
                else "kv_cache.tiers"
            raise ValueError(f"{key}: the simulator does not model KV tiers (pool {pool} has "
                             f"{len(cfg.pool_kv_cache(pool).tiers)}); remove them (--set {key}=[]) to "
                             "simulate the rest of the config")
    cluster = SimCluster(cfg, model, sim_cfg, mode, chunked, spec_acceptance)
    size = pool_sizes(cfg, counts)
    pools = Pools()
    if mode == "colocated":
        for _ in range(size["prefill"] + size["decode"]):
            pools.decode.append(cluster.view_of("decode", cluster.new_actor("decode")))
    else:
        for pool, n in size.items():
            for _ in range(n):
                pools.get(pool).append(cluster.view_of(pool, cluster.new_actor(pool)))
    # (the router's live model rests on the degree-1 profile, as `deploy.running` gives the real router)
    live = live_model(cfg, performance_of(model, sim_cfg, cfg, cluster.speculation))
    cluster.dispatcher = Dispatcher(pools, SimTokenizer(sim_cfg.vocab_size), context_of(cfg, sim_cfg),
                                    cfg.kv_cache.block_size,
                                    routing_settings(cfg), codec=cfg.kv_transfer.compression, live=live,
                                    metrics=cluster.metrics)
    return cluster


def context_of(cfg: PDServeConfig, shape: ModelConfig) -> int:
    """The tokens a request may span (prompt + output) in a simulated cluster of `cfg` over a model of `shape`:
    the config's `model.max_model_len` within the model's context, as the router and the engines take it."""
    return min(cfg.model.max_model_len or shape.context_limit, shape.context_limit)
