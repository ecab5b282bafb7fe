"""`router.placement.auto`: exact choices and estimates for constructed profiles and queues."""
from __future__ import annotations

import pytest

from router.placement.auto import (Choice, DecodeProfile, DecodeState, LinkProfile, PlacementInputs, PrefillProfile,
                                   PrefillState, ShadowPrefill, estimate_local, estimate_remote, needs_prefill_actor,
                                   place)

# A decode actor: 20 ms + 1 ms per running sequence per step; it prefills 2000 tokens/s between steps in
# chunks of 512. A prefill actor: 4000 tokens/s, 10 ms overhead. The link: 1 MB/s of KV... per 1 kB token.
DECODE = DecodeProfile.linear(step_base_s=0.020, step_per_seq_s=0.001, prefill_tokens_per_s=2000.0, chunk_tokens=512)
PREFILL = PrefillProfile(tokens_per_s=4000.0, overhead_s=0.010)
LINK = LinkProfile(kv_bytes_per_s=100e6, kv_bytes_per_token=1000.0)


def inputs(prompt: int, *, running: int = 8, backlog: int = 0, decode_cached: int = 0, prefill_queued: int = 0,
           prefill_cached: int = 0, output: float = 64, ttft_slo: float = 2.0, tpot_slo: float = 0.1,
           prefill: bool = True, decode: DecodeProfile = DECODE) -> PlacementInputs:
    return PlacementInputs(
        num_prompt_tokens=prompt, output_tokens=output, ttft_slo_s=ttft_slo, tpot_slo_s=tpot_slo,
        decode=DecodeState("decode-0", running, backlog, decode_cached), decode_profile=decode,
        prefill=PrefillState("prefill-0", prefill_queued, prefill_cached) if prefill else None,
        prefill_profile=PREFILL, link=LINK)


def test_estimates_follow_the_formulas():
    inp = inputs(1024, running=8, backlog=512, prefill_queued=1000)
    local = estimate_local(inp)
    # (512 + 1024) tokens at 2000/s = 0.768 s, 3 chunks of 512 each with a step at batch 8 (28 ms)
    assert local.ttft_s == pytest.approx(0.768 + 3 * 0.028)
    assert local.tpot_s == pytest.approx(0.029 + 0.768 / 64)
    remote = estimate_remote(inp)
    # 10 ms + (1000 + 1024) / 4000 + 1024 kB / 100 MB/s + one step at batch 8
    assert remote.ttft_s == pytest.approx(0.010 + 0.506 + 0.01024 + 0.028)
    assert remote.tpot_s == pytest.approx(0.029 + 0.256 / 64)
    assert remote.ttft_slack == pytest.approx(1 - remote.ttft_s / 2.0)


def test_with_speculation_the_tpot_is_the_time_per_token_and_the_ttft_waits_whole_steps():
    """A speculative decode actor: 30 ms steps that yield 3 tokens per sequence (10 ms per token)."""
    spec = DecodeProfile(lambda batch: 0.030, 2000.0, 512, token_s=lambda batch: 0.010)
    inp = inputs(1024, running=8, backlog=512, prefill_queued=1000, decode=spec)
    local, remote = estimate_local(inp), estimate_remote(inp)
    assert local.ttft_s == pytest.approx(0.768 + 3 * 0.030)
    assert local.tpot_s == pytest.approx(0.010 + 0.768 / 64)
    assert remote.ttft_s == pytest.approx(0.010 + 0.506 + 0.01024 + 0.030)
    assert remote.tpot_s == pytest.approx(0.010 + 0.256 / 64)
    assert DECODE.seconds_per_token(8) == DECODE.step_s(8) == pytest.approx(0.028)     # without: one per step


def test_long_prompt_with_an_idle_prefill_pool_goes_remote():
    p = place(inputs(3000, running=8))
    assert (p.choice, p.reason) == (Choice.REMOTE, "keeps_slo")
    assert p.local.keeps_slo and p.remote.headroom > p.local.headroom


def test_short_prompt_is_prefilled_locally():
    p = place(inputs(24, running=8))
    assert (p.choice, p.reason) == (Choice.LOCAL, "keeps_slo")
    assert p.local.ttft_s < p.remote.ttft_s


def test_saturated_prefill_queue_sends_even_a_long_prompt_local():
    p = place(inputs(3000, running=8, prefill_queued=12000))     # 3.75 s of queue > the 2 s TTFT SLO
    assert not p.remote.keeps_slo and p.local.keeps_slo
    assert (p.choice, p.reason) == (Choice.LOCAL, "keeps_slo")


