"""`deploy.role_balance.RoleBalancer`: sequences of measured needs → exact flips, none inside the band."""
from __future__ import annotations

import pytest

from deploy.role_balance import TO_DECODE, TO_PREFILL, BalanceSettings, RoleBalancer


def run(loads, split=(1, 3), settings=BalanceSettings(band=0.25, flip_after=2, cooldown_ticks=3)):
    """Feed (need_prefill, need_decode) per tick, applying each flip; returns the flips per tick and the split."""
    balancer = RoleBalancer(settings)
    n_p, n_d = split
    flips = []
    for need_p, need_d in loads:
        decision = balancer.decide(need_p, need_d, n_p, n_d)
        flips.append(decision.flip)
        if decision.flip == TO_PREFILL:
            n_p, n_d = n_p + 1, n_d - 1
        elif decision.flip == TO_DECODE:
            n_p, n_d = n_p - 1, n_d + 1
    return flips, (n_p, n_d)


def test_a_prefill_heavy_shift_flips_decode_actors_to_prefill_after_the_streak_and_cooldown():
    # 4 actors, need 3:1 → ideal 3 prefill; one flip per streak of 2, then 3 ticks of cooldown
    flips, split = run([(3.0, 1.0)] * 9)
    assert flips == [None, TO_PREFILL, None, None, None, TO_PREFILL, None, None, None]
    assert split == (3, 1)


def test_a_decode_heavy_shift_flips_back():
    flips, split = run([(0.5, 3.5)] * 3, split=(3, 1))      # ideal 0.5 → clamped to min_prefill 1
    assert flips == [None, TO_DECODE, None] and split == (2, 2)


def test_no_flip_while_the_ideal_stays_inside_the_band():
    # 1 prefill of 4: ideal between 0.25 and 1.75 keeps it (band 0.25 beyond the rounding half)
    loads = [(1.7, 2.3), (1.0, 3.0), (1.4, 2.6), (1.7, 2.3), (1.2, 2.8)] * 4     # ideal 1.7, 1.0, 1.4, 1.7, 1.2
    flips, split = run(loads)
    assert flips == [None] * len(loads) and split == (1, 3)


def test_oscillation_across_the_band_faster_than_the_streak_flips_nothing():
    loads = [(3.0, 1.0), (1.0, 3.0)] * 6                    # wants +1, then keep, alternately
    flips, split = run(loads)
    assert flips == [None] * len(loads) and split == (1, 3)


def test_each_role_keeps_its_minimum():
    flips, split = run([(10.0, 0.0)] * 12)                  # all prefill: decode keeps 1
    assert split == (3, 1) and flips.count(TO_PREFILL) == 2
    flips, split = run([(0.0, 10.0)] * 12, split=(3, 1))
    assert split == (1, 3) and flips.count(TO_DECODE) == 2


@pytest.mark.parametrize("band", [0.0, 0.4])
def test_the_band_sets_how_far_the_ideal_must_move(band):
    # 1 prefill of 4, need 1.9:2.1 → ideal 1.9: past 1.5 (band 0) flips, inside 1.9 (band 0.4) does not
    flips, _ = run([(1.9, 2.1)] * 2, settings=BalanceSettings(band=band, flip_after=2, cooldown_ticks=0))
    assert flips == ([None, TO_PREFILL] if band == 0.0 else [None, None])


def test_role_flips_config_reads_yaml_off_and_refuses_unknown_values():
    from deploy.config import ConfigError, load_config
    assert load_config(None, {"routing.role_flips": False}).routing.role_flips == "off"   # YAML's bare `off`
    assert load_config(None, {"routing.role_flips": "auto"}).routing.role_flips == "auto"
    with pytest.raises(ConfigError, match="role_flips"):
        load_config(None, {"routing.role_flips": "sometimes"})
    with pytest.raises(ConfigError, match="mode"):
        load_config(None, {"routing.mode": "fastest"})
