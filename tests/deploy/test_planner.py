"""Planner (pure functions) on synthetic profiles with exact expectations."""
from __future__ import annotations

import math

import pytest
from profile_support import COSTS, synthetic, with_degree, with_speculation

from deploy.planner import SLO, Corrections, Limits, Workload, decode_batch, max_utilization, p99_ttft, plan
from engine.performance import MeasuredPerformance as Profile
from engine.performance import Speculation

LIMITS = Limits(decode_kv_blocks=100_000, block_size=16, max_batch_size=256)


def test_decode_batch_is_largest_meeting_tpot():
    p = Profile(synthetic(step=lambda b, c: 0.01 + 0.001 * b))
    assert decode_batch(p, 1000, 0.020, 10_000, 256) == (10, True)       # 0.01 + 0.001·10 = 0.020
    assert decode_batch(p, 1000, 0.020, 6, 256) == (6, True)             # KV budget binds
    assert decode_batch(p, 1000, 0.020, 10_000, 4) == (4, True)          # max_batch_size binds
    assert decode_batch(p, 1000, 0.005, 10_000, 256) == (1, False)       # unreachable: report B=1
    assert decode_batch(p, 1000, 0.020, 10_000, 256, tpot_correction=3.0) == (1, False)


def test_plan_numbers_follow_the_profile():
    p = Profile(synthetic(step=lambda b, c: 0.01 + 0.001 * b))
    w, slo = Workload(512, 128, 4.0), SLO(ttft_s=3.0, tpot_s=0.05)
    result = plan(p, w, slo, LIMITS)
    assert result.decode["batch"] == 40                                  # 0.01 + 0.04 = 0.05
    assert result.decode["tokens_per_s_per_actor"] == pytest.approx(40 / 0.05)
    assert result.needed_decode == pytest.approx(4 * 128 / (0.9 * 800))
    t_p = COSTS.prefill_flops(512) / 1e10
    util = result.prefill["utilization"]
    assert util > 0.5 and p99_ttft(t_p, util) == pytest.approx(3.0, rel=1e-6)   # the SLO binds the utilization
    assert result.needed_prefill == pytest.approx(4 * 512 / (util * 512 / t_p))
    assert result.n_prefill == math.ceil(result.needed_prefill) and result.n_decode == math.ceil(result.needed_decode)
    led = result.ledger
    assert led["kv_bytes_per_request"] == 640 * 4096
    assert led["decode_bytes_per_step"] == COSTS.decode_bytes(40, 576)
    assert led["machine_balance_flops_per_byte"] == pytest.approx(p.peak_flops_per_s / p.peak_bytes_per_s)


def test_prefill_heavy_workload_gets_higher_prefill_ratio():
    p = Profile(synthetic())
    slo = SLO(ttft_s=2.0, tpot_s=0.1)
    rag = plan(p, Workload(2000, 100, 2.0), slo, LIMITS)
    chat = plan(p, Workload(100, 500, 2.0), slo, LIMITS)
    assert rag.ratio > 5 * chat.ratio
    assert rag.n_prefill > chat.n_prefill and chat.n_decode > rag.n_decode


def test_bounds_clamp_and_explain():
    p = Profile(synthetic())
    limits = Limits(100_000, 16, 256, prefill_bounds=(1, 2), decode_bounds=(2, 3))
    result = plan(p, Workload(2000, 100, 50.0), SLO(2.0, 0.1), limits)
    assert result.n_prefill == 2 and result.needed_prefill > 2
    assert any("max is 2" in r for r in result.reasons)
    idle = plan(p, Workload(100, 10, 0.001), SLO(2.0, 0.1), limits)
    assert (idle.n_prefill, idle.n_decode) == (1, 2)


def test_unreachable_ttft_is_reported_and_sized_for_throughput():
    p = Profile(synthetic(flops_per_s=1e9))
    result = plan(p, Workload(2000, 100, 1.0), SLO(ttft_s=0.1, tpot_s=0.1), LIMITS)
    assert not result.prefill["ttft_slo_met"] and result.prefill["utilization"] == 0.5
    assert any("TTFT SLO unreachable" in r for r in result.reasons)
    tight = plan(Profile(synthetic()), Workload(512, 100, 1.0), SLO(ttft_s=0.35, tpot_s=0.1), LIMITS)
    assert tight.prefill["utilization"] == 0.5 and not tight.prefill["ttft_slo_met"]      # 0.31 s of 0.35 s
    assert any("not met at a useful load" in r for r in tight.reasons)


