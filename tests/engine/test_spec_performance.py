"""`engine.performance` with speculative decoding: tokens per step at an acceptance rate, the speculative
step's cost (measured, or assumed from the plain step), and the turn-down's choice of k."""
from __future__ import annotations

import pytest
from profile_support import synthetic, with_speculation

from engine.performance import LinearPerformance, MeasuredPerformance, Speculation
from engine.spec.tokens_per_step import acceptance_ratio, expected_tokens, per_token_acceptance


def plain_step(b, c):                 # the plain decode step of the synthetic profiles here
    return 0.01 + 0.001 * b


def test_tokens_per_step_follows_the_geometric_series():
    assert expected_tokens(0.8, 4) == pytest.approx((1 - 0.8 ** 5) / (1 - 0.8))
    assert expected_tokens(0.8, 4) == pytest.approx(1 + 0.8 + 0.64 + 0.512 + 0.4096)
    assert expected_tokens(0.0, 4) == 1.0 and expected_tokens(1.0, 4) == 5.0 and expected_tokens(0.7, 0) == 1.0
    # the reported ratio (accepted / proposed) at k gives 1 + k·r tokens at that k, whatever α
    for ratio in (0.05, 0.3, 0.5, 0.9):
        alpha = per_token_acceptance(ratio, 4)
        assert acceptance_ratio(alpha, 4) == pytest.approx(ratio, abs=1e-9)
        assert expected_tokens(alpha, 4) == pytest.approx(1 + 4 * ratio)
        assert alpha >= ratio                       # proposals after a rejection are never judged
    assert per_token_acceptance(0.6, 1) == 0.6


def test_without_speculation_the_time_per_token_is_the_plain_step():
    p = MeasuredPerformance(synthetic())
    for batch, context in ((1, 128), (10, 1536), (200, 2048)):
        assert p.token_seconds(batch, context) == p.decode_step_seconds(batch, context)
        assert p.decode_step(batch, context).num_tokens == 0


def test_measured_speculative_steps_and_tokens_per_step_give_the_time_per_token():
    # 4 proposals add 0.8 ms per sequence to the step
    data = with_speculation(synthetic(step=plain_step), lambda b, c: 0.01 + 0.0018 * b)
    spec = Speculation("ngram", 4, acceptance=0.5, adaptive=False)
    p = MeasuredPerformance(data, spec)
    assert p.spec_step_seconds(8, 1024, 4) == pytest.approx(0.01 + 0.0018 * 8)
    assert p.spec_step_seconds(8, 1024, 2) == pytest.approx(0.01 + 0.001 * 8 + 0.0004 * 8)   # half the added cost
    assert p.spec_step_seconds(8, 1024, 0) == pytest.approx(p.decode_step_seconds(8, 1024))
    step = p.decode_step(8, 1024)
    assert (step.num_tokens, step.tokens_per_step) == (4, pytest.approx(3.0))                # 1 + 4 · 0.5
    assert p.token_seconds(8, 1024) == pytest.approx((0.01 + 0.0018 * 8) / 3.0)
    assert p.token_seconds(8, 1024) < p.decode_step_seconds(8, 1024)
    # measured at k 1 too (verifying at all costs 0.4 ms per sequence): piecewise-linear through 0, 1 and 4
    at1 = with_speculation(synthetic(step=plain_step), lambda b, c: 0.01 + 0.0014 * b, num_tokens=1)
    both = MeasuredPerformance({**data, "speculative": {**data["speculative"], "points": [
        *at1["speculative"]["points"], *data["speculative"]["points"]]}}, spec)
    assert both.spec_step_seconds(8, 1024, 1) == pytest.approx(0.01 + 0.0014 * 8)
    assert both.spec_step_seconds(8, 1024, 2) == pytest.approx(0.01 + 0.0014 * 8 + 0.0004 * 8 / 3)
    assert both.spec_step_seconds(8, 1024, 4) == pytest.approx(0.01 + 0.0018 * 8)
    assert both.spec_step_seconds(8, 1024, 5) == pytest.approx(0.01 + 0.0018 * 8 + 0.0004 * 8 / 3)
    # another method's measurements do not apply: the assumption from the plain steps does
    other = MeasuredPerformance(data, Speculation("draft", 4, acceptance=0.5, adaptive=False))
    assert other.spec_step_seconds(8, 1024, 4) == pytest.approx(other.decode_step_seconds(40, 1024))


