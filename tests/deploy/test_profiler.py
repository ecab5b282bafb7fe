"""The profile as the planner reads it: interpolation between measured points, saturated prefill."""
from __future__ import annotations

import pytest
from profile_support import COSTS, synthetic

from deploy.planner import SLO, Limits, Workload, plan
from engine.performance import MeasuredPerformance as Profile

LIMITS = Limits(decode_kv_blocks=100_000, block_size=16, max_batch_size=256)


def test_interpolation_reproduces_measured_points():
    p = Profile(synthetic())
    assert p.decode_step_seconds(16, 1024) == pytest.approx(0.01 + 0.016 + 1e-6 * 16 * 1024)
    assert p.decode_step_seconds(10, 1024) == pytest.approx(0.01 + 0.010 + 1e-6 * 10 * 1024)   # between points
    assert p.decode_step_seconds(10, 1536) == pytest.approx(0.01 + 0.010 + 1e-6 * 10 * 1536)   # between contexts
    assert p.prefill_seconds(700) == pytest.approx(COSTS.prefill_flops(700) / 1e10)


def test_saturated_prefill_sets_capacity():
    data = synthetic()
    t_single = COSTS.prefill_flops(512) / 1e10
    data["prefill"]["points"].append({"prompt_len": 512, "batch": 8, "seconds": 4 * t_single,
                                      "flops": 8 * COSTS.prefill_flops(512), "flops_per_s": 2e10})
    p = Profile(data)
    assert p.prefill_seconds(512) == pytest.approx(t_single)                  # TTFT side: one prompt
    assert p.prefill_capacity(512) == pytest.approx(8 * 512 / (4 * t_single))  # throughput side: the batch
    result = plan(p, Workload(512, 128, 4.0), SLO(3.0, 0.05), LIMITS)
    assert result.prefill["capacity_tokens_per_s"] == pytest.approx(2 * 512 / t_single)


POINTS = {"prefill": [{"kind": "prefill", "prompt_len": 24, "batch": 1, "repeats": 1},
                      {"kind": "prefill", "prompt_len": 48, "batch": 1, "repeats": 1}],
          "decode": [{"kind": "decode", "batch": b, "context": 32, "repeats": 1} for b in (1, 2)]}


def test_profile_local_measures_each_tensor_parallel_degree(tiny_model_dir):
    """Degree 2 on CPU: rank 0 here and a follower process (gloo); its points go under "degrees" and the
    planner's DegreeModel takes them instead of the prediction."""
    from deploy.config import load_config
    from deploy.planner import AllReduce, DegreeModel
    from deploy.profiler import profile_local
    cfg = load_config(None, {"model.name": tiny_model_dir, "model.dtype": "float32", "kv_cache.num_blocks": 64,
                             "pools.prefill.resources.torch_threads": 1, "pools.decode.resources.torch_threads": 1})
    data = profile_local(cfg, POINTS, progress=False, degrees=(1, 2))
    at2 = data["degrees"]["2"]
    for pool, keys in (("prefill", ("prompt_len", "batch")), ("decode", ("batch", "context"))):
        assert [tuple(p[k] for k in keys) for p in at2[pool]["points"]] == \
            [tuple(p[k] for k in keys) for p in data[pool]["points"]]
        assert all(p["seconds"] > 0 for p in at2[pool]["points"])
    p = Profile(data)
    assert p.degrees("prefill") == p.degrees("decode") == [1, 2]
    m = DegreeModel(p, 2, 2, {2: AllReduce(1.0, 1.0)})          # a prediction would add seconds of all-reduce
    alone = Profile({**data, "prefill": at2["prefill"], "decode": at2["decode"]})
    longest = max(at2["prefill"]["points"], key=lambda q: q["prompt_len"])
    assert m.prefill_seconds(48) == pytest.approx(longest["seconds"]) == alone.prefill_seconds(48)
    assert m.decode_step_seconds(2, 32) == pytest.approx(alone.decode_step_seconds(2, 32))
    assert m.decode_step_seconds(2, 32) < 1.0 < m.collective_seconds(2, 2)


def test_profile_tp_without_degree_one_is_refused(tiny_model_dir, capsys):
    from deploy.cli import main
    assert main(["profile", "--model", tiny_model_dir, "--local", "--tp", "2"]) == 2
    assert "--tp 2: tensor-parallel degrees must be positive and include 1" in capsys.readouterr().err


def test_plan_points_measure_the_speculative_step_and_acceptance_only_with_speculation(tiny_model_dir):
    from deploy.config import load_config
    from deploy.profiler import plan_points
    base = {"model.name": tiny_model_dir, "kv_cache.num_blocks": 256}
    off = plan_points(load_config(None, base), tiny_model_dir, quick=True)
    assert "speculative" not in off
    on = plan_points(load_config(None, {**base, "speculative.method": "ngram", "speculative.num_tokens": 3}),
                     tiny_model_dir, quick=True)
    assert on["decode"] == off["decode"] and on["prefill"] == off["prefill"]
    *steps, acceptance = on["speculative"]
    assert acceptance == {"kind": "acceptance", "num_tokens": 3}
    assert {p["num_tokens"] for p in steps} == {1, 3}                    # at k, and what verifying at all costs
    assert all({k: v for k, v in p.items() if k != "num_tokens"} in off["decode"] for p in steps)


