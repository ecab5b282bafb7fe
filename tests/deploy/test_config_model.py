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
