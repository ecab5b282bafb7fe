"""The simulator at tensor-parallel degrees per pool: each actor timed at its pool's degree, mixed-degree
clusters, the split sweep over (TP_p, n_p, TP_d, n_d) and the errors for degrees that cannot be."""
from __future__ import annotations


import json

import pytest
from sim_support import keep_built_cluster

from bench.serving.workloads import make_workload
from bench.simulate import cli
from bench.simulate.hardware import Hardware
from bench.simulate.measured import MeasuredModel
from bench.simulate.models import model_config
from bench.simulate.plan_profile import profile_of
from bench.simulate.roofline import RooflineModel
from bench.simulate.run import simulate
from bench.simulate.sim_cluster import build_cluster
from bench.simulate.clock import run_virtual
from bench.simulate.step_time import Chunk
from deploy.config import ConfigError, load_config
from engine.model.config import ModelConfig
from engine.model.presets import resolve_model
from engine.performance import MeasuredPerformance

H100 = Hardware.load("H100-SXM")
SHAPE = model_config("llama-3-8b")


def roofline(tp: int = 1) -> RooflineModel:
    return RooflineModel(H100, SHAPE, tensor_parallel=tp, model_name="llama-3-8b")


def cluster_of(overrides: dict, mode: str = "disaggregated"):
    async def build():
        return build_cluster(load_config(None, overrides), roofline(), SHAPE, mode)
    return run_virtual(build())


def test_a_decode_actor_at_degree_2_takes_the_degree_2_step_time_and_holds_its_blocks():
    cluster = cluster_of({"pools.decode.tensor_parallel": 2})
    prefill, decode = (next(a for a in cluster.actors if a.actor_id.startswith(p)) for p in ("prefill", "decode"))
    one, two = roofline(1), roofline(2)
    batch = [Chunk(1, 1500)] * 16
    assert decode.engine.runner.model.step_s(batch) == pytest.approx(two.step_s(batch))
    assert two.step_s(batch) < one.step_s(batch)                       # the degree does change the time
    assert prefill.engine.runner.model.step_s([Chunk(2048, 2048)]) == pytest.approx(one.step_s([Chunk(2048, 2048)]))
    block_size = cluster.cfg.kv_cache.block_size
    assert decode.engine.block_manager.num_blocks == two.kv_blocks(block_size) > one.kv_blocks(block_size)
    # the handoff: prefill's 1 NIC binds against decode's 2
    assert cluster.models.link.link_s(1e9) == pytest.approx(one.link_s(1e9))


def test_a_long_context_actor_runs_at_its_own_pools_degree():
    cluster = cluster_of({"pools.long_context.count": 1, "pools.long_context.tensor_parallel": 4,
                          "routing.long_request_tokens": 1000})
    long_context = next(a for a in cluster.actors if a.actor_id.startswith("long_context"))
    decode = next(a for a in cluster.actors if a.actor_id.startswith("decode"))
    assert long_context.engine.runner.model.tensor_parallel == 4 and decode.engine.runner.model.tensor_parallel == 1
    assert cluster.models.degrees == {"prefill": 1, "decode": 1, "long_context": 4}


def test_colocated_actors_run_at_the_decode_pools_degree():
    cluster = cluster_of({"pools.prefill.tensor_parallel": 4, "pools.decode.tensor_parallel": 2}, "colocated")
    assert cluster.models.degrees == {"prefill": 2, "decode": 2}
    assert all(a.engine.runner.model.tensor_parallel == 2 for a in cluster.actors)


def test_a_mixed_degree_cluster_completes_every_request_and_returns_every_block(monkeypatch):
    held = keep_built_cluster(monkeypatch)
    specs = make_workload("chat", 40, seed=0, scale=0.5)
    cfg = load_config(None, {"pools.prefill.tensor_parallel": 2, "pools.decode.tensor_parallel": 1,
                             "pools.decode.count": 2})
    run = simulate(cfg, roofline(), SHAPE, specs, rate=20.0, slo_ttft_s=1.0, slo_tpot_s=0.1)
    cluster = held["cluster"]
    assert cluster.models.prefill.tensor_parallel == 2 and cluster.models.decode.tensor_parallel == 1
    assert len(run.records) == len(specs)
    assert all(r.ok for r in run.records), [r.error for r in run.records if not r.ok][:3]
    assert [r.num_output_tokens for r in run.records] == [s.output_len for s in specs]
    for actor in cluster.actors:
        assert actor.engine.block_manager.num_used_blocks == 0, actor.actor_id
        assert not actor.engine.requests, actor.actor_id


def test_a_degree_that_does_not_split_the_heads_is_an_error_naming_the_key(capsys):
    with pytest.raises(ValueError, match=r"pools\.decode\.tensor_parallel 3 does not divide the model's 32"):
        cluster_of({"pools.decode.tensor_parallel": 3})
    assert cli.main(["--hardware", "H100-SXM", "--model", "llama-3-8b", "--num-requests", "4", "--rate", "1",
                     "--set", "pools.prefill.tensor_parallel=3"]) == 2
    assert "pools.prefill.tensor_parallel 3" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"pools\.decode\.tensor_parallel 2: tensor-parallel actors do not change"):
        cluster_of({"pools.decode.tensor_parallel": 2, "routing.role_flips": "manual"})


