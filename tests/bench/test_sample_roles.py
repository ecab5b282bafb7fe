"""`bench.serving.runs.sample_roles`: actors per role from the router's pools, and with a role-balancing
autoscaler the split it called for at its last tick."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

from bench.serving.runs import sample_roles
from router.pools import DecodeView, Pools, PrefillView


def _first_sample(pools, autoscaler) -> dict:
    out: list[dict] = []

    async def main():
        task = asyncio.ensure_future(sample_roles(pools, out, autoscaler, interval_s=0.01))
        while not out:
            await asyncio.sleep(0.005)
        task.cancel()
    asyncio.run(main())
    return {k: v for k, v in out[0].items() if k != "t"}


def test_a_sample_counts_each_role_and_carries_the_balancers_split():
    pools = Pools([PrefillView("prefill-0", None, 8)],
                  [DecodeView("decode-0", None, "kv://decode-0", 8), DecodeView("colocated-0", None, "", 8)])
    decision = SimpleNamespace(plan=SimpleNamespace(needed_prefill=1.0, needed_decode=3.0),
                               split=SimpleNamespace(ideal_prefill=0.25),
                               observation=SimpleNamespace(remote_share=0.1))
    assert _first_sample(pools, SimpleNamespace(history=[decision])) == {
        "prefill": 1, "decode": 1, "colocated": 1,
        "planned_prefill": 0.75, "ideal_prefill": 0.25, "remote_share": 0.1}       # 3 actors x 1 / (1 + 3)
    assert _first_sample(pools, None) == {"prefill": 1, "decode": 1, "colocated": 1}
    no_balance = SimpleNamespace(history=[SimpleNamespace(split=None)])          # count: auto pools only
    assert _first_sample(pools, no_balance) == {"prefill": 1, "decode": 1, "colocated": 1}
