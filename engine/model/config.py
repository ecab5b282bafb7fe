"""Model architecture config read from a Hugging Face `config.json`."""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field

from engine.model.quantized_checkpoint import CheckpointQuantization, parse_quantization_config

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3")
# What an absent key means where the architecture's transformers config class differs from the defaults
# below (Llama's): a hand-written config.json reads as transformers reads it.
ARCHITECTURE_DEFAULTS = {
    "mistral": {"num_key_value_heads": 8, "max_position_embeddings": 131072},
    "qwen2": {"num_key_value_heads": 32, "max_position_embeddings": 32768},
    "qwen3": {"num_key_value_heads": 32, "max_position_embeddings": 32768, "head_dim": 128},
    "phi3": {"max_position_embeddings": 4096, "rms_norm_eps": 1e-5},
}
YARN_BETA_FAST, YARN_BETA_SLOW = 32.0, 1.0     # yarn's ramp bounds (rotations) where the config gives none
# Architectures whose config.json `sliding_window` always applies (Qwen2/3 ask with use_sliding_window).
_WINDOWED_BY_DEFAULT = ("mistral", "phi3")


@dataclass(slots=True, frozen=True)
class ModelConfig:
    """The Llama-family fields pdserve needs; everything else in config.json is ignored."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False            # q/k/v bias (qwen2 always, llama and qwen3 optional)
    o_proj_bias: bool = False               # llama and qwen3: attention_bias covers o_proj too
    mlp_bias: bool = False                  # llama only
    qk_norm: bool = False                   # qwen3: RMSNorm over each head of q and k before RoPE
    partial_rotary_factor: float = 1.0      # phi3: RoPE rotates the first factor * head_dim dims
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    torch_dtype: str = "float32"
    sliding_window: int | None = None
    # A 4-bit GPTQ / AWQ / compressed-tensors checkpoint (engine/model/quantized_checkpoint.py). Out of
    # the repr, which the weights' fingerprint hashes, so float checkpoints keep theirs.
    quantization: CheckpointQuantization | None = field(default=None, repr=False)

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json") -> "ModelConfig":
        """The fields of a parsed config.json; ValueError naming `source` and the key where one is missing,
        of the wrong type or out of range, or where the architecture is not supported."""
        if not isinstance(raw, dict):
            raise ValueError(f"{source}: must be a JSON object of config fields (got {_shown(raw)})")
        model_type = raw.get("model_type")
        quantization = parse_quantization_config(raw, source)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"{source}: model_type {model_type!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
        raw = {**ARCHITECTURE_DEFAULTS.get(model_type, {}), **raw}      # keys absent from the file
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            _integer(raw, key, source, _REQUIRED)
        num_heads = raw["num_attention_heads"]
        num_kv_heads = _integer(raw, "num_key_value_heads", source, num_heads)     # absent: one KV head per query head
        if num_heads % num_kv_heads:
            raise ValueError(f"{source}: num_attention_heads ({num_heads}) must be a multiple "
                             f"of num_key_value_heads ({num_kv_heads})")
        head_dim = _integer(raw, "head_dim", source, None)
        if head_dim is None:
            if raw["hidden_size"] % num_heads:
                raise ValueError(f"{source}: hidden_size ({raw['hidden_size']}) must be a multiple of "
                                 f"num_attention_heads ({num_heads}) when head_dim is absent")
            head_dim = raw["hidden_size"] // num_heads
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        if not all(_is_int(t) and t >= 0 for t in eos_ids):
            raise ValueError(f"{source}: eos_token_id must be a token id or a list of them (got {_shown(eos)})")
        # transformers >= 5 writes `rope_parameters`; older configs `rope_theta` + `rope_scaling`.
        rope_params = _object(raw, "rope_parameters", source) or {}
        custom_rope = rope_params.get("rope_type", "default") != "default"
        scaling_key = "rope_scaling" if _object(raw, "rope_scaling", source) else "rope_parameters"
        scaling = raw.get("rope_scaling") or (rope_params if custom_rope else None)
        if scaling is not None:
            scaling = _check_rope_scaling(scaling, scaling_key, raw, source)
        act = raw.get("hidden_act", raw.get("hidden_activation", "silu"))
        if act != "silu":
            raise ValueError(f"{source}: hidden_act {act!r} is not supported (supported: silu)")
        partial = 1.0
        if model_type == "phi3":
            key = "partial_rotary_factor"
            partial = (_number(raw, key, source, None)
                       or _number(rope_params, key, source, 1.0, f"rope_parameters.{key}"))
            if not 0.0 < partial <= 1.0:
                raise ValueError(f"{source}: partial_rotary_factor must be in (0, 1], got {partial}")
        rotary_dim = int(head_dim * partial)
        if rotary_dim < 2 or rotary_dim % 2:
            raise ValueError(f"{source}: head_dim ({head_dim}) must leave an even number of rotary dimensions "
                             f"(RoPE rotates pairs; got {rotary_dim})")
        for key in ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window"):
            if raw.get(key) is not None and not isinstance(raw[key], bool):
                raise ValueError(f"{source}: {key} must be true or false (got {_shown(raw[key])})")
        bos = raw.get("bos_token_id")
        if bos is not None and not (_is_int(bos) and bos >= 0):
            raise ValueError(f"{source}: bos_token_id must be a token id or null (got {_shown(bos)})")
        dtype_key = "torch_dtype" if raw.get("torch_dtype") else "dtype"
        if raw.get(dtype_key) is not None and not isinstance(raw[dtype_key], str):
            raise ValueError(f"{source}: {dtype_key} must be a dtype name (got {_shown(raw[dtype_key])})")
        sliding = _sliding_window(raw, model_type, source)
        attention_bias = bool(raw.get("attention_bias", False)) and model_type in ("llama", "qwen3")
        rope_theta = _number(raw, "rope_theta", source, None)
        return cls(
            model_type=model_type,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            max_position_embeddings=_integer(raw, "max_position_embeddings", source, 2048),
            rms_norm_eps=_number(raw, "rms_norm_eps", source, 1e-6),
            # transformers 5 takes rope_parameters' theta over a top-level one
            rope_theta=_number(rope_params, "rope_theta", source, None, "rope_parameters.rope_theta") or rope_theta
            or 10000.0,
            rope_scaling=scaling,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=model_type == "qwen2" or attention_bias,
            o_proj_bias=attention_bias,
            mlp_bias=model_type == "llama" and bool(raw.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            partial_rotary_factor=partial,
            bos_token_id=bos,
            eos_token_ids=eos_ids,
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype") or "float32",
            sliding_window=sliding,
            quantization=quantization,
        )

    @classmethod
    def from_dir(cls, model_dir: str) -> "ModelConfig":
        path = os.path.join(model_dir, "config.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path}: model directory has no config.json")
        with open(path, encoding="utf-8") as f:
            try:
                raw = json.load(f)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ValueError(f"{path}: not valid JSON ({e})") from None
        return cls.from_dict(raw, source=path)

    @property
    def rope_type(self) -> str:
        """The RoPE scaling's kind ("default" without one); configs spell its key `rope_type` or `type`."""
        return rope_kind(self.rope_scaling or {}) or "default"

    @property
    def context_limit(self) -> int:
        """The longest context the model serves: max_position_embeddings, or for YaRN the original context
        times its factor when that is longer (what the scaling stretches RoPE to, as vLLM derives it)."""
        if self.rope_type != "yarn":
            return self.max_position_embeddings
        scaling = self.rope_scaling
        original = scaling.get("original_max_position_embeddings", self.max_position_embeddings)
        return max(self.max_position_embeddings, int(original * float(scaling["factor"])))

    @property
    def rotary_dim(self) -> int:
        """Leading dims of each head that RoPE rotates (the rest pass through)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def num_params(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        per_layer = h * q + 2 * h * kv + q * h + 3 * h * i + 2 * h
        embed = v * h * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * per_layer + embed + h

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * dtype_bytes


def _sliding_window(raw: dict, model_type: str, source: str) -> int | None:
    """The attention window every layer uses, or None for full attention.

    Mistral and Phi-3 apply config.json's `sliding_window` to every layer; Qwen2/3 only with
    `use_sliding_window`, and then to layers from `max_window_layers` on (or as `layer_types`
    says). One window for some layers and none for others is refused: the engine has one.
    """
    window = raw.get("sliding_window")
    if window is None or not raw.get("use_sliding_window", model_type in _WINDOWED_BY_DEFAULT):
        return None
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        raise ValueError(f"{source}: field 'sliding_window' must be a positive integer or null, got {window!r}")
    if model_type in ("qwen2", "qwen3"):
        n = raw["num_hidden_layers"]
        first = _integer(raw, "max_window_layers", source, n, least=0)
        types = raw.get("layer_types")
        if types is not None and not (isinstance(types, list) and all(isinstance(t, str) for t in types)):
            raise ValueError(f"{source}: layer_types must be a list of attention kinds (got {_shown(types)})")
        types = types or ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
        if all(t == "full_attention" for t in types):
            return None
        if any(t != "sliding_attention" for t in types):
            raise ValueError(f"{source}: sliding_window on some layers only (layer_types / max_window_layers) "
                             "is not supported; the engine applies one window to every layer")
    return window


_REQUIRED = object()       # `_integer`'s default for a key that must be present


def rope_kind(scaling: dict) -> str | None:
    """A RoPE scaling's kind as config.json names it: `rope_type`, or the older `type`."""
    return scaling.get("rope_type", scaling.get("type"))