def test_profile_local_writes_the_speculative_steps_and_acceptance_the_model_reads(tmp_path):
    """With speculation on, the profile gains the decode points at k proposals per sequence (the plain points
    stay plain) and the acceptance on the model's held-out text; the model interpolates the steps, the
    config's speculation takes the acceptance, and the file round-trips."""
    from deploy.config import load_config
    from deploy.performance import speculation_of
    from deploy.profiler import load_profile, profile_local, save_profile
    from engine.model.presets import resolve_model
    from engine.performance import Speculation
    cfg = load_config(None, {"model.name": "pydoc", "model.dtype": "float32", "kv_cache.num_blocks": 64,
                             "speculative.method": "ngram", "speculative.num_tokens": 2,
                             "pools.prefill.resources.torch_threads": 1, "pools.decode.resources.torch_threads": 1})
    points = {**POINTS, "speculative": [{**p, "num_tokens": 2} for p in POINTS["decode"]]
              + [{"kind": "acceptance", "num_tokens": 2}]}
    data = load_profile(save_profile(profile_local(cfg, points, progress=False), str(tmp_path / "p.json")))
    spec = data["speculative"]
    assert (spec["method"], spec["num_tokens"], spec["adaptive"]) == ("ngram", 2, True)
    assert [(p["batch"], p["context"], p["num_tokens"], p["num_proposed"]) for p in spec["points"]] == \
        [(1, 32, 2, 2 * 1 * 2), (2, 32, 2, 2 * 2 * 2)]            # 2 steps (1 untimed) × batch × k
    assert [(p["batch"], p["num_proposed"]) for p in data["decode"]["points"]] == [(1, 0), (2, 0)]
    acceptance = spec["acceptance"]
    assert acceptance["num_tokens"] == 2 and acceptance["proposed"] > 0 and acceptance["prompts"] == 8
    assert acceptance["ratio"] == acceptance["accepted"] / acceptance["proposed"]
    assert speculation_of(cfg, resolve_model("pydoc"), data).acceptance == acceptance["ratio"]
    model = Profile(data, Speculation("ngram", 2, acceptance=0.5, adaptive=False))
    plain, verify = data["decode"]["points"][1]["seconds"], spec["points"][1]["seconds"]
    assert model.spec_step_seconds(2, 32, 2) == pytest.approx(max(verify, plain))
    assert model.token_seconds(2, 32) == pytest.approx(max(verify, plain) / 2.0)       # 1 + 2 · 0.5 tokens


def test_a_malformed_profile_is_refused_naming_the_key(tmp_path):
    import copy
    import json

    from deploy.profiler import load_profile
    good = {"version": 1, "prefill": {"engine": {"costs": {}}, "points": [{"prompt_len": 128, "batch": 1,
                                                                          "seconds": 0.09}]},
            "decode": {"engine": {"costs": {}}, "points": [{"batch": 1, "context": 128, "seconds": 0.013}]},
            "calibration": {"prefill": 1.02, "handoff_s": 0.0, "send_s_per_mb": 0.0,
                            "send_curve": [[0.3, 0.015], [3.1, 0.09]], "shared_prefill": 1.4}}
    path = tmp_path / "p.json"

    def load(mend) -> str:
        profile = copy.deepcopy(good)
        mend(profile)
        path.write_text(json.dumps(profile))
        with pytest.raises(ValueError) as refused:
            load_profile(str(path))
        return str(refused.value)

    path.write_text(json.dumps(good))
    assert load_profile(str(path)) == good
    assert "no prefill measurements" in load(lambda p: p.update(prefill=5))
    assert "decode.engine.costs is missing" in load(lambda p: p["decode"].pop("engine"))
    assert "prefill.points[0].seconds must be a finite number above 0, got -1" in load(
        lambda p: p["prefill"]["points"][0].update(seconds=-1))
    assert "decode.points[0].batch" in load(lambda p: p["decode"]["points"][0].pop("batch"))
    assert "calibration.decode must be a finite number above 0, got 'x'" in load(
        lambda p: p["calibration"].update(decode="x"))
    assert "calibration.handoff_s must be a finite number at least 0, got -5" in load(
        lambda p: p["calibration"].update(handoff_s=-5))
    assert "calibration.send_s_per_mb must be a finite number at least 0" in load(
        lambda p: p["calibration"].update(send_s_per_mb=-0.1))
    assert "calibration.send_curve must be a list of [wire MB, seconds] pairs" in load(
        lambda p: p["calibration"].update(send_curve=[0.3, 0.015]))
    assert "calibration.send_curve[1][1] must be a finite number at least 0, got -1" in load(
        lambda p: p["calibration"]["send_curve"][1].__setitem__(1, -1))
    assert "send_curve: the wire MB must increase (3.1 then 0.3)" in load(
        lambda p: p["calibration"].update(send_curve=[[3.1, 0.09], [0.3, 0.015]]))
    assert "calibration.shared_prefill must be a finite number above 0, got 0" in load(
        lambda p: p["calibration"].update(shared_prefill=0))
    assert "transfer must be a mapping" in load(lambda p: p.update(transfer=[1]))
