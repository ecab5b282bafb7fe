"""The model section's preset names (deploy/config/model.py)."""
from __future__ import annotations

import pytest

from deploy.config import PRESET_MODELS


def test_presets_match_the_engine():
    presets = pytest.importorskip("engine.model.presets")
    assert set(PRESET_MODELS) <= set(presets.PRESETS) | set(presets.TRAINED)


def test_weight_layout_reaches_cpu_actors_and_a_wrong_one_names_the_key():
    """model.weight_layout: CPU pools' engines get it; a GPU pool keeps its own (row-major) choice; an
    unknown layout fails at load with the key's path and the choices."""
    from deploy.config import ConfigError, load_config
    from deploy.launcher import engine_args
    from engine.model.linear import LAYOUTS
    from engine.model.presets import resolve_model
    model_dir = resolve_model("tiny")
    assert engine_args(load_config(None, {}), "decode", model_dir).weight_layout == "auto"
    for layout in LAYOUTS:
        cfg = load_config(None, {"model.weight_layout": layout, "pools.prefill.resources.num_gpus": 1})
        assert engine_args(cfg, "decode", model_dir).weight_layout == layout
        assert engine_args(cfg, "prefill", model_dir).weight_layout == "auto"
    with pytest.raises(ConfigError, match=r"model\.weight_layout.*onednn-packed"):
        load_config(None, {"model.weight_layout": "sideways"})


def test_quantization_reaches_each_pool_with_its_override_and_a_wrong_one_names_the_key():
    """model.quantization / quantization_group_size reach every pool's engine; a pool's override wins for
    that pool only (int4 decode beside an unquantized prefill); bad values fail with the key's path."""
    from deploy.config import ConfigError, load_config
    from deploy.launcher import engine_args
    from engine.model.presets import resolve_model
    model_dir = resolve_model("tiny")
    default = engine_args(load_config(None, {}), "decode", model_dir)
    assert (default.quantization, default.quantization_group_size) == ("none", 128)
    cfg = load_config(None, {"model.quantization": "int8", "pools.decode.quantization": "int4",
                             "pools.decode.quantization_group_size": 64})
    prefill, decode = engine_args(cfg, "prefill", model_dir), engine_args(cfg, "decode", model_dir)
    assert (prefill.quantization, prefill.quantization_group_size) == ("int8", 128)
    assert (decode.quantization, decode.quantization_group_size) == ("int4", 64)
    assert cfg.pool_quantization("decode") == ("int4", 64, "pools.decode.quantization")
    assert cfg.pool_quantization("prefill") == ("int8", 128, "model.quantization")
    with pytest.raises(ConfigError, match=r"model\.quantization.*int4"):
        load_config(None, {"model.quantization": "int3"})
    with pytest.raises(ConfigError, match=r"pools\.decode\.quantization_group_size"):
        load_config(None, {"pools.decode.quantization_group_size": 48})


def test_int8_on_a_4bit_checkpoint_is_refused_naming_the_key_that_asked(tmp_path):
    import json
    import shutil

    from deploy.config import ConfigError, load_config
    from deploy.launcher import engine_args
    from engine.model.presets import resolve_model
    model_dir = str(tmp_path / "gptq")
    shutil.copytree(resolve_model("tiny"), model_dir)
    path = tmp_path / "gptq" / "config.json"
    raw = json.loads(path.read_text())
    raw["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False}
    path.write_text(json.dumps(raw))
    cfg = load_config(None, {"model.name": model_dir, "pools.decode.quantization": "int8"})
    assert engine_args(cfg, "prefill", model_dir).quantization == "none"        # served int4 as stored
    with pytest.raises(ConfigError, match=r"^pools\.decode\.quantization: int8 cannot apply to .* gptq"):
        engine_args(cfg, "decode", model_dir)