def _shown(value: object) -> str:
    """`value` as config.json spells it, cut short."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _integer(raw: dict, key: str, source: str, default, least: int = 1):
    """raw[key], an integer of at least `least`; `default` where it is absent or null (`_REQUIRED`: refused)."""
    value = raw.get(key)
    if value is None and default is not _REQUIRED:
        return default
    if not _is_int(value) or value < least:
        got = f"got {_shown(value)}" if key in raw else "missing"
        kind = "a positive integer" if least == 1 else f"an integer of at least {least}"
        raise ValueError(f"{source}: {key} must be {kind} ({got})")
    return value


def _number(raw: dict, key: str, source: str, default: float | None, name: str | None = None) -> float | None:
    """raw[key], a finite number above 0; `default` where it is absent or null. `name`: the key as shown."""
    value = raw.get(key)
    if value is None:
        return default
    if not (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0):
        raise ValueError(f"{source}: {name or key} must be a positive number (got {_shown(value)})")
    return float(value)


def _object(raw: dict, key: str, source: str) -> dict | None:
    value = raw.get(key)
    if value is not None and not isinstance(value, dict):
        raise ValueError(f"{source}: {key} must be an object or null (got {_shown(value)})")
    return value


# Every key a `yarn` scaling may carry: what rope.py applies, plus `finetuned` (NousResearch's YaRN
# checkpoints; it selects their dynamic variant only, so plain yarn is the same without it).
_YARN_KEYS = {"rope_type", "type", "rope_theta", "partial_rotary_factor", "factor", "original_max_position_embeddings",
              "attention_factor", "mscale", "mscale_all_dim", "beta_fast", "beta_slow", "truncate", "finetuned"}


def _check_rope_scaling(scaling: dict, key: str, raw: dict, source: str) -> dict:
    """A RoPE scaling the engine applies (engine/model/rope.py), with the numbers it reads checked; returned
    with config.json's top-level `original_max_position_embeddings` in it, which transformers puts first."""
    kind = rope_kind(scaling)
    if kind not in ("default", "linear", "llama3", "yarn"):
        raise ValueError(f"{source}: {key} type {kind!r} is not supported "
                         "(supported: linear, llama3, yarn; not dynamic/longrope/su)")
    if kind == "default":
        return scaling
    if raw.get("model_type") == "phi3":       # transformers reads phi3's yarn as longrope and refuses the rest
        raise ValueError(f"{source}: {key} type {kind!r} is not supported for phi3 (transformers reads phi3's "
                         "yarn/su as longrope and refuses linear/llama3; the engine applies no phi3 scaling)")
    if scaling.get("factor") is None:
        raise ValueError(f"{source}: {key}.factor must be a positive number (missing)")
    _number(scaling, "factor", source, None, f"{key}.factor")
    if kind == "linear":
        return scaling
    _number(scaling, "original_max_position_embeddings", source, None, f"{key}.original_max_position_embeddings")
    if _number(raw, "original_max_position_embeddings", source, None) is not None:
        scaling = {**scaling, "original_max_position_embeddings": raw["original_max_position_embeddings"]}
    if kind == "llama3":
        low = _number(scaling, "low_freq_factor", source, 1.0, f"{key}.low_freq_factor")
        high = _number(scaling, "high_freq_factor", source, 4.0, f"{key}.high_freq_factor")
        if high <= low:
            raise ValueError(f"{source}: {key}.high_freq_factor ({high:g}) must be above low_freq_factor ({low:g})")
    else:
        _check_yarn(scaling, key, source)
    return scaling


