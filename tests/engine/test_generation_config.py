"""generation_config.json: EOS ids joined with config.json's, sampling defaults for unset fields."""
from __future__ import annotations

import json
import os
import shutil

import pytest

from engine import Engine, EngineArgs, SamplingParams
from engine.sampling.generation_config import GenerationConfig
from proto.pdserve.v1 import generation_pb2


def _model_with(tiny_model_dir: str, tmp_path, gen: dict | None) -> str:
    model_dir = str(tmp_path / "model")
    shutil.copytree(tiny_model_dir, model_dir)
    path = os.path.join(model_dir, "generation_config.json")
    if gen is None:
        os.remove(path)
    else:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(gen, f)
    return model_dir


def test_absent_file_is_an_empty_config(tiny_model_dir, tmp_path):
    model_dir = _model_with(tiny_model_dir, tmp_path, None)
    assert GenerationConfig.from_dir(model_dir) == GenerationConfig()
    engine = Engine(EngineArgs(model_dir, dtype="float32", num_blocks=8, attention="eager"))
    assert engine.eos_token_ids == (1,) and engine.generation_config.sampling_defaults == {}


def test_sampling_defaults_are_the_keys_vllm_takes():
    cfg = GenerationConfig.from_dict({"eos_token_id": 7, "temperature": 0.6, "top_p": 0.9, "top_k": 20,
                                      "repetition_penalty": 1.05, "min_p": 0.01, "max_new_tokens": 64,
                                      "do_sample": True, "presence_penalty": 1.0, "bos_token_id": 0,
                                      "top_a": None})
    assert cfg.eos_token_ids == (7,)
    assert cfg.sampling_defaults == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.05,
                                     "min_p": 0.01, "max_tokens": 64}
    msg = generation_pb2.SamplingParams(top_p=0.5)           # set by the client: wins over the default
    params = SamplingParams.from_proto(msg, defaults=cfg.sampling_defaults)
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (0.6, 0.5, 20, 64)


@pytest.mark.parametrize("raw,said", [
    ({"temperature": -0.5}, "temperature -0.5 cannot be a sampling default (temperature must be"),
    ({"top_p": 1.5}, "top_p 1.5 cannot be a sampling default (top_p must be in (0, 1]"),
    ({"top_k": -1}, "top_k -1 cannot be a sampling default"),
    ({"top_k": "20"}, "top_k '20' cannot be a sampling default"),
    ({"repetition_penalty": 0}, "repetition_penalty 0 cannot be a sampling default"),
    ({"max_new_tokens": 0}, "max_new_tokens 0 cannot be a sampling default (max_tokens"),
    ({"min_p": float("nan")}, "min_p nan cannot be a sampling default")])
def test_a_sampling_default_no_request_could_take_is_refused_at_load(raw, said):
    with pytest.raises(ValueError) as e:
        GenerationConfig.from_dict(raw, source="gen.json")
    assert str(e.value).startswith(f"gen.json: {said}"), str(e.value)


@pytest.mark.parametrize("raw", [{"eos_token_id": "x"}, {"eos_token_id": [1, -2]}, [1, 2]])
def test_bad_eos_ids_are_refused_naming_the_file(raw):
    with pytest.raises(ValueError, match="generation_config.json"):
        GenerationConfig.from_dict(raw)


def test_eos_list_from_generation_config_ends_generation(tiny_model_dir, tmp_path):
    plain = Engine(EngineArgs(tiny_model_dir, dtype="float32", num_blocks=64, attention="eager"))
    base = plain.generate([[5, 6, 7]], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0].token_ids
    extra = base[2]
    assert extra not in base[:2] and extra != 1
    model_dir = _model_with(tiny_model_dir, tmp_path, {"eos_token_id": [1, extra], "max_new_tokens": 8})
    engine = Engine(EngineArgs(model_dir, dtype="float32", num_blocks=64, attention="eager"))
    assert engine.eos_token_ids == (1, extra) and engine.tokenizer.eos_token_ids == (1, extra)
    c = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=8, temperature=0.0))[0]
    assert c.token_ids == base[:3] and c.finish_reason == "stop" and c.matched_stop == extra
    # min_tokens masks every EOS id, the generation_config one too.
    c = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=8, temperature=0.0, min_tokens=3))[0]
    assert extra not in c.token_ids[:3] and 1 not in c.token_ids[:3]
    engine.block_manager.check_no_leaks()


def test_bad_json_is_refused_naming_the_file(tiny_model_dir, tmp_path):
    model_dir = _model_with(tiny_model_dir, tmp_path, {})
    with open(os.path.join(model_dir, "generation_config.json"), "w", encoding="utf-8") as f:
        f.write("{nope")
    with pytest.raises(ValueError, match="generation_config.json: not valid JSON"):
        GenerationConfig.from_dir(model_dir)
