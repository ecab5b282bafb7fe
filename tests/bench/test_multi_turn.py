"""bench.serving.multi_turn: conversations are built turn on turn from the answers the server streams,
and the per-turn table reports shipped and wire bytes against the whole prompt's KV."""
from __future__ import annotations

import asyncio
import math
from types import SimpleNamespace

from bench.serving.cluster import Target
import pytest

from bench.serving.multi_turn import TurnRecord, run_conversations, summarize_turns, tier_overrides, turn_table
from bench.serving.workloads import make_conversations


def test_conversations_are_deterministic_and_shaped():
    a = make_conversations(3, 4, seed=1, scale=0.1)
    assert a == make_conversations(3, 4, seed=1, scale=0.1) and a != make_conversations(3, 4, seed=2, scale=0.1)
    for conv in a:
        assert conv.num_turns == 4 and len(conv.user_messages) == 3
        assert 51 <= len(conv.first_prompt) <= 102 and all(3 <= len(m) <= 13 for m in conv.user_messages)
    assert {n for conv in make_conversations(2, 3, output_len=5) for n in conv.output_lens} == {5}


class FakeClient:
    """Answers each prompt with `output_len` tokens `len(prompt) + i` and records the prompts."""

    def __init__(self):
        self.prompts: list[list[int]] = []

    async def generate(self, *, token_ids, request_id, timeout, max_tokens, **sampling):
        self.prompts.append(list(token_ids))
        for i in range(max_tokens):
            last = i == max_tokens - 1
            yield SimpleNamespace(token_ids=[len(token_ids) + i], finish_reason=1 if last else 0,
                                  usage=SimpleNamespace(cached_prompt_tokens=7),
                                  timing=SimpleNamespace(prefill_s=0.5, kv_transfer_s=0.25))
            await asyncio.sleep(0)


def test_each_turn_is_the_previous_prompt_plus_its_answer_plus_the_new_message():
    conv = make_conversations(1, 3, seed=4, scale=0.05, output_len=3)[0]
    client = FakeClient()
    records = asyncio.run(run_conversations(client, Target("x", "nowhere"), [conv], "t", (16, 1000), 5.0))
    p0 = conv.first_prompt
    p1 = p0 + [len(p0), len(p0) + 1, len(p0) + 2] + conv.user_messages[0]
    p2 = p1 + [len(p1), len(p1) + 1, len(p1) + 2] + conv.user_messages[1]
    assert client.prompts == [p0, p1, p2]
    assert [r.prompt_len for r in records] == [len(p0), len(p1), len(p2)]
    assert [r.full_kv_bytes for r in records] == [-(-len(p) // 16) * 1000 for p in (p0, p1, p2)]
    assert all(r.ok and r.num_output_tokens == 3 and r.cached_prompt_tokens == 7 for r in records)
    assert all((r.prefill_s, r.kv_transfer_s) == (0.5, 0.25) for r in records)
    assert all(math.isnan(r.kv_bytes) for r in records)          # no metrics endpoint: unknown, not 0


def test_turn_rows_average_over_conversations_and_share_the_full_kv():
    records = [TurnRecord(c, k, 100 * (k + 1), 4000 * (k + 1), ok=True, ttft_s=0.01 * (c + 1),
                          cached_prompt_tokens=16 * k, kv_bytes=4000.0 if k == 0 else 400.0,
                          wire_bytes=4000.0 if k == 0 else 400.0) for c in range(2) for k in range(2)]
    rows = summarize_turns(records)
    assert [r["turn"] for r in rows] == [1, 2] and rows[0]["conversations"] == 2
    assert rows[0]["wire_share"] == 1.0 and rows[1]["wire_share"] == 400 / 8000
    assert rows[1]["cached_tokens"] == 16 and math.isclose(rows[1]["ttft_mean_s"], 0.015)
    assert rows[1]["recomputed_tokens"] == 200 - 16 and rows[1]["cached_share"] == 16 / 200
    assert rows[0]["ttft_p90_s"] == pytest.approx(0.02, abs=1e-3)
    text = turn_table({"disaggregated": {"turns": rows}})
    assert "5.0%" in text and "100.0%" in text and "8.0%" in text


def test_interleaved_turns_go_round_robin_and_still_chain():
    convs = make_conversations(3, 2, seed=4, scale=0.05, output_len=2)
    client = FakeClient()
    records = asyncio.run(run_conversations(client, Target("x", "nowhere"), convs, "t", (16, 1000), 5.0,
                                            interleave=True))
    assert [(r.conversation, r.turn) for r in records] == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]
    for i, conv in enumerate(convs):
        p0 = conv.first_prompt
        assert client.prompts[3 + i] == p0 + [len(p0), len(p0) + 1] + conv.user_messages[0]


def test_tier_variants_set_the_tier_list():
    assert tier_overrides("none", 1.0, "/x") == ["kv_cache.tiers=[]"]
    assert tier_overrides("host", 2.0, "/x") == ["kv_cache.tiers=[{kind: host, capacity_gib: 2.0}]"]
    assert tier_overrides("disk", 2.0, "/x") == ["kv_cache.tiers=[{kind: disk, capacity_gib: 2.0, path: /x}]"]
    with pytest.raises(ValueError, match="--tiers"):
        tier_overrides("tape", 1.0, "/x")
