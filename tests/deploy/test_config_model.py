"""The model section's preset names (deploy/config/model.py)."""
from __future__ import annotations

import pytest

from deploy.config import PRESET_MODELS


def test_presets_match_the_engine():
    presets = pytest.importorskip("engine.presets")
    assert set(PRESET_MODELS) <= set(presets.PRESETS) | set(presets.TRAINED)
