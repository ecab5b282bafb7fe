"""The speculative section: defaults, the engine settings it gives decode and colocated actors only,
and bad values refused with the key's path."""
from __future__ import annotations

import pytest

from deploy.config import ConfigError, load_config, parse_override
from deploy.launcher import colocated_engine_args, engine_args
from engine.model.presets import resolve_model


def test_default_is_off_and_ngram_reaches_decode_and_colocated_actors_only():
    assert load_config(None).speculative.engine_config().enabled is False
    cfg = load_config(None, {"speculative.method": "ngram", "speculative.num_tokens": 3,
                             "speculative.ngram.max": 5, "speculative.adaptive": False})
    model_dir = resolve_model("tiny")
    spec = engine_args(cfg, "decode", model_dir).speculative
    assert (spec.method, spec.num_tokens, spec.ngram_min, spec.ngram_max, spec.adaptive) == ("ngram", 3, 1, 5, False)
    assert colocated_engine_args(cfg, model_dir).speculative == spec
    assert engine_args(cfg, "prefill", model_dir).speculative.enabled is False


def test_the_draft_method_names_its_model():
    cfg = load_config(None, {"speculative.method": "draft", "speculative.draft.model": "pydoc-draft",
                             "speculative.draft.num_tokens": 3})
    spec = engine_args(cfg, "decode", resolve_model("pydoc")).speculative
    assert (spec.method, spec.draft_model, spec.k) == ("draft", "pydoc-draft", 3)


def test_a_bare_off_means_the_method_off():
    key, value = parse_override("speculative.method=off")
    assert load_config(None, {key: value}).speculative.method == "off"


@pytest.mark.parametrize("overrides, message", [
    ({"speculative.num_tokens": 0}, "speculative.num_tokens: must be >= 1"),
    ({"speculative.method": "eagle"}, "speculative.method"),
    ({"speculative.ngram.min": 0}, "speculative.ngram.min: must be >= 1"),
    ({"speculative.ngram.min": 4, "speculative.ngram.max": 2},
     "speculative.ngram.max: must be >= speculative.ngram.min"),
    ({"speculative.ngram.size": 2}, "speculative.ngram.size: unknown key"),
    ({"speculative.method": "draft"}, "speculative.draft.model: required with speculative.method draft"),
    ({"speculative.method": "draft", "speculative.draft.model": "/nonexistent"}, "speculative.draft.model:"),
    ({"speculative.draft.num_tokens": 0}, "speculative.draft.num_tokens: must be >= 1"),
    ({"speculative.method": "ngram", "kv_cache.dtype": "fp8"},
     "speculative.method: cannot run with kv_cache.dtype fp8"),
])
def test_bad_values_name_their_key(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert str(err.value).startswith(message), str(err.value)
