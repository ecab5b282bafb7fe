"""`Autoscaler` with routing.role_flips auto at a fixed actor count: measured loads (finished requests in
the window, as the Dispatcher records them) → exact flips through the pool manager, and none when the
load oscillates faster than the balancer's streak."""
from __future__ import annotations

import asyncio
import time
from collections import deque
from types import SimpleNamespace

from deploy.autoscaler import Autoscaler, AutoscaleSettings
from deploy.config import load_config
from deploy.pool_manager import Flip
from deploy.profiler import Profile
from deploy.role_balance import TO_DECODE, TO_PREFILL
from profile_helpers import synthetic
from router.pools import DecodeView, Pools, PrefillView

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


def make():
    cfg = load_config(None, {"model.name": "tiny", "pools.prefill.count": 1, "pools.decode.count": 3,
                             "routing.role_flips": "auto", "slo.ttft_p99_ms": 2000, "slo.tpot_p99_ms": 100})
    pools = Pools([PrefillView("prefill-0", None, 512)],
                  [DecodeView(f"decode-{i}", None, f"kv://decode-{i}", 512) for i in range(3)])
    pools.decode[1].running = 2            # the busiest decode actor is flipped last
    backend = SimpleNamespace(pools=pools, completed=deque(), admission=SimpleNamespace(num_waiting=0))
    manager = FakeManager(pools)
    scaler = Autoscaler(cfg, backend, None, Profile(synthetic(flops_per_s=2e10)),
                        AutoscaleSettings(interval_s=1.0, window_s=60.0), manager=manager)
    scaler._started -= 60.0                # a full window of history
    return scaler, backend, manager


def ticks(scaler, backend, loads) -> list[str | None]:
    """One tick per load: the window holds 60 s of finished requests of that shape."""
    flips = []
    for prompt, output, rate in loads:
        now = time.monotonic()
        backend.completed.clear()
        backend.completed.extend((now - i / rate, prompt, output, 0.5, 0.02) for i in range(int(60 * rate)))
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
