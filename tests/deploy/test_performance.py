"""One performance model per cluster: the planner's times, the autoscaler's and auto placement's are the same
object's answers (`engine.performance`, `deploy.performance`, `router.placement.live_profile`)."""
from __future__ import annotations

import asyncio
import time

import pytest
from profile_support import synthetic, with_speculation

from deploy.autoscaler import AutoscaleSettings, start_autoscaler
from deploy.config import load_config
from deploy.performance import base_model, live_model
from deploy.planner import SLO, Limits, Workload, plan
from engine.model.config import ModelConfig
from engine.model.presets import resolve_model
from engine.performance import LinearPerformance, MeasuredPerformance, Speculation
from router.dispatcher import Dispatcher, FinishedRequest
from router.pools import DecodeView, Pools, PrefillView
from router.routing import RoutingSettings

LIMITS = Limits(decode_kv_blocks=100_000, block_size=16, max_batch_size=256)


def config(**overrides):
    pools = {f"pools.{name}.{key}": value for name in ("prefill", "decode")
             for key, value in (("count", "auto"), ("min", 1), ("max", 1))}
    return load_config(None, {"model.name": "tiny", **pools, "slo.ttft_p99_ms": 2000, "slo.tpot_p99_ms": 100,
                              **overrides})


def test_base_model_is_the_profile_else_generic_figures_with_the_models_kv_size():
    cfg = config()
    model_dir = resolve_model("tiny")
    measured = base_model(cfg, model_dir, synthetic())
    assert isinstance(measured, MeasuredPerformance) and measured.measured is measured
    generic = base_model(cfg, model_dir, None)
    assert isinstance(generic, LinearPerformance) and generic.measured is None
    assert generic.kv_bytes_per_token == ModelConfig.from_dir(model_dir).kv_bytes_per_token(4)     # float32 on CPU
    with pytest.raises(ValueError, match="measured profile"):
        plan(live_model(cfg, generic), Workload(512, 64, 1.0), SLO(1.0, 0.1), LIMITS)


def test_calibration_is_inside_every_answer():
    data = synthetic()
    plain = MeasuredPerformance(data)
    data["calibration"] = {"prefill": 2.0, "decode": 1.5}
    calibrated = MeasuredPerformance(data)
    assert calibrated.prefill_seconds(700) == pytest.approx(2.0 * plain.prefill_seconds(700))
    assert calibrated.prefill_capacity(700) == pytest.approx(plain.prefill_capacity(700) / 2.0)
    assert calibrated.decode_step_seconds(10, 1536) == pytest.approx(1.5 * plain.decode_step_seconds(10, 1536))


def test_the_light_phase_predicts_and_calibrates_the_speculative_token_time():
    """With speculative decoding a lone request's TPOT is the step over the tokens it yields; the gap the
    light phase measures per token becomes a fixed cost per step, and the calibrated model then predicts
    exactly the measured TPOT."""
    from bench.serving.plan_check import fixed_costs, light_predictions
    spec = Speculation("ngram", 4, acceptance=0.5, adaptive=False)
    data = with_speculation(synthetic(), lambda b, c: 0.012 + 0.001 * b)
    before = light_predictions(MeasuredPerformance(data, spec), 512, 32, 0.5)
    assert before["tokens_per_step"] == pytest.approx(3.0)              # 1 + 4 · 0.5
    assert before["tpot_s"] == pytest.approx(MeasuredPerformance(data, spec).token_seconds(1, 528))
    measured = {"tpot_s": before["tpot_s"] + 0.002, "ttft_s": before["ttft_s"]}
    data["calibration"] = fixed_costs({}, [(before, measured)])
    assert data["calibration"]["step_s"] == pytest.approx(0.006)       # 2 ms a token, 3 tokens a step
    after = light_predictions(MeasuredPerformance(data, spec), 512, 32, 0.5)
    assert after["tpot_s"] == pytest.approx(measured["tpot_s"])


def flat(calibration: dict) -> dict:
    """A calibration with its send curve's numbers under keys of their own (pytest.approx compares flat maps)."""
    out = {k: v for k, v in calibration.items() if k != "send_curve"}
    for i, (mb, seconds) in enumerate(calibration.get("send_curve", [])):
        out[f"send_curve_{i}_mb"], out[f"send_curve_{i}_s"] = mb, seconds
    return out


