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


def _run(turn: TurnDown, num_seqs: int, seconds_per_step, tokens_per_seq, steps: int) -> list[int]:
    """Drive the turn-down: each step with k proposals yields num_seqs * tokens_per_seq(k) tokens and
    takes seconds_per_step(k). Returns the k of every step."""
    ks = []
    for _ in range(steps):
        k = turn.num_tokens(num_seqs)
        ks.append(k)
        turn.observe_step(int(num_seqs * tokens_per_seq(k)), seconds_per_step(k))
    return ks


def test_turn_down_tries_every_k_then_keeps_the_fastest_and_probes_its_neighbours():
    cheap = _run(TurnDown(4), 1, lambda k: 0.010, lambda k: 1 + 0.6 * k, 5 + 2 * PROBE_EVERY)
    assert cheap[:5] == [4, 3, 2, 1, 0]                             # one try each, then the best
    assert cheap[5:] == ([4] * (PROBE_EVERY - 1) + [3]) * 2          # a probe below the top
    costly = _run(TurnDown(4), 32, lambda k: 0.004 * (1 + k), lambda k: 1 + 0.4 * k, 5 + 2 * PROBE_EVERY)
    assert costly[5:] == ([0] * (PROBE_EVERY - 1) + [1]) * 2         # off, probing k = 1 now and then
    middle = _run(TurnDown(4), 8, lambda k: 0.01 + 0.002 * k * k, lambda k: 1 + 0.5 * k, 5 + PROBE_EVERY)
    assert middle[5:5 + PROBE_EVERY - 1] == [1] * (PROBE_EVERY - 1)         # 125 tok/s against 100, 111, 89, 62


def test_buckets_are_measured_apart_and_a_fixed_k_is_never_turned_down():
    turn = TurnDown(2)
    _run(turn, 1, lambda k: 0.01, lambda k: 1 + k, 3)
    assert turn.num_tokens(16) == 2 and (5, 2) not in turn.samples     # batch 16: its own bucket, untried
    assert _run(TurnDown(4, adaptive=False), 64, lambda k: 1.0, lambda k: 1.0, 3) == [4, 4, 4]


@pytest.mark.parametrize("kw, key", [({"num_tokens": 0}, "speculative.num_tokens"),
                                     ({"method": "eagle"}, "speculative.method"),
                                     ({"ngram_min": 0}, "speculative.ngram.min"),
                                     ({"ngram_min": 3, "ngram_max": 2}, "speculative.ngram.max")])
def test_bad_settings_name_their_key(kw, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        SpecConfig(**{"method": "ngram", **kw}).validate()