def test_where_proposing_loses_the_model_turns_it_down_as_the_engine_does():
    """Verifying costs 1 ms per query token (compute-bound): one sequence still gains; at batch 64 every k > 0
    loses, so the adaptive model picks k 0 (no speed-up predicted) and a fixed k predicts the slow-down."""
    data = with_speculation(synthetic(step=plain_step), lambda b, c: 0.01 + 0.001 * b * 5)
    adaptive = MeasuredPerformance(data, Speculation("ngram", 4, acceptance=0.5))
    assert adaptive.decode_step(1, 1024).num_tokens > 0
    assert adaptive.token_seconds(1, 1024) < adaptive.decode_step_seconds(1, 1024)
    assert adaptive.decode_step(64, 1024).num_tokens == 0
    assert adaptive.token_seconds(64, 1024) == adaptive.decode_step_seconds(64, 1024)
    fixed = MeasuredPerformance(data, Speculation("ngram", 4, acceptance=0.5, adaptive=False))
    assert fixed.token_seconds(64, 1024) == pytest.approx((0.01 + 0.32) / 3.0)
    assert fixed.token_seconds(64, 1024) > fixed.decode_step_seconds(64, 1024)


def test_an_unknown_acceptance_predicts_no_speed_up():
    data = with_speculation(synthetic(step=plain_step), lambda b, c: 0.01 + 0.0011 * b)
    p = MeasuredPerformance(data, Speculation("ngram", 4))
    assert p.token_seconds(4, 1024) == p.decode_step_seconds(4, 1024)
    assert p.token_seconds(4, 1024, acceptance=0.7) < p.decode_step_seconds(4, 1024)     # a figure given per call


def test_a_profile_without_speculative_points_models_the_step_from_the_plain_one():
    """An older profile (or one made with speculation off) still loads: a step verifying k proposals per
    sequence is taken as a plain step of batch · (1 + k) sequences, and a draft adds k draft forwards."""
    data = synthetic()
    assert "speculative" not in data
    ngram = MeasuredPerformance(data, Speculation("ngram", 4, acceptance=0.6, adaptive=False))
    assert ngram.spec_step_seconds(3, 1024, 4) == pytest.approx(ngram.decode_step_seconds(15, 1024))
    assert ngram.token_seconds(3, 1024) == pytest.approx(ngram.decode_step_seconds(15, 1024) / (1 + 4 * 0.6))
    draft = MeasuredPerformance(data, Speculation("draft", 4, acceptance=0.6, adaptive=False, draft_cost=0.1))
    assert draft.spec_step_seconds(3, 1024, 4) == pytest.approx(
        draft.decode_step_seconds(15, 1024) + 4 * 0.1 * draft.decode_step_seconds(3, 1024))
    linear = LinearPerformance(step_base_s=0.02, step_per_seq_s=0.001,
                               speculation=Speculation("ngram", 2, acceptance=0.5, adaptive=False))
    assert linear.token_seconds(1, 100) == pytest.approx((0.02 + 0.003) / 2.0)


def test_calibration_and_degrees_apply_to_the_speculative_step():
    data = with_speculation(synthetic(step=plain_step), lambda b, c: 0.01 + 0.0018 * b)
    data["calibration"] = {"decode": 2.0, "step_s": 0.003}
    p = MeasuredPerformance(data, Speculation("ngram", 4, acceptance=0.5, adaptive=False))
    assert p.spec_step_seconds(8, 1024, 4) == pytest.approx(2.0 * (0.01 + 0.0018 * 8) + 0.003)
    data["degrees"] = {"2": {"decode": synthetic(step=lambda b, c: 0.005 + 0.0005 * b)["decode"]}}
    at2 = MeasuredPerformance(data, p.speculation).at_degree("decode", 2)
    assert at2.speculation == p.speculation
    # measured at degree 1 only: at degree 2 the step is assumed from that degree's plain steps
    assert at2.spec_step_seconds(8, 1024, 4) == pytest.approx(at2.decode_step_seconds(40, 1024))
