"""n-gram proposals, the per-step turn-down, and the speculative settings' checks."""
from __future__ import annotations

import pytest
import torch

from engine.spec.config import SpecConfig
from engine.spec.ngram import NgramIndex, propose_ngram
from engine.spec.turn_down import PROBE_EVERY, TurnDown


def test_ngram_proposes_after_the_latest_longest_match():
    tokens = [5, 6, 7, 8, 9, 1, 6, 7, 2, 3, 6, 7]
    assert propose_ngram(tokens, 3, 1, 3) == [2, 3, 6]          # "6 7" last seen before "2 3"
    assert propose_ngram(tokens, 3, 3, 3) == []                 # "3 6 7" never seen before
    assert propose_ngram([1, 2, 3, 1, 2, 3, 1, 2], 4, 1, 3) == [3, 1, 2]   # what follows stops at the end
    assert propose_ngram([4, 4], 2, 1, 2) == [4]
    assert propose_ngram([1, 2, 3], 2, 1, 2) == []
    assert propose_ngram([1, 2, 1], 0, 1, 2) == []


def test_the_incremental_index_proposes_what_a_fresh_scan_finds():
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 6, (300,), generator=g).tolist()      # a small vocabulary: many repeats
    index = NgramIndex(1, 3)
    for length in range(1, 300, 3):                                 # growing by several tokens per call
        prefix = tokens[:length]
        expected = next((prefix[i + n:i + n + 4] for n in (3, 2, 1) if length > n
                         for i in range(length - n - 1, -1, -1) if prefix[i:i + n] == prefix[length - n:]), [])
        assert index.propose(prefix, 4) == expected == propose_ngram(prefix, 4, 1, 3)


def _measured(fixed: float, per_token: float, acceptance: float) -> TurnDown:
    turn = TurnDown(4)
    for tokens in (8, 16, 24, 40, 8, 32):
        turn.observe_step(tokens, fixed + per_token * tokens)
    turn.observe_verified(1000, int(1000 * acceptance))
    return turn


def test_turn_down_keeps_k_while_steps_cost_the_same_and_drops_it_when_tokens_cost():
    assert _measured(0.010, 0.0, 0.6).num_tokens(8) == 4            # bandwidth-bound: every proposal is free
    assert _measured(0.001, 0.001, 0.6).num_tokens(32) == 0          # compute-bound: 5x tokens for 2.3x output
    assert _measured(0.010, 0.0001, 0.9).num_tokens(1) == 4
    low = _measured(0.010, 0.0005, 0.05)
    ks = [low.num_tokens(8) for _ in range(PROBE_EVERY)]
    assert ks[:-1] == [0] * (PROBE_EVERY - 1) and ks[-1] == 1       # and probes now and then
    assert TurnDown(4, adaptive=False).num_tokens(64) == 4


@pytest.mark.parametrize("kw, key", [({"num_tokens": 0}, "speculative.num_tokens"),
                                     ({"method": "eagle"}, "speculative.method"),
                                     ({"ngram_min": 0}, "speculative.ngram.min"),
                                     ({"ngram_min": 3, "ngram_max": 2}, "speculative.ngram.max")])
def test_bad_settings_name_their_key(kw, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        SpecConfig(**{"method": "ngram", **kw}).validate()
