"""The simulator runs pdserve's own autoscaler (bench/simulate/sim_control.py): role flips and pool growth
on the virtual clock, every request finished and every KV block returned after them, the same flips for one seed."""
from __future__ import annotations

import pytest
from sim_support import keep_built_cluster

from bench.serving.workloads import make_workload
from bench.simulate.hardware import Hardware
from bench.simulate.models import model_config
from bench.simulate.roofline import RooflineModel
from bench.simulate.run import simulate
from deploy.autoscaler import AutoscaleSettings
from deploy.config import load_config

SHAPE = model_config("llama-3-8b")
PHASES = make_workload("phases", 300, seed=0)          # 100 chat, 100 rag, 100 chat


def roofline() -> RooflineModel:
    return RooflineModel(Hardware.load("H100-SXM"), SHAPE, model_name="llama-3-8b")


def run_keeping_cluster(monkeypatch, overrides: dict, specs, rate: float, seed: int = 0):
    """One simulated run of `specs`, and the simulated cluster it ran on (to look inside its actors after)."""
    held = keep_built_cluster(monkeypatch)
    cfg = load_config(None, overrides)
    run = simulate(cfg, roofline(), SHAPE, specs, rate=rate, seed=seed, slo_ttft_s=1.0, slo_tpot_s=0.1,
                   autoscale=AutoscaleSettings(interval_s=1.0, window_s=10.0), actor_start_s=5.0)
    return run, held["cluster"]


def assert_all_finished_nothing_held(run, cluster, specs) -> None:
    assert len(run.records) == len(specs)
    assert all(r.ok for r in run.records), [r.error for r in run.records if not r.ok][:3]
    assert [r.num_output_tokens for r in run.records] == [s.output_len for s in specs]
    for actor in cluster.actors:                        # retired actors too
        assert actor.engine.block_manager.num_used_blocks == 0, actor.actor_id
        assert not actor.engine.requests, actor.actor_id


FLIPS = {"pools.prefill.count": 2, "pools.decode.count": 2, "routing.role_flips": "auto"}


@pytest.fixture(scope="module")
def phases_runs():
    """The phases workload through 2P + 2D with role flips auto, twice with one seed."""
    with pytest.MonkeyPatch.context() as mp:
        return [run_keeping_cluster(mp, FLIPS, PHASES, rate=20.0) for _ in range(2)]


def test_role_flips_follow_the_phases(phases_runs):
    run, cluster = phases_runs[0]
    moves = [(f["from_role"], f["to_role"]) for f in run.flips]
    assert moves, "no role flip on chat -> rag -> chat"
    assert ("decode", "prefill") in moves and ("prefill", "decode") in moves      # rag wants prefill, chat decode
    roles = [a.role for a in cluster.actors]
    assert len(roles) == 4 and roles.count("decode") >= 1                         # flips move actors, add none
    sampled = [s["prefill"] + s["decode"] for s in run.roles]
    assert sampled and all(n <= 4 for n in sampled)


def test_every_request_finishes_and_no_block_is_left_after_flips(phases_runs):
    for run, cluster in phases_runs:
        assert_all_finished_nothing_held(run, cluster, PHASES)


def test_same_seed_same_flips(phases_runs):
    (a, _), (b, _) = phases_runs
    assert a.flips == b.flips
    assert a.roles == b.roles
    assert [(r.request_id, round(r.ttft_s, 9), round(r.e2e_s, 9)) for r in a.records] == \
        [(r.request_id, round(r.ttft_s, 9), round(r.e2e_s, 9)) for r in b.records]


def test_count_auto_adds_decode_actors_under_load_and_frees_every_block(monkeypatch):
    specs = make_workload("chat", 200, seed=0, scale=0.5)
    overrides = {"pools.prefill.count": 1, "pools.decode.count": "auto", "pools.decode.min": 1,
                 "pools.decode.max": 4, "pools.decode.max_batch_size": 8}
    run, cluster = run_keeping_cluster(monkeypatch, overrides, specs, rate=60.0)
    decode = [a for a in cluster.actors if a.actor_id.startswith("decode-")]
    assert len(decode) > 1, "the autoscaler added no decode actor"
    assert max(s["decode"] for s in run.roles) > 1
    assert_all_finished_nothing_held(run, cluster, specs)
