"""The control loops over a simulated cluster: pdserve's own autoscaler, role balancer and pool manager.

`deploy.autoscaler.Autoscaler` (with `deploy.role_balance.RoleBalancer`) and `deploy.pool_manager.PoolManager.flip`
run unchanged; `SimFactory` is the deploy factory's face they use — spawn, views, flippable, set_role,
retire — over simulated actors. A new actor takes `start_s` simulated seconds to come up (the weights'
load: `deploy.launcher.ActorFactory.views` waits for the same), a flip drains the actor as a real one does.
"""
from __future__ import annotations

import asyncio

from bench.simulate.sim_cluster import SimActor, SimCluster
from deploy.autoscaler import Autoscaler, AutoscaleSettings
from deploy.pool_manager import PoolManager

ACTOR_START_S = 30.0          # default: a new actor's weights load and warm-up before it serves


class SimFactory:
    def __init__(self, cluster: SimCluster, start_s: float = ACTOR_START_S):
        self.cluster, self.start_s = cluster, start_s
        self.model_dir = cluster.cfg.model.name

    def flippable(self, pool: str) -> bool:
        return self.cluster.flippable(pool)

    def spawn(self, pool: str) -> SimActor:
        return self.cluster.new_actor(pool)

    async def views(self, spawned: list[tuple[str, SimActor]]) -> list:
        await asyncio.sleep(self.start_s)
        for _, actor in spawned:
            actor.start()
        return [self.cluster.view_of(pool, actor) for pool, actor in spawned]

    async def set_role(self, view, pool: str, role: str, timeout_s: float) -> tuple[object, dict]:
        actor = self.cluster.actor(view.actor_id)
        handed_off = await actor.set_role(role, timeout_s)
        return self.cluster.view_of(pool, actor), {"actor_id": actor.actor_id, "handed_off": handed_off}

    async def retire(self, view) -> None:
        actor = self.cluster.actor(view.actor_id)
        actor.stop()
        actor.retired = True


def wants_autoscaler(cluster: SimCluster) -> bool:
    """As `deploy.running.start_cluster`: a pool with `count: auto`, or role flips auto, in disaggregated mode."""
    cfg = cluster.cfg
    return cluster.mode == "disaggregated" and (any(p.is_auto for _, p in cfg.pools.items())
                                                or cfg.routing.role_flips == "auto")


def start_autoscaler(cluster: SimCluster, settings: AutoscaleSettings, start_s: float = ACTOR_START_S) -> Autoscaler:
    """The autoscaler over `cluster`, planning with its router's live performance model (as
    `deploy.autoscaler.start_autoscaler`), its loop started on the running (virtual) event loop."""
    cfg, d = cluster.cfg, cluster.dispatcher
    factory = SimFactory(cluster, start_s)
    manager = PoolManager(d, factory)
    scaler = Autoscaler(cfg, d, factory, d.live, settings, manager)
    scaler.task = asyncio.get_running_loop().create_task(scaler.run())
    return scaler
