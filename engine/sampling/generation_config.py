"""The model's `generation_config.json`: extra EOS ids and the sampling defaults it recommends."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

# generation_config.json key -> SamplingParams field: the keys vLLM takes as default sampling params.
_SAMPLING_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                  "repetition_penalty": "repetition_penalty", "min_p": "min_p", "max_new_tokens": "max_tokens"}


@dataclass(slots=True, frozen=True)
class GenerationConfig:
    """eos_token_ids: end-of-sequence ids the file adds to config.json's.
    sampling_defaults: SamplingParams field -> value, for a request's unset fields
    (`SamplingParams.from_proto(msg, defaults=...)`)."""

    eos_token_ids: tuple[int, ...] = ()
    sampling_defaults: dict[str, object] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, raw: dict, source: str = "generation_config.json") -> GenerationConfig:
        if not isinstance(raw, dict):
            raise ValueError(f"{source}: expected a JSON object")
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in eos_ids):
            raise ValueError(f"{source}: eos_token_id must be a token id or a list of them, got {eos!r}")
        defaults = {name: raw[key] for key, name in _SAMPLING_KEYS.items() if raw.get(key) is not None}
        for key, name in _SAMPLING_KEYS.items():     # refused at load, naming the key, not in every request
            if name in defaults:
                _check_default(key, name, defaults[name], source)
        return cls(eos_token_ids=eos_ids, sampling_defaults=defaults)

    @classmethod
    def from_dir(cls, model_dir: str) -> GenerationConfig:
        """Read `model_dir/generation_config.json`; a directory without one gives an empty config."""
        path = os.path.join(model_dir, "generation_config.json")
        if not os.path.isfile(path):
            return cls()
        with open(path, encoding="utf-8") as f:
            try:
                raw = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: not valid JSON ({e})") from None
        return cls.from_dict(raw, source=path)


def _check_default(key: str, name: str, value: object, source: str) -> None:
    """A sampling default a request may take: what `SamplingParams.validate` accepts for its field."""
    from engine.sampling.params import SamplingParams
    try:
        SamplingParams(**{name: value}).validate()
    except (ValueError, TypeError) as e:
        raise ValueError(f"{source}: {key} {value!r:.40} cannot be a sampling default ({e})") from None