def _check_yarn(scaling: dict, key: str, source: str) -> None:
    """YaRN's optional numbers; a key rope.py would not apply is refused, not ignored."""
    unknown = sorted(set(scaling) - _YARN_KEYS)
    if unknown:
        raise ValueError(f"{source}: {key}.{unknown[0]} is not a yarn parameter the engine applies "
                         f"(it reads: {', '.join(sorted(_YARN_KEYS - {'type', 'finetuned'}))})")
    given = {name: _number(scaling, name, source, None, f"{key}.{name}")
             for name in ("attention_factor", "mscale", "mscale_all_dim", "beta_fast", "beta_slow")}
    if given["attention_factor"] is not None and (given["mscale"] or given["mscale_all_dim"]):
        raise ValueError(f"{source}: {key}.attention_factor and mscale/mscale_all_dim are exclusive "
                         "(transformers ignores mscale when attention_factor is set)")
    if (given["mscale"] is None) != (given["mscale_all_dim"] is None):
        one = "mscale" if given["mscale"] is not None else "mscale_all_dim"
        raise ValueError(f"{source}: {key}.{one} needs both mscale and mscale_all_dim "
                         "(transformers ignores either one alone)")
    beta_fast, beta_slow = given["beta_fast"] or YARN_BETA_FAST, given["beta_slow"] or YARN_BETA_SLOW
    if beta_fast < beta_slow:
        raise ValueError(f"{source}: {key}.beta_fast ({beta_fast:g}) must be at least beta_slow ({beta_slow:g})")
    if "truncate" in scaling and not isinstance(scaling["truncate"], bool):
        raise ValueError(f"{source}: {key}.truncate must be true or false (got {_shown(scaling['truncate'])})")
