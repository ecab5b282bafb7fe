"""The sampling fields: validation naming the field, proto round trip, defaults for unset fields."""
from __future__ import annotations

import pytest

from engine.kv_cache.block_manager import blocks_needed
from engine.sampling.params import SamplingParams
from proto.pdserve.v1 import generation_pb2

FULL = SamplingParams(max_tokens=40, temperature=0.75, top_p=0.875, top_k=5, repetition_penalty=1.125,
                      frequency_penalty=0.5, presence_penalty=-0.5, seed=3, stop=("x",), ignore_eos=True,
                      min_p=0.25, min_tokens=4, stop_token_ids=(7, 9), logit_bias={3: 100.0, 4: -100.0},
                      include_stop_str_in_output=True, skip_special_tokens=False, logprobs=5, prompt_logprobs=0,
                      n=2, best_of=3)


def test_proto_round_trip_keeps_every_field():
    msg = FULL.to_proto()
    assert SamplingParams.from_proto(generation_pb2.SamplingParams.FromString(msg.SerializeToString())) == FULL
    for name in ("min_p", "min_tokens", "skip_special_tokens", "logprobs", "prompt_logprobs", "n", "best_of"):
        assert msg.HasField(name), name
    assert SamplingParams.from_proto(SamplingParams().to_proto()) == SamplingParams()


def test_unset_fields_take_the_given_defaults_then_the_class_defaults():
    msg = generation_pb2.SamplingParams(top_p=0.5)
    params = SamplingParams.from_proto(msg, defaults={"temperature": 0.25, "top_p": 0.1, "min_p": 0.5,
                                                      "max_tokens": 77})
    assert (params.temperature, params.top_p, params.min_p, params.max_tokens) == (0.25, 0.5, 0.5, 77)
    assert params.top_k == 0 and params.n == 1 and params.logprobs is None


def test_num_sequences_and_needs_logprobs():
    assert SamplingParams().num_sequences == 1 and not SamplingParams().needs_logprobs
    assert SamplingParams(n=3).num_sequences == 3 and not SamplingParams(n=3).needs_logprobs
    assert SamplingParams(n=2, best_of=5).num_sequences == 5 and SamplingParams(n=2, best_of=5).needs_logprobs
    assert SamplingParams(n=2, best_of=2).needs_logprobs is False
    assert SamplingParams(logprobs=0).needs_logprobs


@pytest.mark.parametrize("kwargs,field", [
    (dict(min_p=-0.1), "min_p"), (dict(min_p=1.5), "min_p"), (dict(min_p=float("nan")), "min_p"),
    (dict(min_tokens=-1), "min_tokens"), (dict(min_tokens=17, max_tokens=16), "min_tokens"),
    (dict(stop_token_ids=tuple(range(65))), "stop_token_ids"), (dict(stop_token_ids=(-1,)), "stop_token_ids"),
    (dict(logit_bias={i: 1.0 for i in range(1025)}), "logit_bias"), (dict(logit_bias={1: 100.5}), "logit_bias"),
    (dict(logit_bias={1: float("inf")}), "logit_bias"), (dict(logit_bias={-2: 1.0}), "logit_bias"),
    (dict(logprobs=21), "logprobs"), (dict(logprobs=-1), "logprobs"), (dict(prompt_logprobs=21), "prompt_logprobs"),
    (dict(n=0), "n"), (dict(n=65), "n"), (dict(n=3, best_of=2), "best_of"), (dict(best_of=65), "best_of"),
    (dict(skip_special_tokens="yes"), "skip_special_tokens"),
])
def test_bad_values_are_refused_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field}"):
        SamplingParams(**kwargs).validate()


def test_the_bounds_are_accepted():
    SamplingParams(min_p=1.0, min_tokens=16, max_tokens=16, stop_token_ids=tuple(range(64)),
                   logit_bias={i: (-100.0 if i % 2 else 100.0) for i in range(1024)}, logprobs=20,
                   prompt_logprobs=20, n=64, best_of=64).validate()
    SamplingParams(logprobs=0, prompt_logprobs=0, n=1, best_of=None).validate()


def test_engine_checks_token_ids_against_the_vocabulary(tiny_model_dir):
    from engine import Engine, EngineArgs
    engine = Engine(EngineArgs(tiny_model_dir, dtype="float32", num_blocks=16, attention="eager"))
    for kwargs, field in [(dict(stop_token_ids=(engine.vocab_size,)), "stop_token_ids"),
                          (dict(logit_bias={engine.vocab_size + 5: 1.0}), "logit_bias")]:
        with pytest.raises(ValueError, match=rf"^{field}.*vocabulary"):
            engine.add_request([5, 6], SamplingParams(**kwargs))
    assert not engine.requests


@pytest.mark.parametrize("prompt,max_tokens,k,expected", [
    (32, 16, 1, 3),           # ceil(48 / 16): n = 1 as before
    (30, 16, 1, 3),           # ceil(46 / 16)
    (30, 16, 4, 3 + 3 * 2),   # each extra sequence: its copy of the partial block + its output's block
    (32, 16, 4, 3 + 3 * 1),   # no partial block: only the output's block
    (5, 3, 2, 1 + 1),
])
def test_blocks_needed(prompt, max_tokens, k, expected):
    assert blocks_needed(prompt, max_tokens, k, 16) == expected
