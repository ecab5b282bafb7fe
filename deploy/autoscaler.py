"""Autoscaler: for pools with `count: auto`, apply the planner to live traffic, within min..max.

Every `interval_s`:

    observe  ─ finished requests of the last `window_s` (Dispatcher.recent_finished): arrival
               rate, mean prompt/output lengths, measured TTFT and TPOT; in-flight work
               (decode requests running or waiting for admission, queued prefill tokens)
    correct  ─ correction = measured / predicted TTFT and TPOT (smoothed, clamped): what the
               planner's queueing model misses under load. The times themselves come from the
               router's live performance model (`router.placement.live_profile`), the one
               placement asks, already corrected by every request's own report
    plan     ─ planner.plan(observed workload, corrections) → n_prefill, n_decode; a backlog
               term (in-flight decode requests / planned batch; queued prefill tokens that
               the TTFT SLO must clear) can only raise the target
    act      ─ grow at once (spawn, wait until ready, add to the backend); shrink one actor
               after `scale_down_after` consecutive ticks that want fewer: drain it (no new
               requests, in-flight ones finish), then kill it. No request is lost.

Before any request finished, the configured workload is the observation (the plan's start point).

With ``routing.role_flips: auto`` and fixed pool counts, the act step flips roles instead: the plan's
unrounded needs (raised by the backlog) go to `deploy.role_balance.RoleBalancer`, and a flip it calls
for is run by the pool manager (`PoolManager.flip`) on the least busy actor of the role that gives one up.
With ``routing.mode: auto`` as well, decode actors prefill the prompts placed local, so only the share of
prompt tokens that *needed* a prefill actor (`Placement.needs_prefill_actor`, over the window:
Dispatcher.recent_placements) counts as prefill-actor work, the rest as decode-actor work; the prefill pool
may go to zero (every actor decodes and prefills its own prompts, the colocated layout) and comes back when
prompts need it again.
"""
from __future__ import annotations

import asyncio
import logging
import math
import statistics
import time
from dataclasses import dataclass, field

from deploy.planner import SLO, Corrections, Plan, Workload, inputs_from_config, p99_ttft, plan
from engine.performance import PerformanceModel
from deploy.pool_manager import Flip, drain_actor
from deploy.role_balance import TO_PREFILL, BalanceSettings, RoleBalancer, SplitDecision

log = logging.getLogger(f"pdserve.{__name__}")


@dataclass(slots=True)
class AutoscaleSettings:
    interval_s: float = 10.0            # control-loop period
    window_s: float = 60.0              # observations older than this are forgotten
    scale_down_after: int = 3           # consecutive ticks that want fewer actors before one is removed
    drain_timeout_s: float = 300.0      # longest wait for a draining actor's in-flight requests
    correction_bounds: tuple[float, float] = (0.5, 4.0)
    smoothing: float = 0.5              # EMA weight of the newest correction
    profile: dict | None = None         # the performance model's profile (None: the config's cached one, else
                                        # measured on the first actors; deploy.performance)


@dataclass(slots=True)
class Observation:
    workload: Workload
    num_finished: int
    ttft_s: float | None                # p90 of the window (None: no data)
    tpot_s: float | None                # mean of the window
    decode_in_flight: int
    prefill_queued_tokens: int
    remote_share: float | None = None   # mode auto: prompt tokens that needed a prefill actor / all placed


@dataclass(slots=True)
class Decision:
    time: float
    observation: Observation
    plan: Plan
    corrections: Corrections
    targets: dict[str, int]
    sizes: dict[str, int] = field(default_factory=dict)
    split: SplitDecision | None = None   # routing.role_flips auto: the balancer's view of this tick
    flip: Flip | None = None             # ... and the flip it made