def test_a_measured_profile_times_a_degree_from_its_points_and_refuses_one_it_lacks():
    """Points at degree 2 (as `pdserve profile --tp 1,2` writes them; here from the roofline) time a decode
    actor at 2; without them the degree is refused, naming the key."""
    with_two = MeasuredModel(MeasuredPerformance(profile_of(roofline(), SHAPE, (128, 1500), (2,))))
    batch = [Chunk(1, 1500)] * 16
    assert with_two.at_degree("decode", 2).step_s(batch) == pytest.approx(roofline(2).step_s(batch), rel=1e-6)
    assert with_two.at_degree("decode", 1).step_s(batch) == pytest.approx(roofline(1).step_s(batch), rel=1e-6)
    only_one = MeasuredModel(MeasuredPerformance(profile_of(roofline(), SHAPE, (128, 1500))), "measured: p")
    with pytest.raises(ValueError, match=r"pools\.decode\.tensor_parallel 2: the profile measured decode at "
                                         r"tensor-parallel degree 1 only; run `pdserve profile --tp 1,2`"):
        only_one.at_degree("decode", 2)


def test_the_split_sweep_over_degrees_stays_in_the_budget_and_names_a_best_and_the_plan(tmp_path, capsys):
    out = tmp_path / "split.json"
    assert cli.main(["--hardware", "H100-SXM", "--model", "llama-3-8b", "--workload", "rag", "--num-requests", "24",
                     "--sweep", "split", "--devices", "4", "--tp", "1,2", "--top", "0", "--sweep-values", "4,24",
                     "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    expected = {(a, n_p, b, n_d) for a in (1, 2) for b in (1, 2) for n_p in range(1, 4) for n_d in range(1, 4)
                if a * n_p + b * n_d <= 4}
    splits = {k: c for k, c in result["candidates"].items() if c["kind"] == "split"}
    simulated = {(c["prefill_degree"], c["n_prefill"], c["decode_degree"], c["n_decode"]) for c in splits.values()}
    assert len(simulated) + len(result["not_simulated"]) == len(expected) and simulated <= expected
    assert any(a != b for a, _, b, _ in simulated), "no mixed-degree candidate ran"
    for label, c in result["candidates"].items():
        assert c["devices"] <= 4
        assert c["per_device"] == pytest.approx(c["max_rate_rps"] / c["devices"])
        # the rates offered to all 4 devices, in proportion to the candidate's
        assert [p["x"] for p in result["points"][label]] == pytest.approx([1 * c["devices"], 6 * c["devices"]])
    colocated = {k: c for k, c in result["candidates"].items() if c["kind"] == "colocated"}
    assert sorted((c["decode_degree"], c["n_decode"]) for c in colocated.values()) == [(1, 4), (2, 2)]
    best = result["candidates"][result["best"]]
    assert best["per_device"] == max(c["per_device"] for c in result["candidates"].values() if not c["below_lowest"])
    printed = capsys.readouterr().out
    assert f"best: {result['best']}" in printed
    assert "pdserve plan --devices 4 --tp 1,2: " in printed and result["plan"] in printed
    assert "@tp" in result["plan"]                      # the planner chose a split within the budget


def test_a_sweep_where_nothing_holds_the_lowest_rate_names_no_best(tmp_path, capsys):
    """llama-3-70b at degree 2 leaves each H100 about 1 GB for KV: no candidate holds 2 req/s per device."""
    out = tmp_path / "split.json"
    assert cli.main(["--hardware", "H100-SXM", "--model", "llama-3-70b", "--workload", "chat", "--num-requests", "16",
                     "--sweep", "split", "--devices", "4", "--tp", "1,2", "--sweep-values", "8",
                     "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["best"] is None and result["degrees"] == [2]       # degree 1 does not fit: left out
    assert all(c["below_lowest"] for c in result["candidates"].values())
    captured = capsys.readouterr()
    assert "best: none held 90% attainment at the lowest rate" in captured.out
    assert "leaving out degree 1" in captured.err and "do not fit" in captured.err


def test_tensor_parallel_flag_sets_every_pool_and_refuses_a_conflicting_set(capsys):
    args = cli.build_parser().parse_args(["--tensor-parallel", "2"])
    cfg = cli.variant_config(args, "disaggregated")
    assert (cfg.pools.prefill.tensor_parallel, cfg.pools.decode.tensor_parallel) == (2, 2)
    assert cli.main(["--hardware", "H100-SXM", "--model", "llama-3-8b", "--tensor-parallel", "2",
                     "--set", "pools.decode.tensor_parallel=1"]) == 2
    assert "--tensor-parallel 2 sets every pool's degree; --set pools.decode.tensor_parallel" in capsys.readouterr().err


def test_the_split_sweep_leaves_out_a_degree_a_measured_profile_lacks(tmp_path, capsys):
    """A profile with decode points at degree 2 but none for prefill: the sweep runs degree 1 only, and says why."""
    own = ModelConfig.from_dir(resolve_model(load_config(None).model.name))   # the config's model, which it times
    profile = profile_of(RooflineModel(H100, own), own, (128, 256), (2,))
    del profile["degrees"]["2"]["prefill"]
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile))
    out = tmp_path / "split.json"
    assert cli.main(["--profile", str(path), "--workload", "chat", "--scale", "0.5", "--num-requests", "8",
                     "--sweep", "split", "--devices", "2", "--tp", "1,2", "--sweep-values", "2",
                     "--json", str(out)]) == 0
    assert json.loads(out.read_text())["degrees"] == [1]
    assert "leaving out degree 2: pools.prefill.tensor_parallel 2: the profile measured prefill" in \
        capsys.readouterr().err
