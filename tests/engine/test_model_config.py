"""`ModelConfig` from a config.json: a key of the wrong type or out of range is refused naming the file and the
key (ValueError, which every caller reports as one line), never a traceback deeper in."""
from __future__ import annotations

import json
import re

import pytest

from bench.simulate.models import SHAPES
from engine.model.config import ModelConfig

LLAMA_3_8B = SHAPES["llama-3-8b"]      # model_type llama, 4096 hidden, 32 heads, 8 KV heads, 8192 positions


@pytest.mark.parametrize("changes, said", [
    ({"head_dim": -128}, 'head_dim must be a positive integer (got -128)'),
    ({"head_dim": "128"}, 'head_dim must be a positive integer (got "128")'),
    ({"head_dim": 127.5}, "head_dim must be a positive integer (got 127.5)"),
    ({"head_dim": 127}, "head_dim (127) must leave an even number of rotary dimensions"),
    ({"num_key_value_heads": -8}, "num_key_value_heads must be a positive integer (got -8)"),
    ({"num_key_value_heads": "8"}, 'num_key_value_heads must be a positive integer (got "8")'),
    ({"num_key_value_heads": 8.0}, "num_key_value_heads must be a positive integer (got 8.0)"),
    ({"num_key_value_heads": 0}, "num_key_value_heads must be a positive integer (got 0)"),
    ({"num_key_value_heads": 5}, "num_attention_heads (32) must be a multiple of num_key_value_heads (5)"),
    ({"max_position_embeddings": "8192"}, 'max_position_embeddings must be a positive integer (got "8192")'),
    ({"max_position_embeddings": 0}, "max_position_embeddings must be a positive integer (got 0)"),
    ({"hidden_size": 16}, "hidden_size (16) must be a multiple of num_attention_heads (32) when head_dim is absent"),
    ({"vocab_size": True}, "vocab_size must be a positive integer (got true)"),
    ({"vocab_size": None}, "vocab_size must be a positive integer (got null)"),
    ({"rope_scaling": "x"}, 'rope_scaling must be an object or null (got "x")'),
    ({"rope_scaling": {"rope_type": "llama3"}}, "rope_scaling.factor must be a positive number (missing)"),
    ({"rope_scaling": {"rope_type": "linear", "factor": "2"}}, 'rope_scaling.factor must be a positive number'),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 4.0}},
     "rope_scaling.high_freq_factor (4) must be above low_freq_factor (4)"),
    ({"rope_parameters": [1]}, "rope_parameters must be an object or null (got [1])"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 0}}, "rope_parameters.factor must be a positive number"),
    ({"rope_theta": "500000"}, 'rope_theta must be a positive number (got "500000")'),
    ({"rope_theta": float("inf")}, "rope_theta must be a positive number (got Infinity)"),
    ({"rms_norm_eps": -1e-5}, "rms_norm_eps must be a positive number (got -1e-05)"),
    ({"model_type": "phi3", "partial_rotary_factor": "half"}, 'partial_rotary_factor must be a positive number'),
    ({"tie_word_embeddings": "false"}, 'tie_word_embeddings must be true or false (got "false")'),
    ({"eos_token_id": [1, "2"]}, 'eos_token_id must be a token id or a list of them (got [1, "2"])'),
    ({"bos_token_id": -1}, "bos_token_id must be a token id or null (got -1)"),
    ({"torch_dtype": 16}, "torch_dtype must be a dtype name (got 16)"),
    ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 64, "max_window_layers": "2"},
     'max_window_layers must be an integer of at least 0 (got "2")'),
])
def test_a_bad_field_is_refused_naming_the_file_and_the_key(changes, said, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA_3_8B, **changes}))
    with pytest.raises(ValueError) as refused:
        ModelConfig.from_dir(str(tmp_path))
    assert str(refused.value).startswith(f"{tmp_path / 'config.json'}: {said}")


@pytest.mark.parametrize("content, said", [
    ("[1]", "must be a JSON object of config fields (got [1])"),
    ('"llama"', 'must be a JSON object of config fields (got "llama")'),
    ("{", "not valid JSON"),
])
def test_a_config_that_is_not_a_json_object_is_refused(content, said, tmp_path):
    (tmp_path / "config.json").write_text(content)
    with pytest.raises(ValueError, match="^" + re.escape(f"{tmp_path / 'config.json'}: {said}")):
        ModelConfig.from_dir(str(tmp_path))


def test_absent_or_null_optional_fields_take_their_defaults():
    cfg = ModelConfig.from_dict({**LLAMA_3_8B, "num_key_value_heads": None, "head_dim": None,
                                 "rope_scaling": None, "bos_token_id": None, "max_position_embeddings": None})
    assert (cfg.num_key_value_heads, cfg.head_dim, cfg.max_position_embeddings) == (32, 128, 2048)
    scaled = ModelConfig.from_dict({**LLAMA_3_8B, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}})
    assert scaled.rope_scaling["factor"] == 8.0 and scaled.head_dim == 128 and scaled.num_key_value_heads == 8


def test_simulate_refuses_a_bad_config_with_exit_2(tmp_path, capsys):
    from bench.simulate import cli
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA_3_8B, "num_key_value_heads": "8"}))
    argv = ["--jobs", "1", "--hardware", "H100-SXM", "--model", str(tmp_path), "--workload", "chat",
            "--num-requests", "4"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.strip() == f'error: {tmp_path / "config.json"}: num_key_value_heads must be a positive integer (got "8")'


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3", "phi3"])
def test_absent_keys_mean_what_transformers_config_class_says(model_type):
    """A hand-written config.json without num_key_value_heads, max_position_embeddings, rms_norm_eps or head_dim
    reads as the architecture's transformers config class reads it (Mistral: 8 KV heads; Qwen3: head_dim 128;
    Phi-3: eps 1e-5)."""
    transformers = pytest.importorskip("transformers")
    raw = {"vocab_size": 1000, "hidden_size": 1024, "intermediate_size": 2048, "num_hidden_layers": 2,
           "num_attention_heads": 32}
    ours = ModelConfig.from_dict({"model_type": model_type, **raw})
    theirs = transformers.AutoConfig.for_model(model_type, **raw)
    head_dim = getattr(theirs, "head_dim", None) or raw["hidden_size"] // raw["num_attention_heads"]
    assert (ours.num_key_value_heads, ours.max_position_embeddings, ours.rms_norm_eps, ours.head_dim) == \
        (theirs.num_key_value_heads, theirs.max_position_embeddings, theirs.rms_norm_eps, head_dim)