def test_decode_batch_near_its_tpot_slo_sends_a_medium_prompt_remote():
    # 60 running: a step takes 80 ms of the 100 ms TPOT; 1500 local tokens add 0.75 s / 64 = 11.7 ms ...
    # 15 running: 35 ms, the same prompt keeps both SLOs locally (with more headroom than remote)
    near = place(inputs(1500, running=60, output=32))        # ... over 32 tokens: 23 ms → 104 ms > 100 ms
    assert not near.local.keeps_slo and near.remote.keeps_slo
    assert near.choice is Choice.REMOTE
    idle = place(inputs(1500, running=15, output=32, prefill_queued=6000))
    assert idle.choice is Choice.LOCAL


def test_the_decode_actors_cached_prefix_makes_local_cheaper():
    cold = place(inputs(2048, running=8))
    warm = place(inputs(2048, running=8, decode_cached=2032))      # all but 16 tokens held by the decode actor
    assert cold.choice is Choice.REMOTE and warm.choice is Choice.LOCAL
    assert warm.local.ttft_s == pytest.approx(16 / 2000 + 0.028)


def test_without_a_prefill_actor_placement_is_local():
    p = place(inputs(3000, prefill=False))
    assert (p.choice, p.reason, p.remote) == (Choice.LOCAL, "no_prefill_actor", None)


def test_when_neither_keeps_the_slos_the_smaller_violation_wins():
    slow = DecodeProfile.linear(0.2, 0.001, 2000.0, 512)      # every step misses the 100 ms TPOT already
    p = place(inputs(3000, running=4, decode=slow))
    assert not p.local.keeps_slo and not p.remote.keeps_slo
    assert (p.choice, p.reason) == (Choice.REMOTE, "least_violation")     # local adds its prefill on top
    assert p.remote.worst_slack > p.local.worst_slack


def test_log_fields_name_the_decision_and_its_inputs():
    fields = place(inputs(3000, prefill_queued=100)).log_fields()
    assert fields["placement"] == "remote" and fields["placement_reason"] == "keeps_slo"
    assert fields["prefill_queued_tokens"] == 100 and fields["decode_running"] == 8
    assert {"est_local_ttft_s", "est_local_tpot_s", "est_remote_ttft_s", "est_remote_tpot_s"} <= set(fields)


def test_a_request_needs_a_prefill_actor_only_when_local_breaks_an_slo_and_remote_is_picked():
    assert not place(inputs(3000, running=8)).needs_prefill_actor          # remote, but local keeps both SLOs
    assert not place(inputs(24, running=8)).needs_prefill_actor            # local
    near = place(inputs(1500, running=60, output=32))                      # local breaks TPOT, remote keeps it
    assert near.choice is Choice.REMOTE and near.needs_prefill_actor
    slow = DecodeProfile.linear(0.2, 0.001, 2000.0, 512)
    assert place(inputs(3000, running=4, decode=slow)).needs_prefill_actor  # the smaller violation is remote
    swamped = place(inputs(1500, running=60, output=32, prefill_queued=40000))   # 10 s of prefill queue
    assert swamped.choice is Choice.LOCAL and not swamped.needs_prefill_actor
    assert not place(inputs(1500, running=60, output=32, prefill=False)).needs_prefill_actor   # nothing to ask


def test_a_shadow_prefill_actor_prices_the_remote_option_but_the_request_stays_local():
    shadowed = place(inputs(1500, running=60, output=32), shadow=True)
    assert (shadowed.choice, shadowed.reason) == (Choice.LOCAL, "no_prefill_actor")
    assert shadowed.needs_prefill_actor and shadowed.remote.keeps_slo and not shadowed.local.keeps_slo
    assert shadowed.log_fields()["needs_prefill_actor"] is True
    assert not place(inputs(24, running=8), shadow=True).needs_prefill_actor


def test_the_shadow_queue_grows_by_what_needed_it_and_drains_at_the_prefill_rate():
    shadow = ShadowPrefill()
    assert shadow.state(10.0, 1000.0) == PrefillState("shadow", 0, 0)
    shadow.take(1500, 10.0, 1000.0)
    shadow.take(500, 10.5, 1000.0)                 # 1500 - 500 drained + 500
    assert shadow.queued_tokens == pytest.approx(1500.0)
    assert shadow.state(11.0, 1000.0).queued_tokens == 1000
    assert shadow.state(13.0, 1000.0).queued_tokens == 0 and shadow.state(12.0, 1000.0).queued_tokens == 0


def test_the_need_is_asked_with_the_decode_batch_spread_over_every_actor():
    inp = inputs(1500, running=60, output=32)          # local breaks the TPOT SLO at 60 running, not at 15
    assert needs_prefill_actor(inp) and needs_prefill_actor(inp, 60) and not needs_prefill_actor(inp, 15)
    spread = place(inp, all_decode_running=15)
    assert spread.choice is Choice.REMOTE and not spread.local.keeps_slo    # the placement sees the batch it has
    assert not spread.needs_prefill_actor