def test_corrections_scale_predictions():
    p = Profile(synthetic(step=lambda b, c: 0.01 + 0.001 * b))
    base = plan(p, Workload(512, 128, 4.0), SLO(1.0, 0.05), LIMITS)
    slower = plan(p, Workload(512, 128, 4.0), SLO(1.0, 0.05), LIMITS, Corrections(ttft=2.0, tpot=1.25))
    assert slower.decode["batch"] == 30                                  # 1.25·(0.01 + 0.001·30) = 0.05
    assert slower.prefill["seconds_per_request"] == pytest.approx(2 * base.prefill["seconds_per_request"])
    assert slower.needed_prefill > base.needed_prefill


def test_max_utilization_edges():
    assert max_utilization(2.0, 1.0) == 0.0
    assert max_utilization(0.001, 100.0) == pytest.approx(0.999)
    u = max_utilization(0.1, 0.5)
    assert p99_ttft(0.1, u) <= 0.5 < p99_ttft(0.1, u + 0.01)


def test_calibration_scales_like_corrections():
    data = synthetic(step=lambda b, c: 0.01 + 0.001 * b)
    base = plan(Profile(data), Workload(512, 128, 4.0), SLO(3.0, 0.05), LIMITS)
    data["calibration"] = {"prefill": 2.0, "decode": 1.25}
    calibrated = plan(Profile(data), Workload(512, 128, 4.0), SLO(3.0, 0.05), LIMITS)
    assert calibrated.decode["batch"] == 30                              # 1.25·(0.01 + 0.001·30) = 0.05
    assert calibrated.prefill["capacity_tokens_per_s"] == pytest.approx(base.prefill["capacity_tokens_per_s"] / 2)
    assert any("calibrated" in r for r in calibrated.reasons)


def test_tp_speedup_splits_compute_and_adds_the_collectives():
    from deploy.planner import tp_speedup
    assert tp_speedup(1.0, 2, 0.0) == 2.0               # compute alone: linear in the degree
    assert tp_speedup(1.0, 2, 0.5) == 1.0               # all-reduces as long as the saved half: no gain
    assert tp_speedup(0.8, 4, 0.05) == 0.8 / (0.2 + 0.05)


def test_degree_model_splits_compute_and_adds_two_all_reduces_per_layer():
    from deploy.planner import AllReduce, DegreeModel
    p = Profile(synthetic(step=lambda b, c: 0.01 + 0.001 * b))
    ar = {2: AllReduce(latency_s=1e-4, bytes_per_s=1e9)}
    m = DegreeModel(p, 2, 2, ar)
    collective = lambda tokens: 2 * COSTS.num_layers * (1e-4 + tokens * 256 * 4 / 1e9)     # noqa: E731
    assert m.prefill_seconds(512) == pytest.approx(p.prefill_seconds(512) / 2 + collective(512))
    assert m.decode_step_seconds(8, 500) == pytest.approx(p.decode_step_seconds(8, 500) / 2 + collective(8))
    assert m.prefill_capacity(512) == pytest.approx(
        p.prefill_capacity(512) * p.prefill_seconds(512) / m.prefill_seconds(512))
    assert DegreeModel(p, 1, 1, ar).decode_step_seconds(8, 500) == p.decode_step_seconds(8, 500)