def test_fixed_costs_from_a_light_load_close_the_gap_they_measured():
    """plan_check's light phase: what one lone request measured beyond the profile becomes `step_s` and, with
    no timeline stages to split it, the send's time on the prefill actor (`send_curve`, one point at this
    length: a constant); the calibrated profile then predicts exactly what was measured
    (the simulator's step and send prices include them), and a measurement below the prediction never makes
    a cost negative."""
    from bench.serving.plan_check import fixed_costs, light_predictions
    from bench.simulate.measured import MeasuredModel
    from bench.simulate.step_time import Chunk
    data = synthetic()
    data["calibration"] = {"decode": 1.2}
    plain = MeasuredPerformance(data)
    before = light_predictions(plain, 512, 32, 0.5)
    measured = {"tpot_s": before["tpot_s"] + 0.004, "ttft_s": before["ttft_s"] + 0.030}
    data["calibration"] = fixed_costs(data["calibration"], [(before, measured)])
    mb = round(before["wire_bytes"] / 1e6, 6)
    assert flat(data["calibration"]) == pytest.approx(flat({"decode": 1.2, "step_s": 0.004, "send_curve": [[mb, 0.03]],
                                                           "handoff_s": 0.0}))   # (no stages: on the prefill actor)
    calibrated = MeasuredPerformance(data)
    after = light_predictions(calibrated, 512, 32, 0.5)
    assert after["tpot_s"] == pytest.approx(measured["tpot_s"]) and after["ttft_s"] == pytest.approx(measured["ttft_s"])
    assert calibrated.decode_step_seconds(8, 900) == pytest.approx(plain.decode_step_seconds(8, 900) + 0.004)
    sim, sim_plain = MeasuredModel(calibrated), MeasuredModel(plain)
    assert sim.send_busy_s(1e6) == pytest.approx(sim_plain.send_busy_s(1e6) + 0.03)
    prefill_only = [Chunk(256, 256)]
    assert sim.step_s(prefill_only) == pytest.approx(sim_plain.step_s(prefill_only) + 0.004)
    mixed = [Chunk(1, 700), Chunk(64, 300)]
    assert sim.step_s(mixed) == pytest.approx(sim_plain.step_s(mixed) + 0.004)     # once a step
    faster = {"tpot_s": after["tpot_s"] - 0.010, "ttft_s": after["ttft_s"] - 0.010}
    assert flat(fixed_costs(data["calibration"], [(after, faster)])) == pytest.approx(
        flat({"decode": 1.2, "step_s": 0.0, "send_curve": [[mb, 0.02]], "handoff_s": 0.0}))
    older = {"decode": 1.2, "send_s": 0.01, "send_s_per_mb": 0.02}      # a line from an older calibration
    folded = fixed_costs(older, [(light_predictions(MeasuredPerformance({**data, "calibration": older}), 512, 32, 0.5),
                                  measured)])
    assert "send_s" not in folded and "send_s_per_mb" not in folded
    assert flat(folded)["send_curve_0_s"] == pytest.approx(0.03)         # what was measured, the line folded in


def test_a_run_that_moves_the_factors_prices_its_fixed_costs_with_them():
    """Saturation and light phases in one run: the light phase's gaps are taken against the profile with the
    new time factors, so the calibrated profile predicts the lone request as measured (not the decode factor's
    share twice)."""
    from bench.serving.plan_check import calibrate, light_predictions
    data = synthetic()

    def predict(profile, n):
        return light_predictions(MeasuredPerformance(profile), n, 32, 0.5)
    plain = predict(data, 512)
    measured = {"prompt_tokens": 512, "tpot_s": 1.4 * plain["tpot_s"], "ttft_s": plain["ttft_s"]}
    cal = calibrate(data, {"decode": 1.3}, [measured], predict)
    assert cal["decode"] == pytest.approx(1.3)
    assert cal["step_s"] == pytest.approx(0.1 * plain["tpot_s"])       # what the factor leaves, not 0.4×
    after = predict({**data, "calibration": cal}, 512)
    assert after["tpot_s"] == pytest.approx(measured["tpot_s"]) and after["ttft_s"] == pytest.approx(plain["ttft_s"])
    assert calibrate(data, {"prefill": 2.0}, [], None) == {"prefill": 2.0}


