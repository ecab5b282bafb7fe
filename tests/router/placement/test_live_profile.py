"""`router.placement.live_profile`: the live model answers as its base, corrected by what requests report."""
from __future__ import annotations

import pytest
from profile_support import synthetic, with_speculation

from engine.performance import LinearPerformance, MeasuredPerformance, Speculation
from router.placement.auto import estimate_local
from router.placement.live_profile import LiveProfile


def test_decode_step_fit_recovers_a_line_once_batches_spread():
    live = LiveProfile(LinearPerformance(step_base_s=0.5, step_per_seq_s=0.5), block_size=4)
    live.finished(4, 0.030, 10, context=100)     # one batch size only: the slope stays the base's, the level moves
    assert live.decode_step_seconds(4, 100) == pytest.approx(0.030)
    assert live.decode_step_seconds(5, 100) - live.decode_step_seconds(4, 100) == pytest.approx(0.5)
    for batch in (1, 2, 4, 8, 16):
        live.finished(batch, 0.010 + 0.002 * batch, 10, context=100)
    per_seq = live.decode_step_seconds(9, 100) - live.decode_step_seconds(8, 100)
    assert per_seq == pytest.approx(0.002, rel=0.15)
    assert live.decode_profile(100, 100).step_s(8) == pytest.approx(0.026, rel=0.15)


def test_one_token_requests_do_not_refit_the_step():
    live = LiveProfile(LinearPerformance(step_base_s=0.02, step_per_seq_s=0.001), block_size=4)
    live.finished(3, 0.0, 1, context=10)
    assert live.decode_step_seconds(3, 10) == pytest.approx(0.023) and live.output_tokens == 1


def test_a_measured_base_keeps_its_shape_in_batch_and_context():
    base = MeasuredPerformance(synthetic(step=lambda b, c: 0.01 + 0.001 * b + 1e-6 * b * c))
    live = LiveProfile(base, block_size=4)
    for _ in range(20):          # serving adds 5 ms to every step at batch 4 (a per-step cost the profile misses)
        live.finished(4, base.decode_step_seconds(4, 1024) + 0.005, 10, context=1024)
    assert live.decode_step_seconds(4, 1024) == pytest.approx(base.decode_step_seconds(4, 1024) + 0.005)
    assert live.decode_step_seconds(16, 2048) == pytest.approx(base.decode_step_seconds(16, 2048) + 0.005)
    assert live.measured is base


def test_prefill_reports_scale_the_base_prefill_time():
    base = MeasuredPerformance(synthetic(flops_per_s=1e10))
    live = LiveProfile(base, block_size=4)
    for _ in range(40):          # prefill actors report half the profile's speed, on prompts with a cached prefix
        live.prefill_done(256, 2 * base.prefill_share_seconds(512, 256), 0, 0.0, 512)
    assert live.prefill_seconds(700) == pytest.approx(2 * base.prefill_seconds(700), rel=0.01)
    assert live.prefill_capacity(700) == pytest.approx(base.prefill_capacity(700) / 2, rel=0.01)
    assert live.prefill_profile(700).tokens_per_s == pytest.approx(700 / live.prefill_seconds(700))


def test_link_figures_follow_transfers():
    live = LiveProfile(LinearPerformance(kv_bytes_per_s=1e9, kv_bytes_per_token=10), block_size=4)
    assert (live.kv_bytes_per_s, live.kv_bytes_per_token) == (1e9, 10)
    live.prefill_done(0, 0.0, 4000, 1e-3, 100)                        # 4 MB/s; 40 bytes per prompt token
    assert live.kv_bytes_per_s == pytest.approx(0.8 * 1e9 + 0.2 * 4e6) and live.kv_bytes_per_token == 40
    assert live.link_seconds(8e6) == pytest.approx(8e6 / live.kv_bytes_per_s)


def test_local_backlog_and_rate():
    live = LiveProfile(LinearPerformance(prefill_tokens_per_s=1000.0), block_size=4)
    assert live.decode_profile(100, 100).prefill_tokens_per_s == 1000.0    # the prefill actors' until measured
    live.local_started("d0", 100)
    live.local_started("d0", 50)
    assert live.local_backlog("d0") == 150 and live.local_backlog("d1") == 0
    live.local_ended("d0", 100, compute_s=0.2)                       # 500 tokens/s measured
    assert live.local_backlog("d0") == 50
    assert live.decode_profile(100, 100).prefill_tokens_per_s == pytest.approx(0.8 * 1000 + 0.2 * 500)
    live.local_ended("d0", 50)                                       # failed: no rate
    assert live.local_backlog("d0") == 0