def test_search_picks_the_most_goodput_per_device_meeting_both_slos():
    """At degree 1 the TTFT SLO leaves prefill under the least useful utilization: only prefill degree 2
    serves. The decode degree
    whose all-reduces cost more than they save loses to degree 1."""
    from deploy.planner import AllReduce, search_parallelism
    p = Profile(synthetic(step=lambda b, c: 0.01 + 0.001 * b))
    t_p = COSTS.prefill_flops(512) / 1e10
    w, slo = Workload(512, 128, 4.0), SLO(ttft_s=6 * t_p, tpot_s=0.05)   # degree 1: too little utilization
    ar = {2: AllReduce(latency_s=1e-3, bytes_per_s=1e9)}
    found = search_parallelism(p, w, slo, LIMITS, devices=8, degrees=[1, 2], allreduce=ar)
    assert found and all(c.prefill_degree == 2 for c in found)           # degree 1 cannot meet the TTFT SLO
    best, runner_up = found[0], found[1]
    assert best.devices <= 8 and best.n_prefill * 2 + best.n_decode * best.decode_degree == best.devices
    assert best.goodput_per_device >= runner_up.goodput_per_device
    for c in found:                                                      # the carried rate is the slower pool's
        per_p = c.plan.prefill["tokens_per_s_per_actor"] / 512
        per_d = c.plan.decode["utilization"] * c.plan.decode["tokens_per_s_per_actor"] / 128
        assert c.goodput_rps == pytest.approx(min(c.n_prefill * per_p, c.n_decode * per_d))
    assert best.decode_degree == 1       # 16 all-reduces of 1 ms per step outweigh half of a ~50 ms step


def test_degree_model_uses_the_points_measured_at_a_degree_and_predicts_the_others():
    from deploy.planner import AllReduce, DegreeModel
    step1, step2 = (lambda b, c: 0.01 + 0.001 * b), (lambda b, c: 0.004 + 0.0003 * b)
    p = Profile(with_degree(synthetic(step=step1), 2, flops_per_s=1.7e10, step=step2))
    ar = {2: AllReduce(1e-4, 1e9), 4: AllReduce(1e-4, 1e9)}
    m, predicted = DegreeModel(p, 2, 2, ar), DegreeModel(Profile(synthetic(step=step1)), 2, 2, ar)
    assert m.prefill_seconds(512) == pytest.approx(COSTS.prefill_flops(512) / 1.7e10)
    assert m.decode_step_seconds(8, 500) == pytest.approx(step2(8, 500))
    assert m.prefill_capacity(512) == pytest.approx(512 / m.prefill_seconds(512))
    assert predicted.prefill_seconds(512) != pytest.approx(m.prefill_seconds(512))
    assert predicted.decode_step_seconds(8, 500) != pytest.approx(m.decode_step_seconds(8, 500))
    at4 = DegreeModel(p, 4, 4, ar)                                       # degree 4 not measured: predicted
    assert at4.decode_step_seconds(8, 500) == pytest.approx(DegreeModel(Profile(synthetic(step=step1)), 4, 4, ar)
                                                            .decode_step_seconds(8, 500))
    only_decode = Profile(with_degree(synthetic(step=step1), 2, pools=("decode",), step=step2))
    assert only_decode.degrees("prefill") == [1] and only_decode.degrees("decode") == [1, 2]
    mixed = DegreeModel(only_decode, 2, 2, ar)
    assert mixed.prefill_seconds(512) == pytest.approx(predicted.prefill_seconds(512))
    assert mixed.decode_step_seconds(8, 500) == pytest.approx(step2(8, 500))


def test_search_plans_a_measured_degree_on_its_points():
    """Decode measured at degree 2 steps in 4 + 0.3·B ms: within a 50 ms TPOT its batch is 153, where the
    prediction (half of 10 + B ms plus 1 ms all-reduces per layer) allows far fewer."""
    from deploy.planner import AllReduce, search_parallelism
    step1, step2 = (lambda b, c: 0.01 + 0.001 * b), (lambda b, c: 0.004 + 0.0003 * b)
    t_p = COSTS.prefill_flops(512) / 1e10
    w, slo = Workload(512, 128, 4.0), SLO(ttft_s=6 * t_p, tpot_s=0.05)
    ar = {2: AllReduce(latency_s=1e-3, bytes_per_s=1e9)}
    measured = Profile(with_degree(synthetic(step=step1), 2, pools=("decode",), step=step2))
    found = search_parallelism(measured, w, slo, LIMITS, devices=8, degrees=[1, 2], allreduce=ar)
    predicted = search_parallelism(Profile(synthetic(step=step1)), w, slo, LIMITS, devices=8, degrees=[1, 2],
                                   allreduce=ar)
    tp2 = [c for c in found if c.decode_degree == 2]
    assert tp2 and all(c.plan.decode["batch"] == 153 for c in tp2)     # 0.004 + 0.0003·153 = 0.0499
    assert all(c.plan.decode["batch"] < 153 for c in predicted if c.decode_degree == 2)
    assert max(c.goodput_per_device for c in tp2) > max(c.goodput_per_device for c in predicted
                                                        if c.decode_degree == 2)


