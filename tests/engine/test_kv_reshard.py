"""KV resharding by head range between tensor-parallel degrees: for every pair of degrees a model allows
(Np > Nd, Np < Nd, equal; KV heads split or replicated), the plan gives each receiving rank each of its
heads exactly once, and applying it to a sharded cache yields exactly the receiving degree's shards."""
from __future__ import annotations

import pytest
import torch

from engine.model.config import ModelConfig
from engine.parallel.reshard import HeadCopy, apply_plan, reshard_plan
from engine.parallel.shard import kv_head_ranges


def _cfg(num_heads: int, num_kv_heads: int) -> ModelConfig:
    return ModelConfig("llama", 64, 32 * num_heads, 64 * num_heads, 2, num_heads, num_kv_heads, 8, 128)


CASES = [(8, 4, p, d) for p in (1, 2, 4, 8) for d in (1, 2, 4, 8)]
CASES += [(4, 1, p, d) for p in (1, 2, 4) for d in (1, 2, 4)]


@pytest.mark.parametrize("num_heads,num_kv_heads,source_degree,dest_degree", CASES)
def test_resharding_yields_the_receiving_degrees_shards(num_heads, num_kv_heads, source_degree, dest_degree):
    cfg = _cfg(num_heads, num_kv_heads)
    g = torch.Generator().manual_seed(source_degree * 10 + dest_degree)
    full = torch.randn(2, 6, 2, num_kv_heads, 4, 8, generator=g)          # [L, NB, 2, Hkv, bs, D]
    sources = [full[:, :, :, r.start:r.stop].clone() for r in kv_head_ranges(cfg, source_degree)]
    dests = [torch.full((2, 6, 2, len(r), 4, 8), float("nan")) for r in kv_head_ranges(cfg, dest_degree)]
    plan = reshard_plan(cfg, source_degree, dest_degree)
    written = [[0] * len(r) for r in kv_head_ranges(cfg, dest_degree)]
    for c in plan:
        assert len(c.source_heads) == len(c.dest_heads) > 0
        for p in c.dest_heads:
            written[c.dest_rank][p] += 1
    assert all(n == 1 for heads in written for n in heads), written
    apply_plan(plan, sources, dests, [4, 1], [0, 5])
    for d, r in enumerate(kv_head_ranges(cfg, dest_degree)):
        assert torch.equal(dests[d][:, [0, 5]], full[:, [4, 1], :, r.start:r.stop])
        assert torch.isnan(dests[d][:, [1, 2, 3, 4]]).all()                 # no other block touched


def test_plans_are_one_range_per_rank_pair_and_spread_replicas():
    cfg = _cfg(8, 4)
    two = range(0, 2)
    assert reshard_plan(cfg, 2, 2) == [HeadCopy(0, 0, two, two), HeadCopy(1, 1, two, two)]
    assert reshard_plan(cfg, 2, 1) == [HeadCopy(0, 0, two, two), HeadCopy(1, 0, two, range(2, 4))]
    assert reshard_plan(cfg, 1, 4) == [HeadCopy(0, r, range(r, r + 1), range(0, 1)) for r in range(4)]
    one_kv = _cfg(4, 1)                     # one KV head on every rank of degree 4: receivers take turns
    assert [c.source_rank for c in reshard_plan(one_kv, 4, 2)] == [0, 1]
