"""Short runs after a cached prefix (speculative decoding's 1 + k tokens) attend in one padded batch:
the same output as attending run by run through the prefill path, with and without a sliding window,
beside decode tokens and a prefill in the same step."""
from __future__ import annotations

import pytest
import torch

from engine.model import attention
from engine.model.attention import build_metadata, paged_attention

BLOCK, HKV, HQ, D = 4, 2, 4, 8


@pytest.mark.parametrize("window", [None, 6])
def test_batched_runs_equal_run_by_run(monkeypatch, window):
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(40, 2, HKV, BLOCK, D, generator=g)
    # (start, num_new, table): runs of 3 and 5 tokens, a decode token, a fresh prompt, a run of 2
    seqs = [(9, 3, [0, 1, 2]), (14, 5, [3, 4, 5, 6, 7]), (6, 1, [8, 9]), (0, 7, [10, 11]), (3, 2, [12, 13])]
    num_tokens = sum(n for _, n, _ in seqs)
    q = torch.randn(num_tokens, HQ, D, generator=g)
    k, v = torch.randn(2, num_tokens, HKV, D, generator=g)
    batched = build_metadata(seqs, BLOCK, torch.device("cpu"), sliding_window=window)
    assert batched.multi_rows is not None and len(batched.prefills) == 1
    got = paged_attention(q, k, v, cache.clone(), batched, 0.3)
    monkeypatch.setattr(attention, "MULTI_MAX_TOKENS", 0)           # every run through the prefill path
    single = build_metadata(seqs, BLOCK, torch.device("cpu"), sliding_window=window)
    assert single.multi_rows is None and len(single.prefills) == 4
    torch.testing.assert_close(got, paged_attention(q, k, v, cache.clone(), single, 0.3), atol=1e-5, rtol=1e-5)
