"""bench.serving.kv_routing on a tiny workload: one conversation at a time, every turn after the first
hits exactly its previous prompt's full blocks on the prefill actor the index picks, the oracle agrees
at every dispatch, and the index equals the engines' caches afterwards."""
from __future__ import annotations

import asyncio
import random

from bench.serving.kv_routing import make_workload, multi_turn, run_once, table


def test_multi_turn_hits_follow_the_index_exactly(tiny_model_dir):
    conversations = multi_turn(random.Random(0), num_conversations=2, num_turns=3)
    res = asyncio.run(run_once(conversations, "multi-turn", "index", tiny_model_dir, concurrency=1,
                               interval_s=0.2))
    # prompts 160, 208, 256 tokens: turn 2 hits the 160-token opener, turn 3 the 208-token prompt (13 blocks)
    assert (res.requests, res.prompt_tokens) == (6, 2 * (160 + 208 + 256))
    assert res.cached_tokens == 2 * (160 + 208)
    assert res.dispatch_chosen_tokens == res.dispatch_oracle_tokens == res.cached_tokens
    assert res.index_equals_caches and res.resyncs == 0


def test_workloads_are_deterministic_and_the_table_prints():
    a, b = make_workload("shared-prefix", 1), make_workload("shared-prefix", 1)
    assert [c.messages for c in a] == [c.messages for c in b] and len(a) == 48
    assert len({tuple(c.messages[0][:384]) for c in a}) == 6
    row = {"workload": "w", "requests": 1, "prompt_tokens": 2, "dispatch_index_hit_rate": 0.5,
           "dispatch_oracle_hit_rate": 0.5, "dispatch_ratio": 1.0, "index_hit_rate": 0.5, "oracle_hit_rate": 0.5,
           "ratio": 1.0, "blind_hit_rate": 0.25, "index_equals_caches": True, "resyncs": 0}
    line = "w | 1 | 2 | 50.0% | 50.0% | 100.0% | 50.0% | 50.0% | 100.0% | 25.0% | True | 0"
    assert table([row]).splitlines()[2] == line