def _spec_base(acceptance: float = 0.25) -> MeasuredPerformance:
    data = with_speculation(synthetic(step=lambda b, c: 0.01 + 0.001 * b), lambda b, c: 0.01 + 0.0012 * b)
    return MeasuredPerformance(data, Speculation("ngram", 4, acceptance=acceptance))


def test_the_acceptance_the_decode_actors_report_sets_their_time_per_token():
    base = _spec_base(acceptance=0.25)
    live = LiveProfile(base, block_size=4)
    assert live.acceptance("decode-0") is None and live.speculation == base.speculation
    assert live.decode_profile(100, 1024, "decode-0").seconds_per_token(4) == pytest.approx(base.token_seconds(4, 1024))
    # a request that accepted 30 of 40 proposals, exactly as fast as the base predicts at that rate
    live.finished(4, base.token_seconds(4, 1024, 0.75), 20, context=1024, actor_id="decode-0", spec_proposed=40,
                  spec_accepted=30)
    assert (live.step_scale, live.step_offset_s) == (1.0, pytest.approx(0.0, abs=1e-12))
    assert live.acceptance("decode-0") == live.acceptance("decode-1") == pytest.approx(0.75)   # the pool's: no own
    assert live.speculation.acceptance == pytest.approx(0.75)
    fast = live.decode_profile(100, 1024, "decode-0")
    assert fast.seconds_per_token(4) == pytest.approx(base.token_seconds(4, 1024, 0.75))
    assert fast.seconds_per_token(4) < base.token_seconds(4, 1024)
    assert fast.step_s(4) == pytest.approx(base.decode_step(4, 1024, 0.75).step_s)
    live.finished(4, base.token_seconds(4, 1024, 0.1), 20, context=1024, actor_id="decode-1", spec_proposed=40,
                  spec_accepted=4)
    assert live.acceptance("decode-1") == pytest.approx(0.1) and live.acceptance("decode-0") == pytest.approx(0.75)
    assert live.acceptance() == pytest.approx((0.9 * 30 + 4) / (0.9 * 40 + 40))             # decayed, pooled
    live.finished(4, base.token_seconds(4, 1024, 0.5), 20, context=1024, actor_id="decode-2", spec_proposed=8,
                  spec_accepted=4)
    assert live.acceptance("decode-2") == pytest.approx(live.acceptance())     # too few of its own yet
    # auto placement: the same request's TPOT on each actor, at its acceptance
    from router.placement.auto import DecodeState, LinkProfile, PlacementInputs, PrefillProfile

    def tpot(actor: str) -> float:
        return estimate_local(PlacementInputs(
            100, 20, 1.0, 0.1, DecodeState(actor, 3, 0, 0), live.decode_profile(100, 1024, actor),
            None, PrefillProfile(1000.0), LinkProfile(1e9, 100))).tpot_s
    prefill_share = live.local_prefill_seconds(100) / 20
    assert tpot("decode-0") == pytest.approx(base.token_seconds(4, 1024, 0.75) + prefill_share)
    assert tpot("decode-1") == pytest.approx(base.token_seconds(4, 1024, 0.1) + prefill_share)
    assert tpot("decode-1") > tpot("decode-0")


def test_without_speculation_the_time_per_token_is_the_corrected_step():
    base = MeasuredPerformance(synthetic())
    live = LiveProfile(base, block_size=4)
    for _ in range(5):
        live.finished(4, base.decode_step_seconds(4, 1024) + 0.005, 10, context=1024, actor_id="decode-0")
    profile = live.decode_profile(100, 1024, "decode-0")
    assert live.speculation is None and live.acceptance() is None
    for batch in (1, 4, 16):
        assert profile.seconds_per_token(batch) == profile.step_s(batch) == pytest.approx(
            live.decode_step_seconds(batch, 1024)) == pytest.approx(base.decode_step_seconds(batch, 1024) + 0.005)


def test_the_fit_learns_what_the_speculative_model_misses_at_each_requests_acceptance():
    base = _spec_base()
    live = LiveProfile(base, block_size=4)
    for _ in range(20):          # serving adds 2 ms to every token at the rate each request met
        for accepted in (10, 20, 30):
            live.finished(4, base.token_seconds(4, 1024, accepted / 40) + 0.002, 10, context=1024,
                          actor_id="decode-0", spec_proposed=40, spec_accepted=accepted)
    assert live.token_seconds(4, 1024, 0.6) == pytest.approx(base.token_seconds(4, 1024, 0.6) + 0.002)
