"""Sampler order and masks on crafted logits; seeded reproducibility."""
from __future__ import annotations

import math

import pytest
import torch

from engine import Engine, EngineArgs, SamplingParams
from engine.scheduling.request import Request
from engine.sampling.sampler import apply_penalties, sample, top_k_top_p_probs


def _req(params: SamplingParams, prompt=(1,), output=()) -> Request:
    r = Request("r", list(prompt), params, seed=params.seed or 0)
    r.output_token_ids = list(output)
    return r


def test_top_k_keeps_exactly_k():
    logits = torch.tensor([1.0, 5.0, 3.0, 4.0, 2.0])
    probs = top_k_top_p_probs(logits, 1.0, 2, 1.0)
    assert (probs > 0).tolist() == [False, True, False, True, False]
    assert math.isclose(probs.sum().item(), 1.0, rel_tol=1e-6)


def test_top_p_keeps_smallest_set_reaching_p():
    probs_in = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs_in.log()
    kept = top_k_top_p_probs(logits, 1.0, 0, 0.8) > 0
    assert kept.tolist() == [True, True, False, False]
    kept = top_k_top_p_probs(logits, 1.0, 0, 0.81) > 0
    assert kept.tolist() == [True, True, True, False]
    kept = top_k_top_p_probs(logits, 1.0, 0, 0.1) > 0    # the top token always survives
    assert kept.tolist() == [True, False, False, False]


def test_temperature_applies_before_top_p():
    logits = torch.tensor([2.0, 1.0, 0.0])
    hot = top_k_top_p_probs(logits, 10.0, 0, 0.5) > 0     # flat: needs two tokens to reach 0.5
    cold = top_k_top_p_probs(logits, 0.1, 0, 0.5) > 0     # peaked: one token is enough
    assert hot.tolist() == [True, True, False] and cold.tolist() == [True, False, False]


def test_penalties_exact_values_and_order():
    logits = torch.tensor([2.0, -2.0, 1.0, 0.5])
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    out = apply_penalties(logits.clone(), _req(params, prompt=[0], output=[1, 2, 2]))
    # token 0: prompt only -> 2/2 = 1; token 1: -2*2 - 0.5 - 0.25; token 2: 1/2 - 1.0 - 0.25
    assert out.tolist() == pytest.approx([1.0, -4.75, -0.75, 0.5])


def test_greedy_with_penalty_changes_pick():
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    assert sample(logits, [_req(SamplingParams(temperature=0.0))]) == [0]
    penalized = _req(SamplingParams(temperature=0.0, presence_penalty=1.0), output=[0])
    assert sample(logits, [penalized]) == [1]


def test_seeded_draw_reproducible_and_seed_sensitive(tiny_model_dir):
    engine = Engine(EngineArgs(tiny_model_dir, dtype="float32", num_blocks=128))
    p = [5, 6, 7, 8]
    a = engine.generate([p], SamplingParams(max_tokens=24, temperature=1.0, seed=11, ignore_eos=True))[0]
    b = engine.generate([p, [9, 9]], [SamplingParams(max_tokens=24, temperature=1.0, seed=11, ignore_eos=True),
                                      SamplingParams(max_tokens=5, temperature=1.0, seed=3)])[0]
    c = engine.generate([p], SamplingParams(max_tokens=24, temperature=1.0, seed=12, ignore_eos=True))[0]
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_sampling_distribution_follows_probabilities():
    logits = torch.tensor([0.0, math.log(3.0)])          # p = [0.25, 0.75]
    picks = [sample(logits[None].clone(), [_req(SamplingParams(temperature=1.0, seed=s))])[0]
             for s in range(1, 801)]
    assert 0.70 < sum(picks) / len(picks) < 0.80
