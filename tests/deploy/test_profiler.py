"""The profile as the planner reads it: interpolation between measured points, saturated prefill."""
from __future__ import annotations

import json

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

    from deploy.profiler import load_profile
    engine = {"costs": COSTS.to_dict()}
    good = {"version": 1, "prefill": {"engine": engine, "points": [{"prompt_len": 128, "batch": 1, "seconds": 0.09}]},
            "decode": {"engine": engine, "points": [{"batch": 1, "context": 128, "seconds": 0.013,
                                                     "bytes_per_s": 7e8}]},
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


def _valid_profile() -> dict:
    """A profile as `pdserve profile` writes it: prefill and decode at degree 1 and 2, a speculative section
    with its acceptance, a link measurement."""
    from profile_support import with_degree, with_speculation
    profile = with_speculation(with_degree(synthetic(), 2), lambda b, c: 0.02 + 0.001 * b, acceptance=0.6)
    profile["transfer"] = {"transport": "tcp", "codec": "none", "kv_bytes": 1 << 20, "wire_bytes": 1 << 20,
                           "seconds": 0.002, "kv_bytes_per_s": (1 << 20) / 0.002}
    return json.loads(json.dumps(profile))          # as read from the file: no section shared with another


def _single(points: list[dict]) -> list[dict]:
    return [dict(points[0]), dict(points[0]), *points[1:]]


@pytest.mark.parametrize("mend, said", [
    (lambda p: p["prefill"]["engine"].update(costs={}), "prefill.engine.costs.num_layers must be a positive integer, "
                                                          "missing"),
    (lambda p: p["decode"]["engine"]["costs"].update(kv_bytes_per_token="2048"),
     "decode.engine.costs.kv_bytes_per_token must be a positive integer, got '2048'"),
    (lambda p: p["decode"]["engine"]["costs"].update(num_layers=4.0), "decode.engine.costs.num_layers must be a "
                                                                        "positive integer, got 4.0"),
    (lambda p: p["degrees"]["2"]["decode"]["engine"].update(costs={"num_layers": -1}),
     "degrees.2.decode.engine.costs.num_layers must be a positive integer, got -1"),
    (lambda p: p["prefill"].update(points=[{"prompt_len": 128, "batch": 8, "seconds": 0.1}]),
     "prefill.points: no single-prompt point (batch 1)"),
    (lambda p: p["degrees"]["2"]["prefill"]["points"][1].update(prompt_len=0),
     "degrees.2.prefill.points[1].prompt_len must be a finite number above 0, got 0"),
    (lambda p: p["decode"].update(points=_single(p["decode"]["points"])),
     "decode.points[1]: batch 1, context 128 measured twice (also decode.points[0])"),
    (lambda p: p["decode"]["points"][2].pop("bytes_per_s"), "decode.points[2].bytes_per_s must be a finite number"),
    (lambda p: p["decode"]["points"][0].update(context=float("nan")), "decode.points[0].context must be a finite"),
    (lambda p: p.update(degrees=[2]), "degrees must be a mapping of tensor-parallel degree to pools"),
    (lambda p: p.update(degrees={"two": {}}), "degrees.two must be a tensor-parallel degree above 1"),
    (lambda p: p.update(degrees={"02": {}}), "degrees.02 must be a tensor-parallel degree above 1"),
    (lambda p: p.update(degrees={"1": {}}), "degrees.1 must be a tensor-parallel degree above 1"),
    (lambda p: p["degrees"]["2"].update(router={}), "degrees.2.router: a pool is prefill or decode"),
    (lambda p: p.update(transfer={"wire_bytes": "x", "seconds": "y"}),
     "transfer.wire_bytes must be a finite number at least 0, got 'x'"),
    (lambda p: p["transfer"].update(wire_bytes=-1), "transfer.wire_bytes must be a finite number at least 0, got -1"),
    (lambda p: p["transfer"].update(seconds=0), "transfer.seconds must be a finite number above 0, got 0"),
    (lambda p: p["transfer"].update(kv_bytes_per_s=float("inf")), "transfer.kv_bytes_per_s must be a finite number"),
    (lambda p: p.update(speculative=[1]), "speculative must be a mapping"),
    (lambda p: p["speculative"].update(points=5), "speculative.points must be a list"),
    (lambda p: p["speculative"].update(method=1), "speculative.method must be a method name, got 1"),
    (lambda p: p["speculative"].update(num_tokens="4"), "speculative.num_tokens must be a positive integer, got '4'"),
    (lambda p: p["speculative"]["points"][1].update(num_tokens=0),
     "speculative.points[1].num_tokens must be a positive integer, got 0"),
    (lambda p: p["speculative"]["points"][1].update(seconds="x"), "speculative.points[1].seconds must be a finite"),
    (lambda p: p["speculative"].update(points=_single(p["speculative"]["points"])),
     "speculative.points[1]: num_tokens 4, batch 1, context 128 measured twice (also speculative.points[0])"),
    (lambda p: p["speculative"].update(acceptance="x"), "speculative.acceptance must be a mapping or null"),
    (lambda p: p["speculative"]["acceptance"].update(ratio="x"), "speculative.acceptance.ratio must be a finite"),
    (lambda p: p["speculative"]["acceptance"].update(ratio=1.7),
     "speculative.acceptance.ratio must be at most 1 (accepted / proposed tokens), got 1.7"),
    (lambda p: p["speculative"]["acceptance"].update(ratio=1.7, num_tokens=2), "speculative.acceptance.ratio must be "
                                                                              "at most 1"),
    (lambda p: p["speculative"]["acceptance"].update(ratio=-0.1), "speculative.acceptance.ratio must be a finite "
                                                                  "number at least 0, got -0.1"),
    (lambda p: p["speculative"]["acceptance"].update(num_tokens=True),
     "speculative.acceptance.num_tokens must be a positive integer, got True"),
])
def test_a_profile_section_of_the_wrong_type_sign_or_order_is_refused_naming_the_key(mend, said, tmp_path):
    from deploy.profiler import load_profile
    path = tmp_path / "profile.json"
    profile = _valid_profile()
    mend(profile)
    path.write_text(json.dumps(profile))
    with pytest.raises(ValueError) as refused:
        load_profile(str(path))
    assert str(refused.value).startswith(f"{path}: {said}")


def test_a_valid_profile_loads_and_an_unmeasured_acceptance_or_link_is_kept(tmp_path):
    from deploy.profiler import load_profile
    path = tmp_path / "profile.json"
    for mend in (lambda p: None, lambda p: p["speculative"]["acceptance"].update(ratio=None),
                 lambda p: p.update(transfer={"transport": "nixl", "codec": "none", "error": "RuntimeError: no NIC"}),
                 lambda p: p["transfer"].update(wire_bytes=0)):
        profile = _valid_profile()
        mend(profile)
        path.write_text(json.dumps(profile))
        assert load_profile(str(path)) == profile
        Profile(profile).decode_step_seconds(8, 256)


def test_a_prefill_length_measured_twice_keeps_the_faster_time(tmp_path):
    """`pdserve profile` measures the saturated step at the workload's length, one prompt where the token budget
    takes one: the same length twice. Two such points, first or last, load and interpolate."""
    from deploy.profiler import load_profile
    path = tmp_path / "profile.json"
    for where in (0, -1):
        profile = _valid_profile()
        points = profile["prefill"]["points"]
        twice = {**points[where], "seconds": points[where]["seconds"] * 1.5}
        points.insert(len(points) if where else 0, twice)
        path.write_text(json.dumps(profile))
        model = Profile(load_profile(str(path)))
        for length in (64, 128, 700, 2048, 4096):
            assert model.prefill_seconds(length) == pytest.approx(COSTS.prefill_flops(length) / 1e10)


def test_simulate_refuses_a_malformed_profile_with_exit_2(tmp_path, capsys):
    from bench.simulate import cli
    path = tmp_path / "profile.json"
    profile = _valid_profile()
    profile["prefill"]["engine"]["costs"] = {}
    path.write_text(json.dumps(profile))
    assert cli.main(["--jobs", "1", "--profile", str(path), "--workload", "chat", "--num-requests", "4"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"error: {path}: prefill.engine.costs.num_layers must be a positive integer, missing"