def test_the_shared_phase_measures_how_much_the_actors_slow_each_other():
    """plan_check's shared phase: the prefill actor's stages with the decode actor busy ÷ the same alone, by
    length, averaged; the background's time per token rises only while the prefill actor computes, so its
    rise over that share of the window is the decode step's slow-down. Neither goes below 1. Over several
    rounds the calibration keeps each factor's median."""
    from bench.serving.plan_check import shared_factors, shared_median
    light = [{"prompt_tokens": 48, "prefill_actor_s": 0.050}, {"prompt_tokens": 512, "prefill_actor_s": 0.400}]
    loaded = {48: [0.070, 0.070], 512: [0.520, 0.520]}                   # 1.4× and 1.3×
    out = shared_factors(light, loaded, tpot_alone=0.016, tpot_shared=0.0196, window_s=2.7)   # busy 2/3 of it
    assert out["prefill_factors"] == pytest.approx({48: 1.4, 512: 1.3})
    assert out["prefill_busy_share"] == pytest.approx(2 * (0.070 + 0.520) / 2.7)
    assert out["shared_prefill"] == pytest.approx(1.35)
    assert out["shared_decode"] == pytest.approx(1.0 + 0.225 / out["prefill_busy_share"])
    faster = shared_factors(light, {48: [0.040], 512: [0.390]}, tpot_alone=0.016, tpot_shared=0.015, window_s=1.0)
    assert faster["shared_prefill"] == 1.0 and faster["shared_decode"] == 1.0
    rounds = [{"shared_prefill": p, "shared_decode": d} for p, d in ((1.31, 1.45), (1.21, 1.55), (1.20, 1.50))]
    median = shared_median(rounds)
    assert (median["shared_prefill"], median["shared_decode"], median["rounds"]) == (1.21, 1.50, rounds)


def test_the_light_phase_books_each_gap_where_the_timeline_puts_it():
    """Light phases at several prompt lengths: the prefill actor's stages beyond the profile, growing with the
    KV shipped, become `send_curve` (the simulator lengthens the sending step by it); the
    rest of the TTFT gap becomes `handoff_s` (the link). The calibrated profile then predicts each length's
    TTFT and prefill-actor time. A gap shrinking with the prompt, or one below zero, never makes a send take
    less time for more bytes or less than nothing."""
    from bench.serving.plan_check import fixed_costs, light_lengths, light_predictions
    from bench.simulate.measured import MeasuredModel
    data = synthetic()
    plain = MeasuredPerformance(data)

    def light(actor_gap, rest=0.004):
        points = []
        for n in (48, 512, 1024):
            p = light_predictions(plain, n, 32, 0.25)
            gap = actor_gap(p["wire_bytes"] / 1e6)
            points.append((p, {"tpot_s": p["tpot_s"], "prompt_tokens": n, "prefill_actor_s": p["prefill_actor_s"] + gap,
                               "ttft_s": p["ttft_s"] + gap + rest}))
        return points

    points = light(lambda mb: 0.020 + 0.030 * mb)                      # 20 ms + 30 ms a wire MB, 4 ms on the link
    data["calibration"] = fixed_costs({}, points)
    mbs = [round(p["wire_bytes"] / 1e6, 6) for p, _ in points]
    assert flat(data["calibration"]) == pytest.approx(flat({"step_s": 0.0, "handoff_s": 0.004,
                                                           "send_curve": [[x, 0.020 + 0.030 * x] for x in mbs]}))
    calibrated = MeasuredPerformance(data)
    for _, measured in points:
        after = light_predictions(calibrated, measured["prompt_tokens"], 32, 0.25)
        assert after["ttft_s"] == pytest.approx(measured["ttft_s"])
        assert after["prefill_actor_s"] == pytest.approx(measured["prefill_actor_s"])
    sim, sim_plain = MeasuredModel(calibrated), MeasuredModel(plain)
    assert sim.link_s(2e6) - sim_plain.link_s(2e6) == pytest.approx(0.004)
    between, beyond = (mbs[0] + mbs[1]) / 2, 2 * mbs[-1]               # piecewise-linear, the last slope beyond
    for x in (between, beyond):
        assert (sim.send_busy_s(x * 1e6), sim_plain.send_busy_s(x * 1e6)) == pytest.approx((0.020 + 0.030 * x, 0.0))
    assert sim.send_busy_s(mbs[0] * 1e5) == pytest.approx(0.020 + 0.030 * mbs[0])     # below: the first point's
    shrinking = MeasuredPerformance({**data, "calibration": fixed_costs({}, light(lambda mb: 0.050 - 0.010 * mb))})
    sends = [shrinking.send_seconds(x * 1e6) for x in (0.0, *mbs, beyond)]
    assert sends == sorted(sends) and min(sends) > 0.0                 # never less time for more bytes
    crossing = fixed_costs({}, light(lambda mb: -0.010 + 0.030 * mb))
    assert crossing["send_curve"][0][1] == 0.0 and all(y >= 0.0 for _, y in crossing["send_curve"])
    assert light_lengths(48, 2016) == (48, 192, 480)
    assert light_lengths(384, 2016) == (384, 1536, 2016)             # none past the context


