"""The autoscaler grows and shrinks a tensor-parallel pool by whole rank groups, on local Ray with the
launcher's real `ActorFactory` (placement groups, one Ray actor per rank) but engine-less stand-in actors:
growing a `tensor_parallel: 2` decode pool by one places both ranks in one placement group; shrinking it
retires rank 0, rank 1 and the placement group together."""
from __future__ import annotations

import asyncio
import time

import pytest
import ray
from ray.util import placement_group_table

import deploy.actor
import deploy.rank_actor
from deploy.autoscaler import Autoscaler, AutoscaleSettings
from deploy.config import load_config
from deploy.launcher import ActorFactory
from engine.performance import MeasuredPerformance as Profile
from profile_support import synthetic
from router.dispatcher import Dispatcher
from router.pools import Pools
from router.routing import RoutingSettings


def _stand_ins():
    """Serving and rank actors that build no engine; defined here so Ray ships them by value."""

    class ServingStandIn:
        def __init__(self, args, actor_id, role, ranks=(), **_):
            self.args, self.actor_id, self.ranks = args, actor_id, list(ranks)

        def info(self) -> dict:
            return {"actor_id": self.actor_id, "kv_blocks_total": 64, "endpoint": f"kv://{self.actor_id}",
                    "stream_endpoint": f"stream://{self.actor_id}", "layout": {
                        "tensor_parallel": self.args.tensor_parallel, "rank": self.args.tensor_parallel_rank},
                    "incarnation": 0,
                    "placement_group": ray.get_runtime_context().get_placement_group_id()}

    class RankStandIn:
        def __init__(self, args, actor_id):
            self.args, self.actor_id = args, actor_id

        def follow(self) -> None:
            return None

        def where(self) -> tuple[int, str | None]:
            return self.args.tensor_parallel_rank, ray.get_runtime_context().get_placement_group_id()

    return ServingStandIn, RankStandIn


def _dead(handle) -> bool:
    try:
        ray.get(handle.__ray_ready__.remote(), timeout=10)
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        return True
    return False


def _wait(condition, timeout: float = 30.0) -> bool:
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            return False
        time.sleep(0.1)
    return True


@pytest.fixture
def stand_ins(monkeypatch):
    serving, rank = _stand_ins()
    monkeypatch.setattr(deploy.actor, "log_named", lambda role: serving)
    monkeypatch.setattr(deploy.rank_actor, "RankActor", rank)


def test_autoscaler_adds_and_retires_whole_rank_groups(ray_local, tiny_model_dir, stand_ins):
    cfg = load_config(None, {
        "model.name": tiny_model_dir, "routing.role_flips": "off",
        "pools.prefill.count": 1, "pools.decode.count": "auto", "pools.decode.min": 1, "pools.decode.max": 2,
        "pools.decode.tensor_parallel": 2, "pools.decode.resources.num_cpus": 0.25,
        "pools.prefill.resources.num_cpus": 0.25, "kv_transfer.transport": "grpc"})
    factory = ActorFactory(cfg, "t")
    backend = Dispatcher(Pools([], []), tokenizer=None, max_model_len=1024, block_size=16,
                         routing=RoutingSettings())
    scaler = Autoscaler(cfg, backend, factory, Profile(synthetic(flops_per_s=2e10)),
                        AutoscaleSettings(interval_s=1.0, window_s=60.0, drain_timeout_s=5.0))

    async def grow(count: int):
        await scaler.grow("decode", count)

    asyncio.run(grow(2))
    views = backend.views("decode")
    assert len(views) == 2 and set(factory.rank_groups) == {v.actor_id for v in views}
    groups = {}
    for view in views:
        info = ray.get(view.client.handle.info.remote())
        group, ranks = factory.rank_groups[view.actor_id]
        assert len(ranks) == 1                              # degree 2: rank 0 serves, one follower
        rank, where = ray.get(ranks[0][0].where.remote())
        assert rank == 1 and info["layout"] == {"tensor_parallel": 2, "rank": 0}
        assert where == info["placement_group"] == group.id.hex()     # both ranks in the group's bundles
        assert placement_group_table(group)["strategy"] == "STRICT_PACK"
        assert len(placement_group_table(group)["bundles"]) == 2
        groups[view.actor_id] = (group, view.client.handle, ranks[0][0])
    assert len({g.id.hex() for g, _, _ in groups.values()}) == 2      # one group per actor

    assert asyncio.run(scaler.shrink("decode"))
    (left,) = backend.views("decode")
    (gone,) = set(groups) - {left.actor_id}
    group, rank0, rank1 = groups[gone]
    assert set(factory.rank_groups) == {left.actor_id}
    assert _wait(lambda: _dead(rank0) and _dead(rank1))
    assert _wait(lambda: placement_group_table(group)["state"] == "REMOVED")
    kept, kept0, kept1 = groups[left.actor_id]               # the other group is untouched
    assert placement_group_table(kept)["state"] == "CREATED"
    assert not _dead(kept0) and not _dead(kept1)

    assert not asyncio.run(scaler.shrink("decode"))          # pools.decode.min 1: the last group stays
    for view in backend.views("decode"):
        asyncio.run(factory.retire(view))
    assert factory.rank_groups == {}
    assert _wait(lambda: placement_group_table(kept)["state"] == "REMOVED")
