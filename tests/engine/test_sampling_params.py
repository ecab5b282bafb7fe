"""Divisors of the sampler (temperature, repetition_penalty) have a floor:
a positive denormal would divide the logits to inf and the softmax to NaN."""
from __future__ import annotations

import math

import pytest
import torch

from engine import Engine, EngineArgs, SamplingParams
from engine.scheduling.request import Request
from engine.sampling.sampler import apply_penalties, top_k_top_p_probs
from engine.sampling.params import MIN_REPETITION_PENALTY, MIN_TEMPERATURE

DENORMAL = 1e-45          # float32 rounds it to 1.4e-45, the smallest positive denormal


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return Engine(EngineArgs(tiny_model_dir, dtype="float32", num_blocks=64, max_model_len=256))


@pytest.mark.parametrize("field,value", [
    ("temperature", DENORMAL), ("temperature", 5e-324), ("temperature", MIN_TEMPERATURE / 2),
    ("repetition_penalty", DENORMAL), ("repetition_penalty", MIN_REPETITION_PENALTY / 2),
])
def test_tiny_divisor_is_refused_naming_the_field_and_its_floor(engine, field, value):
    floor = {"temperature": MIN_TEMPERATURE, "repetition_penalty": MIN_REPETITION_PENALTY}[field]
    with pytest.raises(ValueError, match=rf"^{field} must be .*{floor:g}.*got {value}$"):
        SamplingParams(**{field: value}).validate()
    with pytest.raises(ValueError, match=field):
        engine.add_request([5, 6], SamplingParams(**{field: value}))
    assert not engine.requests
    engine.block_manager.check_no_leaks()


def test_the_floors_and_greedy_are_accepted():
    SamplingParams(temperature=0.0).validate()
    SamplingParams(temperature=MIN_TEMPERATURE, repetition_penalty=MIN_REPETITION_PENALTY).validate()


def test_sampler_stays_finite_at_the_floors():
    """Logits far beyond a real model's, divided by both floors, still give a proper distribution."""
    logits = torch.linspace(-1e4, 1e4, 512)
    params = SamplingParams(temperature=MIN_TEMPERATURE, repetition_penalty=MIN_REPETITION_PENALTY)
    req = Request("r", list(range(512)), params, seed=1)
    probs = top_k_top_p_probs(apply_penalties(logits.clone(), req), params.temperature, 0, 0.9)
    assert torch.isfinite(probs).all()
    assert math.isclose(float(probs.sum()), 1.0, rel_tol=1e-5)
    assert int(probs.argmax()) == 511


def test_what_the_old_floor_let_through_was_nan():
    """Why the floor exists: dividing by a denormal turns the softmax into NaN."""
    probs = top_k_top_p_probs(torch.tensor([1.0, 2.0, 3.0]), DENORMAL, 0, 1.0)
    assert torch.isnan(probs).any()


def test_generation_at_the_floors_is_finite_and_matches_greedy(engine):
    prompt = [5, 6, 7, 8]
    coldest = SamplingParams(max_tokens=8, temperature=MIN_TEMPERATURE, repetition_penalty=MIN_REPETITION_PENALTY,
                             seed=3, ignore_eos=True)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, repetition_penalty=MIN_REPETITION_PENALTY, ignore_eos=True)
    [cold], [hot] = engine.generate([prompt], coldest), engine.generate([prompt], greedy)
    assert cold.token_ids == hot.token_ids and len(cold.token_ids) == 8
    engine.block_manager.check_no_leaks()