def test_a_handoff_between_degrees_moves_over_the_fewer_ranks_links():
    """Each rank sends (or receives) its own KV heads over its own link: the link bound of a degree pair is
    min(p, d) times one rank's, which a link-bound workload's carried rate follows."""
    from deploy.planner import AllReduce, Network, search_parallelism
    p = Profile(synthetic(step=lambda b, c: 0.01 + 0.001 * b))
    w = Workload(512, 128, 4.0)
    one_link = Network(COSTS.kv_bytes_per_token * 512 * 0.5, "test")    # 0.5 req/s through one rank's link
    found = search_parallelism(p, w, SLO(ttft_s=60.0, tpot_s=0.05), LIMITS, devices=8, degrees=[1, 2],
                               allreduce={2: AllReduce(1e-5, 1e10)}, network=one_link)
    bound = {(c.prefill_degree, c.decode_degree): c.plan.rate_bounds["link"] for c in found}
    assert bound[(1, 1)] == pytest.approx(0.5) and bound[(1, 2)] == pytest.approx(0.5)
    assert bound[(2, 1)] == pytest.approx(0.5) and bound[(2, 2)] == pytest.approx(1.0)
    assert all(c.goodput_rps <= bound[(c.prefill_degree, c.decode_degree)] + 1e-9 for c in found)
    assert max(c.goodput_rps for c in found if (c.prefill_degree, c.decode_degree) == (2, 2)) > 0.5


def test_search_finds_nothing_when_no_degree_meets_the_slo():
    from deploy.planner import AllReduce, search_parallelism
    p = Profile(synthetic(step=lambda b, c: 0.01 + 0.001 * b))
    slo = SLO(ttft_s=1e-6, tpot_s=0.05)
    assert search_parallelism(p, Workload(512, 128, 4.0), slo, LIMITS, 8, [1, 2],
                              {2: AllReduce(1e-5, 1e10)}) == []


def _plain(b, c):
    return 0.01 + 0.001 * b


def test_speculation_sizes_decode_at_its_acceptance_and_off_changes_nothing():
    """ngram, k 4 at acceptance 0.5: a step yields 1 + 4 · 0.5 = 3 tokens per sequence and verifying adds 0.8 ms
    per sequence, so (10 + 1.8 · B ms) / 3 meets the 50 ms TPOT up to B = 77, where plain steps allow 40."""
    data = with_speculation(synthetic(step=_plain), lambda b, c: 0.01 + 0.0018 * b)
    w, slo = Workload(512, 128, 20.0), SLO(3.0, 0.05)
    off = plan(Profile(data), w, slo, LIMITS)
    assert off.to_dict() == plan(Profile(synthetic(step=_plain)), w, slo, LIMITS).to_dict()
    assert (off.decode["batch"], off.n_decode, off.decode["speculation"]) == (40, 4, {})   # 2560 / (0.9 · 800)
    fixed = plan(Profile(data, Speculation("ngram", 4, acceptance=0.5, adaptive=False)), w, slo, LIMITS)
    token_s = (0.01 + 0.0018 * 77) / 3
    assert fixed.decode["batch"] == 77 and fixed.decode["token_s"] == pytest.approx(token_s)
    assert fixed.decode["tokens_per_s_per_actor"] == pytest.approx(77 / token_s)
    assert fixed.needed_decode == pytest.approx(20 * 128 / (0.9 * 77 / token_s)) and fixed.n_decode == 2
    assert fixed.decode["speculation"]["step_num_tokens"] == 4
    assert fixed.decode["step_s"] == pytest.approx(_plain(77, 0))      # the ledger keeps the plain step
    model = Profile(data, Speculation("ngram", 4, acceptance=0.5))
    adaptive = plan(model, w, slo, LIMITS)
    batch = adaptive.decode["batch"]
    assert batch >= 77 and model.token_seconds(batch, 576) <= 0.05 < model.token_seconds(batch + 1, 576)
    assert any(r.startswith("speculative decoding (ngram, acceptance 0.50)") for r in adaptive.reasons)
    unknown = plan(Profile(data, Speculation("ngram", 4)), w, slo, LIMITS)     # no acceptance figure
    assert (unknown.decode["batch"], unknown.n_decode) == (40, 4)
    assert unknown.decode["tokens_per_s_per_actor"] == pytest.approx(off.decode["tokens_per_s_per_actor"])
    assert any("no acceptance figure" in r for r in unknown.reasons)


