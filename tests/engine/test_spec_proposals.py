"""n-gram proposals, the per-step turn-down, and the speculative settings' checks."""
from __future__ import annotations

import pytest
import torch

from engine.spec.config import SpecConfig
from engine.spec.ngram import NgramIndex, propose_ngram
from engine.spec.turn_down import PROBE_EVERY, PROBE_EVERY_MOST, TRIES, WARMUP, WINDOW, TurnDown


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


def test_turn_down_tries_every_k_then_keeps_the_fastest_and_probes_the_others():
    explore = WARMUP + TRIES * 5
    cheap = _run(TurnDown(4), 1, lambda k: 0.010, lambda k: 1 + 0.6 * k, explore + 3 * PROBE_EVERY + 1)
    assert cheap[:explore] == [0] * WARMUP + [4, 3, 2, 1, 0] * TRIES    # warm-up, every k interleaved, the best
    # the k measured longest ago, the gap doubling while the probes lose
    assert cheap[explore:] == [4] * PROBE_EVERY + [3] + [4] * (2 * PROBE_EVERY - 1) + [2]
    costly = _run(TurnDown(4), 32, lambda k: 0.004 * (1 + k), lambda k: 1 + 0.4 * k, explore + 3 * PROBE_EVERY + 1)
    assert costly[explore:] == [0] * PROBE_EVERY + [4] + [0] * (2 * PROBE_EVERY - 1) + [3]   # off
    settled = _run(TurnDown(4), 32, lambda k: 0.004 * (1 + k), lambda k: 1 + 0.4 * k, explore + 4096)
    assert 0 < sum(k != 0 for k in settled[explore:]) <= 4096 // PROBE_EVERY_MOST + 4
    middle = _run(TurnDown(4), 8, lambda k: 0.01 + 0.002 * k * k, lambda k: 1 + 0.5 * k, explore + PROBE_EVERY)
    assert middle[explore:explore + PROBE_EVERY - 1] == [1] * (PROBE_EVERY - 1)   # 125 tok/s against 100, 111, 89, 62


def test_a_one_off_stall_does_not_rule_a_k_out():
    """The first measured step without proposals stalls (a host pause): k = 0 is still chosen."""
    calls = {0: 0}

    def seconds(k):
        calls[k] = calls.get(k, 0) + 1
        return 0.050 if k == 0 and calls[0] == WARMUP + 1 else 0.004 * (1 + k)
    ks = _run(TurnDown(4), 32, seconds, lambda k: 1 + 0.4 * k, WARMUP + 5 * TRIES + PROBE_EVERY)
    assert ks[WARMUP + 5 * TRIES:WARMUP + 5 * TRIES + PROBE_EVERY - 1] == [0] * (PROBE_EVERY - 1)


def test_a_fall_in_acceptance_turns_speculation_off():
    """Proposals that stop being accepted: each k's rate falls as it runs, and k reaches 0 within a few windows."""
    turn, good = TurnDown(4), [True]
    _run(turn, 1, lambda k: 0.010 * (1 + 0.1 * k), lambda k: 1 + 0.8 * k if good[0] else 1, WARMUP + 5 * TRIES + 4)
    assert turn.num_tokens(1) == 4
    turn.observe_step(1, 0.010)
    good[0] = False
    ks = _run(turn, 1, lambda k: 0.010 * (1 + 0.1 * k), lambda k: 1 + 0.8 * k if good[0] else 1, 20 * WINDOW)
    later = ks[5 * WINDOW:]
    assert sum(k != 0 for k in later) <= len(later) // PROBE_EVERY + 1     # off, but for the probes


def test_buckets_are_measured_apart_and_a_fixed_k_is_never_turned_down():
    turn = TurnDown(2)
    assert _run(turn, 1, lambda k: 0.01, lambda k: 1 + k, WARMUP + 3) == [0] * WARMUP + [2, 1, 0]
    assert _run(turn, 16, lambda k: 0.01, lambda k: 1 + k, WARMUP + 1) == [0] * WARMUP + [2]   # its own bucket
    assert (5, 1) not in turn.samples and len(turn.samples[1, 1]) == 1
    assert _run(TurnDown(4, adaptive=False), 64, lambda k: 1.0, lambda k: 1.0, 3) == [4, 4, 4]


@pytest.mark.parametrize("kw, key", [({"num_tokens": 0}, "speculative.num_tokens"),
                                     ({"method": "eagle"}, "speculative.method"),
                                     ({"ngram_min": 0}, "speculative.ngram.min"),
                                     ({"ngram_min": 3, "ngram_max": 2}, "speculative.ngram.max")])
def test_bad_settings_name_their_key(kw, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        SpecConfig(**{"method": "ngram", **kw}).validate()