def test_the_autoscaler_and_placement_ask_the_same_live_model():
    cfg = config()
    live = live_model(cfg, MeasuredPerformance(synthetic()))
    pools = Pools([PrefillView("prefill-0", None, 512)], [DecodeView("decode-0", None, "kv://decode-0", 512)])
    backend = Dispatcher(pools, tokenizer=None, max_model_len=4096, block_size=16, routing=RoutingSettings(),
                         live=live)
    scaler = asyncio.run(start_autoscaler(cfg, backend, None, AutoscaleSettings()))
    assert scaler.model is backend.live is backend.placer.live
    before = asyncio.run(scaler.tick()).plan.decode["step_s"]
    for _ in range(30):                   # serving reports every step 20 ms slower than the profile
        live.finished(4, live.base.decode_step_seconds(4, 544) + 0.02, 64, context=544)
    now = time.monotonic()
    backend.finished.extend(FinishedRequest(now - i, 512, 64, 0.5, 0.05) for i in range(10))
    decision = asyncio.run(scaler.tick())
    batch, context = decision.plan.decode["batch"], 512 + 64 / 2
    assert decision.plan.decode["step_s"] == pytest.approx(
        live.decode_step_seconds(batch, context) * decision.corrections.tpot)
    assert live.decode_profile(512, context).step_s(batch) == pytest.approx(live.decode_step_seconds(batch, context))
    assert decision.plan.decode["step_s"] > before


def test_the_models_speculation_comes_from_the_config_and_the_profiles_acceptance():
    from deploy.performance import measured_acceptance, speculation_of
    from engine.cost_model import ModelCosts
    from engine.performance import Speculation
    from engine.spec.tokens_per_step import acceptance_ratio, per_token_acceptance
    from profile_support import with_speculation
    model_dir = resolve_model("tiny")
    profile = with_speculation(synthetic(), lambda b, c: 0.012 + 0.001 * b, num_tokens=4, acceptance=0.5)
    assert base_model(config(), model_dir, profile).speculation is None           # speculation off
    ngram = config(**{"speculative.method": "ngram", "speculative.num_tokens": 4})
    assert base_model(ngram, model_dir, profile).speculation == Speculation("ngram", 4, 0.5, True, 0.0)
    assert base_model(ngram, model_dir, synthetic()).speculation.acceptance == 0.0     # an older profile
    assert base_model(ngram, model_dir, None).speculation == Speculation("ngram", 4)   # the generic figures
    assert live_model(ngram, base_model(ngram, model_dir, profile)).speculation.acceptance == 0.5
    assert speculation_of(ngram, model_dir, profile, acceptance=0.8).acceptance == 0.8    # given beats measured
    # measured at k 4, asked at k 2: the same per-token rate
    assert measured_acceptance(profile, "ngram", 2) == pytest.approx(acceptance_ratio(per_token_acceptance(0.5, 4), 2))
    assert measured_acceptance(profile, "draft", 4) is None                      # another method's
    draft = config(**{"model.name": "pydoc", "speculative.method": "draft", "speculative.draft.model": "pydoc-draft"})
    spec = speculation_of(draft, resolve_model("pydoc"))

    def weights(name: str) -> int:
        return ModelCosts.of(ModelConfig.from_dir(resolve_model(name)), 4).weight_bytes
    assert spec.draft_cost == pytest.approx(weights("pydoc-draft") / weights("pydoc")) and 0 < spec.draft_cost < 0.5


def test_the_autoscaler_plans_decode_at_the_acceptance_the_decode_actors_report():
    from profile_support import with_speculation
    cfg = config(**{"speculative.method": "ngram", "speculative.num_tokens": 4})
    profile = with_speculation(synthetic(), lambda b, c: 0.012 + 0.0012 * b + 1e-6 * b * c, acceptance=0.2)
    live = live_model(cfg, base_model(cfg, resolve_model("tiny"), profile))
    pools = Pools([PrefillView("prefill-0", None, 512)], [DecodeView("decode-0", None, "kv://decode-0", 512)])
    backend = Dispatcher(pools, tokenizer=None, max_model_len=4096, block_size=16, routing=RoutingSettings(),
                         live=live)
    scaler = asyncio.run(start_autoscaler(cfg, backend, None, AutoscaleSettings()))
    before = asyncio.run(scaler.tick()).plan.decode
    assert before["speculation"]["acceptance"] == 0.2
    for _ in range(5):                  # requests that accepted 80 of 100 proposals, as fast as modelled
        live.finished(4, live.base.token_seconds(4, 544, 0.8), 64, context=544, actor_id="decode-0",
                      spec_proposed=100, spec_accepted=80)
    after = asyncio.run(scaler.tick()).plan.decode
    assert after["speculation"]["acceptance"] == pytest.approx(0.8)
    assert after["tokens_per_s_per_actor"] > before["tokens_per_s_per_actor"]
