"""`Autoscaler` with routing.role_flips auto at a fixed actor count: measured loads (finished requests in
the window, as the Dispatcher records them) → exact flips through the pool manager, and none when the
load oscillates faster than the balancer's streak."""
from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from deploy.autoscaler import Autoscaler, AutoscaleSettings
from deploy.config import load_config
from deploy.pool_manager import Flip
from engine.performance import MeasuredPerformance as Profile
from deploy.role_balance import TO_DECODE, TO_PREFILL
from profile_support import synthetic
from router.dispatcher import Dispatcher, FinishedRequest
from router.placement import PlacementRecord
from router.pools import DecodeView, Pools, PrefillView
from router.routing import RoutingSettings

PREFILL_HEAVY = (2000, 16, 2.0)     # prompt tokens, output tokens, req/s: needs ~4.9 prefill : 0.2 decode actors
DECODE_HEAVY = (50, 200, 2.0)       # ... ~0.02 : 0.65


class FakeManager:
    """PoolManager.flip over the views: the actor moves to its new pool at once."""

    def __init__(self, pools: Pools):
        self.pools = pools
        self.flips: list[tuple[str, str]] = []

    async def flip(self, actor_id: str, role: str, timeout_s: float = 30.0) -> Flip:
        source = self.pools.decode if role == "prefill" else self.pools.prefill
        view = next(v for v in source if v.actor_id == actor_id)
        source.remove(view)
        if role == "prefill":
            self.pools.prefill.append(PrefillView(actor_id, None, view.kv_blocks_total))
        else:
            self.pools.decode.append(DecodeView(actor_id, None, f"kv://{actor_id}", view.kv_blocks_total))
        self.flips.append((actor_id, role))
        return Flip(actor_id, "decode" if role == "prefill" else "prefill", role, 0.0, 0.0)


def make(mode: str = "disaggregated"):
    cfg = load_config(None, {"model.name": "tiny", "pools.prefill.count": 1, "pools.decode.count": 3,
                             "routing.role_flips": "auto", "routing.mode": mode,
                             "slo.ttft_p99_ms": 2000, "slo.tpot_p99_ms": 100})
    pools = Pools([PrefillView("prefill-0", None, 512)],
                  [DecodeView(f"decode-{i}", None, f"kv://decode-{i}", 512) for i in range(3)])
    pools.decode[1].running = 2            # the busiest decode actor is flipped last
    backend = Dispatcher(pools, tokenizer=None, max_model_len=1024, block_size=16, routing=RoutingSettings())
    manager = FakeManager(pools)
    scaler = Autoscaler(cfg, backend, None, Profile(synthetic(flops_per_s=2e10)),
                        AutoscaleSettings(interval_s=1.0, window_s=60.0), manager=manager)
    scaler._started -= 60.0                # a full window of history
    return scaler, backend, manager


def ticks(scaler, backend, loads, needs: list[bool] | None = None) -> list[str | None]:
    """One tick per load: the window holds 60 s of finished requests of that shape (and in mode auto, of
    placements that each needed a prefill actor or not, by `needs` per tick)."""
    flips = []
    for tick, (prompt, output, rate) in enumerate(loads):
        now = time.monotonic()
        backend.finished.clear()
        backend.finished.extend(FinishedRequest(now - i / rate, prompt, output, 0.5, 0.02)
                                for i in range(int(60 * rate)))
        backend.placer.placements.clear()
        if needs is not None:
            backend.placer.placements.extend(PlacementRecord(now - i / rate, prompt, needs[tick])
                                             for i in range(int(60 * rate)))
        decision = asyncio.run(scaler.tick())
        flips.append(decision.split.flip)
    return flips


def test_a_load_shift_flips_one_actor_at_a_time_and_back():
    scaler, backend, manager = make()
    flips = ticks(scaler, backend, [PREFILL_HEAVY] * 7 + [DECODE_HEAVY] * 9)
    # streak of 2, then 3 ticks of cooldown after each flip; each role keeps one actor
    assert flips == [None, TO_PREFILL, None, None, None, TO_PREFILL, None,      # the shift at tick 7 wants
                     None, None, TO_DECODE, None, None, None, TO_DECODE, None, None]   # back from tick 7 on
    assert manager.flips == [("decode-0", "prefill"), ("decode-2", "prefill"),
                             ("prefill-0", "decode"), ("decode-0", "decode")]
    assert (len(backend.pools.prefill), len(backend.pools.decode)) == (1, 3)
    assert scaler.history[1].flip.to_role == "prefill"


def test_a_load_that_oscillates_every_tick_flips_nothing():
    scaler, backend, manager = make()
    flips = ticks(scaler, backend, [PREFILL_HEAVY, DECODE_HEAVY] * 6)
    assert flips == [None] * 12 and manager.flips == []


def test_auto_mode_flips_the_last_prefill_actor_when_no_prompt_needs_one_and_brings_it_back():
    scaler, backend, manager = make("auto")
    assert scaler.balancer.settings.min_prefill == 0
    # a prefill-heavy load whose prompts all kept their SLOs on the decode actors (placed local): their
    # prefill is decode-actor work, so the prefill actor goes; then every prompt needs one again
    flips = ticks(scaler, backend, [PREFILL_HEAVY] * 11, needs=[False] * 5 + [True] * 6)
    assert flips == [None, TO_DECODE, None, None, None, None, TO_PREFILL, None, None, None, TO_PREFILL]
    assert manager.flips[0] == ("prefill-0", "decode")
    assert scaler.history[2].observation.remote_share == 0.0 and scaler.history[6].observation.remote_share == 1.0
    assert scaler.history[2].sizes == {"prefill": 0, "decode": 4}
    assert (len(backend.pools.prefill), len(backend.pools.decode)) == (2, 2)


def test_auto_mode_splits_the_prefill_need_by_the_share_that_needed_a_prefill_actor():
    scaler, backend, _ = make("auto")
    ticks(scaler, backend, [PREFILL_HEAVY], needs=[True])
    full = scaler.history[-1]
    backend.placer.placements.clear()
    now = time.monotonic()     # a quarter of the prompt tokens needed one
    backend.placer.placements.extend([PlacementRecord(now, 300, True), PlacementRecord(now, 900, False)])
    obs = scaler.observe(now)
    assert obs.remote_share == 0.25
    need_p, need_d = scaler.needs(full.plan, obs, SimpleNamespace(ttft_s=2.0))
    assert need_p == pytest.approx(0.25 * full.plan.needed_prefill)
    assert need_d == pytest.approx(full.plan.needed_decode + 0.75 * full.plan.needed_prefill)


def test_disaggregated_mode_keeps_one_prefill_actor_whatever_the_placements():
    scaler, backend, manager = make()
    assert scaler.balancer.settings.min_prefill == 1
    flips = ticks(scaler, backend, [DECODE_HEAVY] * 6, needs=[False] * 6)
    assert flips == [None] * 6 and len(backend.pools.prefill) == 1
    assert scaler.history[-1].observation.remote_share is None