def test_where_the_engine_would_turn_proposals_down_the_plan_counts_no_speed_up():
    """Verifying 4 proposals costs 4 ms more per sequence (compute-bound): one sequence still gains, but at
    the batch the TPOT allows every k > 0 loses, so the plan is the plain one (k 0, as the turn-down picks)."""
    data = with_speculation(synthetic(step=_plain), lambda b, c: 0.01 + 0.005 * b)
    w, slo = Workload(512, 128, 20.0), SLO(3.0, 0.05)
    model = Profile(data, Speculation("ngram", 4, acceptance=0.5))
    assert model.decode_step(1, 576).num_tokens > 0
    spec, off = plan(model, w, slo, LIMITS), plan(Profile(data), w, slo, LIMITS)
    assert spec.decode["batch"] == off.decode["batch"] == 40
    assert spec.decode["speculation"]["step_num_tokens"] == 0
    assert spec.decode["tokens_per_s_per_actor"] == pytest.approx(off.decode["tokens_per_s_per_actor"])
    assert any("turns it down to k 0" in r for r in spec.reasons)


def test_degree_model_predicts_the_speculative_step_like_the_plain_one():
    from deploy.planner import AllReduce, DegreeModel
    data = with_speculation(synthetic(step=_plain), lambda b, c: 0.01 + 0.0018 * b)
    p = Profile(data, Speculation("ngram", 4, acceptance=0.5, adaptive=False))
    ar = {2: AllReduce(latency_s=1e-4, bytes_per_s=1e9)}
    collective = lambda tokens: 2 * COSTS.num_layers * (1e-4 + tokens * 256 * 4 / 1e9)     # noqa: E731
    assert DegreeModel(p, 1, 1, ar).token_seconds(8, 500) == p.token_seconds(8, 500)
    m = DegreeModel(p, 2, 2, ar)
    assert m.spec_step_seconds(8, 500, 4) == pytest.approx(p.spec_step_seconds(8, 500, 4) / 2 + collective(40))
    assert m.token_seconds(8, 500) == pytest.approx(m.spec_step_seconds(8, 500, 4) / 3)


def test_search_takes_each_decode_degrees_kv_budget_where_given():
    """A decode actor's KV blocks per degree (each rank's memory after its share of the weights) bind the
    batch; without them degree d holds d times the degree-1 budget."""
    from deploy.planner import AllReduce, search_parallelism
    p = Profile(synthetic(step=lambda b, c: 0.01 + 0.0001 * b))
    w, slo = Workload(512, 128, 4.0), SLO(ttft_s=10.0, tpot_s=0.05)
    tight = Limits(decode_kv_blocks=40, block_size=16, max_batch_size=256)     # 40 blocks: 1 request of 640 tokens
    ar = {2: AllReduce(1e-5, 1e10)}
    scaled = search_parallelism(p, w, slo, tight, 8, [1, 2], ar)
    given = search_parallelism(p, w, slo, tight, 8, [1, 2], ar, decode_kv_blocks={2: 400})
    assert {c.plan.decode["kv_limit"] for c in scaled if c.decode_degree == 2} == {2}
    assert {c.plan.decode["kv_limit"] for c in given if c.decode_degree == 2} == {10}
    assert {c.plan.decode["kv_limit"] for c in given if c.decode_degree == 1} == {1}
