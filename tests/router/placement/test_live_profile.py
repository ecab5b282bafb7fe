"""`router.placement.live_profile`: the figures auto placement reads follow what requests report."""
from __future__ import annotations

import pytest

from router.placement.live_profile import LiveProfile, ProfileSeed


def test_decode_step_fit_recovers_a_line_once_batches_spread():
    live = LiveProfile(ProfileSeed(step_base_s=0.5, step_per_seq_s=0.5), block_size=4)
    live.finished(4, 0.030, 10)                 # one batch size only: the slope stays the seed's
    assert (live.step_per_seq_s, live.step_base_s) == (0.5, 0.0)
    for batch in (1, 2, 4, 8, 16):
        live.finished(batch, 0.010 + 0.002 * batch, 10)
    profile = live.decode_profile()
    assert profile.step_per_seq_s == pytest.approx(0.002, rel=0.15)
    assert profile.step_s(8) == pytest.approx(0.026, rel=0.15)


def test_one_token_requests_do_not_refit_the_step():
    live = LiveProfile(ProfileSeed(step_base_s=0.02, step_per_seq_s=0.001), block_size=4)
    live.finished(3, 0.0, 1)
    assert (live.step_base_s, live.step_per_seq_s, live.output_tokens) == (0.02, 0.001, 1)


def test_local_backlog_and_rate():
    live = LiveProfile(ProfileSeed(prefill_tokens_per_s=1000.0), block_size=4)
    assert live.decode_profile().prefill_tokens_per_s == 1000.0      # the prefill actors' until measured
    live.local_started("d0", 100)
    live.local_started("d0", 50)
    assert live.local_backlog("d0") == 150 and live.local_backlog("d1") == 0
    live.local_ended("d0", 100, compute_s=0.2)                       # 500 tokens/s measured
    assert live.local_backlog("d0") == 50
    assert live.decode_profile().prefill_tokens_per_s == pytest.approx(0.8 * 1000 + 0.2 * 500)
    live.local_ended("d0", 50)                                       # failed: no rate
    assert live.local_backlog("d0") == 0