class Autoscaler:
    def __init__(self, cfg, backend, factory, model: PerformanceModel, settings: AutoscaleSettings | None = None,
                 manager=None, balancer: RoleBalancer | None = None):
        """model: the performance model the autoscaler plans with (the router's live model, which placement
        asks too); manager: the `PoolManager` that runs role flips (routing.role_flips auto, fixed counts)."""
        self.cfg, self.backend, self.factory, self.model = cfg, backend, factory, model
        self.settings = settings or AutoscaleSettings()
        self.pools = [name for name, p in cfg.pools.items() if p.is_auto and name in ("prefill", "decode")]
        self.manager = manager
        flips = cfg.routing.role_flips == "auto" and manager is not None and not self.pools
        self.auto_placement = cfg.routing.mode == "auto"      # decode actors prefill too: no prefill actor needed
        balance = BalanceSettings(min_prefill=0 if self.auto_placement else 1)
        self.balancer = (balancer or RoleBalancer(balance)) if flips else None
        self.corrections = Corrections()
        self.history: list[Decision] = []
        self._want_fewer: dict[str, int] = {}
        self._started = time.monotonic()
        self._last_lengths: tuple[float, float] | None = None

    # ---- loop -----------------------------------------------------------
    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.settings.interval_s)
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception:                # never let the control loop die
                log.exception("autoscaler tick failed")

    async def tick(self) -> Decision:
        obs = self.observe(time.monotonic())
        kv_blocks = min((v.kv_blocks_total for v in self.backend.views("decode")), default=1)
        _, slo, limits = inputs_from_config(self.cfg, kv_blocks)
        self.corrections = self._correct(obs, slo)
        result = plan(self.model, obs.workload, slo, limits, self.corrections)
        targets = self.targets(result, obs, slo)
        decision = Decision(time.monotonic(), obs, result, self.corrections, targets)
        for name in self.pools:
            await self._scale(name, targets[name])
        if self.balancer is not None:
            decision.split, decision.flip = await self._balance(result, obs, slo)
        decision.sizes = {name: len(self.backend.views(name)) for name in ("prefill", "decode")}
        self.history.append(decision)
        del self.history[:-1000]
        return decision

    # ---- observe / correct / plan ---------------------------------------
    def observe(self, now: float) -> Observation:
        window = self.settings.window_s
        recent = self.backend.recent_finished(window, now)
        span = max(min(window, now - self._started), self.settings.interval_s, 1e-3)
        w = self.cfg.workload
        if recent:
            self._last_lengths = (statistics.fmean(r.num_prompt_tokens for r in recent),
                                  statistics.fmean(r.num_output_tokens for r in recent))
        if self._last_lengths is None and not self.backend.recent_finished(math.inf, now):
            workload = Workload(w.input_tokens_mean, w.output_tokens_mean, w.arrival_rate_rps)   # the prior
        else:
            s_in, s_out = self._last_lengths or (w.input_tokens_mean, w.output_tokens_mean)
            workload = Workload(s_in, max(s_out, 1.0), max(len(recent) / span, 1e-6))
        ttfts = sorted(r.ttft_s for r in recent)
        tpots = [r.tpot_s for r in recent if r.num_output_tokens > 1]
        decode_in_flight = sum(v.running for v in self.backend.views("decode")) + self.backend.num_waiting
        queued = sum(v.queued_tokens for v in self.backend.views("prefill"))
        return Observation(workload, len(recent), ttfts[int(0.9 * (len(ttfts) - 1))] if ttfts else None,
                           statistics.fmean(tpots) if tpots else None, decode_in_flight, queued,
                           self._remote_share(now) if self.auto_placement else None)

    def _remote_share(self, now: float) -> float | None:
        """Of the prompt tokens placed in the window, the share that needed a prefill actor (None: none placed)."""
        placed = self.backend.recent_placements(self.settings.window_s, now)
        total = sum(p.num_prompt_tokens for p in placed)
        return sum(p.num_prompt_tokens for p in placed if p.needs_prefill_actor) / total if total else None

    def _correct(self, obs: Observation, slo: SLO) -> Corrections:
        """measured / predicted at the current pool sizes, smoothed and clamped."""
        lo, hi = self.settings.correction_bounds
        a = self.settings.smoothing
        ttft, tpot = self.corrections.ttft, self.corrections.tpot
        w = obs.workload
        if obs.ttft_s is not None:
            t_p = self.model.prefill_seconds(w.input_tokens)
            n = max(len(self.backend.views("prefill")), 1)
            util = min(w.arrival_rate_rps * t_p / n, 0.95)
            predicted = p99_ttft(t_p, util)
            ttft = (1 - a) * ttft + a * min(max(obs.ttft_s / predicted, lo), hi)
        if obs.tpot_s is not None:
            n = max(len(self.backend.views("decode")), 1)
            concurrency = max(w.arrival_rate_rps * w.output_tokens * obs.tpot_s / n, 1.0)
            predicted = self.model.token_seconds(concurrency, w.input_tokens + w.output_tokens / 2)
            tpot = (1 - a) * tpot + a * min(max(obs.tpot_s / predicted, lo), hi)
        return Corrections(ttft, tpot)

    def targets(self, result: Plan, obs: Observation, slo: SLO) -> dict[str, int]:
        """Plan counts, raised by what the in-flight backlog needs, within each pool's bounds."""
        decode_backlog = math.ceil(obs.decode_in_flight / max(result.decode["batch"], 1))
        clear_rate = result.prefill["capacity_tokens_per_s"] * slo.ttft_s
        prefill_backlog = math.ceil(obs.prefill_queued_tokens / clear_rate) if clear_rate > 0 else 0
        out = {}
        for name, planned, backlog in (("prefill", result.n_prefill, prefill_backlog),
                                       ("decode", result.n_decode, decode_backlog)):
            lo, hi = getattr(self.cfg.pools, name).bounds()
            out[name] = min(max(planned, backlog, lo), hi)
        return out

    def needs(self, result: Plan, obs: Observation, slo: SLO) -> tuple[float, float]:
        """Actors each role needs (unrounded): the plan's, raised by what the in-flight backlog needs. In mode
        auto the prompts that did not need a prefill actor are decode actors' work (prefilled local)."""
        need_prefill, need_decode = result.needed_prefill, result.needed_decode
        if obs.remote_share is not None:
            need_prefill, need_decode = (need_prefill * obs.remote_share,
                                         need_decode + need_prefill * (1.0 - obs.remote_share))
        decode_backlog = obs.decode_in_flight / max(result.decode["batch"], 1)
        clear_rate = result.prefill["capacity_tokens_per_s"] * slo.ttft_s
        prefill_backlog = obs.prefill_queued_tokens / clear_rate if clear_rate > 0 else 0.0
        return max(need_prefill, prefill_backlog), max(need_decode, decode_backlog)

    async def _balance(self, result: Plan, obs: Observation, slo: SLO) -> tuple[SplitDecision, Flip | None]:
        """At a fixed actor count: flip one actor when the balancer calls for another split."""
        prefill, decode = self.backend.views("prefill"), self.backend.views("decode")
        need_prefill, need_decode = self.needs(result, obs, slo)
        split = self.balancer.decide(need_prefill, need_decode, len(prefill), len(decode))
        if split.flip is None:
            return split, None
        if split.flip == TO_PREFILL:
            open_ = [v for v in decode if v.accepting]
            actor, role = min(open_, key=lambda v: v.running, default=None), "prefill"
        else:
            open_ = [v for v in prefill if v.accepting]
            actor, role = min(open_, key=lambda v: v.queued_tokens, default=None), "decode"
        if actor is None:
            return split, None
        log.info("autoscaler: load calls for %.2f of %d actors prefilling (needs: prefill %.2f, decode %.2f); "
                 "flipping %s to %s", split.ideal_prefill, len(prefill) + len(decode), need_prefill,
                 need_decode, actor.actor_id, role)
        try:
            return split, await self.manager.flip(actor.actor_id, role, self.settings.drain_timeout_s)
        except (ValueError, RuntimeError, KeyError) as e:
            log.warning("autoscaler: flip of %s to %s refused: %s", actor.actor_id, role, e)
            return split, None

    # ---- act ------------------------------------------------------------
    async def _scale(self, name: str, target: int) -> None:
        current = len(self.backend.views(name))
        if target > current:
            self._want_fewer[name] = 0
            await self.grow(name, target - current)
        elif target < current:
            self._want_fewer[name] = self._want_fewer.get(name, 0) + 1
            if self._want_fewer[name] >= self.settings.scale_down_after:
                self._want_fewer[name] = 0
                await self.shrink(name)
        else:
            self._want_fewer[name] = 0

    async def grow(self, name: str, count: int) -> None:
        handles = [(name, self.factory.spawn(name)) for _ in range(count)]
        views = await self.factory.views(handles)
        await self.backend.add_actors(name, views)
        log.info("autoscaler: %s pool grew by %d to %d (%s)", name, count, len(self.backend.views(name)),
                 ", ".join(v.actor_id for v in views))

    async def shrink(self, name: str) -> bool:
        """Drain the least busy actor (its in-flight requests finish), then kill it."""
        pool = [v for v in self.backend.views(name) if not v.draining]
        lo, _ = getattr(self.cfg.pools, name).bounds()
        if len(pool) <= lo:
            return False
        load = (lambda v: v.queued_tokens) if name == "prefill" else (lambda v: v.running)
        view = min(pool, key=load)
        drained = await drain_actor(self.backend, name, view, self.settings.drain_timeout_s)
        if not drained:
            log.warning("autoscaler: %s actor %s still busy after %.0fs; killing it anyway", name,
                        view.actor_id, self.settings.drain_timeout_s)
        await self.factory.retire(view)
        log.info("autoscaler: %s pool shrank to %d (removed %s)", name, len(self.backend.views(name)),
                 view.actor_id)
        return drained


async def start_autoscaler(cfg, backend, factory, settings: AutoscaleSettings | None = None,
                           manager=None) -> Autoscaler:
    """The autoscaler over `backend`, planning with the router's live performance model (`deploy.performance`
    built it on the measured profile)."""
    return Autoscaler(cfg, backend, factory, backend.live, settings or AutoscaleSettings(), manager)
