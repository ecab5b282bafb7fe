"""Every bad request raises ValueError naming the field; the engine keeps serving."""
from __future__ import annotations

import math

import pytest

from engine import Engine, EngineArgs, SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return Engine(EngineArgs(tiny_model_dir, dtype="float32", num_blocks=64, max_model_len=256))


BAD = [
    ([], {}, "prompt"),
    ("", {}, "prompt"),
    ([5, 99999], {}, "prompt_token_ids"),
    ([5, -1], {}, "prompt_token_ids"),
    ([5] * 250, {"max_tokens": 10}, "max_tokens"),
    ([5], {"max_tokens": 0}, "max_tokens"),
    ([5], {"max_tokens": -3}, "max_tokens"),
    ([5], {"temperature": -0.1}, "temperature"),
    ([5], {"temperature": math.nan}, "temperature"),
    ([5], {"temperature": math.inf}, "temperature"),
    ([5], {"top_p": 0.0}, "top_p"),
    ([5], {"top_p": 1.5}, "top_p"),
    ([5], {"top_p": math.nan}, "top_p"),
    ([5], {"top_k": -1}, "top_k"),
    ([5], {"repetition_penalty": 0.0}, "repetition_penalty"),
    ([5], {"repetition_penalty": 3.0}, "repetition_penalty"),
    ([5], {"frequency_penalty": 2.5}, "frequency_penalty"),
    ([5], {"presence_penalty": -2.5}, "presence_penalty"),
    ([5], {"presence_penalty": math.nan}, "presence_penalty"),
    ([5], {"seed": -1}, "seed"),
    ([5], {"stop": [""]}, "stop"),
    ([5], {"stop": ["x"] * 17}, "stop"),
    ([5], {"stop": ["x" * 300]}, "stop"),
]


@pytest.mark.parametrize("prompt,kwargs,field", BAD, ids=[f"{b[2]}-{i}" for i, b in enumerate(BAD)])
def test_bad_input_names_field(engine, prompt, kwargs, field):
    with pytest.raises(ValueError, match=field):
        engine.add_request(prompt, SamplingParams(**kwargs))
    assert not engine.has_unfinished() and not engine.requests
    engine.block_manager.check_no_leaks()
    out = engine.generate([[5, 6]], SamplingParams(max_tokens=2, temperature=0.0))[0]
    assert len(out.token_ids) >= 1


def test_duplicate_request_id_rejected(engine):
    engine.add_request([5, 6], SamplingParams(max_tokens=2), request_id="dup")
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request([5, 6], SamplingParams(max_tokens=2), request_id="dup")
    engine.abort("dup")
    engine.block_manager.check_no_leaks()


def test_missing_files_and_unsupported_arch_are_named(tmp_path, tiny_model_dir):
    import json
    import shutil
    with pytest.raises(ValueError, match="neither a directory nor a preset"):
        Engine(EngineArgs("no-such-model"))
    d = tmp_path / "m"
    shutil.copytree(tiny_model_dir, d)
    (d / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Engine(EngineArgs(str(d)))
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="model_type 'gpt2'"):
        Engine(EngineArgs(str(d)))
    (d / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        Engine(EngineArgs(str(d)))
