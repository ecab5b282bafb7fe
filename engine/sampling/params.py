"""Per-request sampling and stopping parameters (mirrors the gRPC `SamplingParams`)."""
from __future__ import annotations

import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field

from engine.sampling.structured import StructuredOutput
from proto.pdserve.v1 import generation_pb2

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_LOGIT_BIAS = 100.0
MAX_LOGPROBS = 20                   # top alternatives per position (logprobs, prompt_logprobs)
MAX_SEQUENCES = 64                  # n and best_of
# Floors of the sampler's divisors: logits are divided by the temperature and positive logits by the
# repetition penalty, so a tiny positive value (a denormal such as 1e-45) overflows float32 logits to
# inf and the softmax to NaN. At the floors a logit of 1e4 becomes 1e14 after both divisions: finite.
MIN_TEMPERATURE = 1e-5
MIN_REPETITION_PENALTY = 1e-5


def _float32(value: float) -> float:
    """``value`` as the proto's float fields carry it (1e-5 arrives as 9.99999975e-06)."""
    return struct.unpack("f", struct.pack("f", value))[0]


_TEMPERATURE_FLOOR = _float32(MIN_TEMPERATURE)               # so that a floor sent over gRPC is accepted
_REPETITION_PENALTY_FLOOR = _float32(MIN_REPETITION_PENALTY)


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    Sampling order (fixed): repetition / frequency / presence penalties →
    logit_bias → min_tokens mask → structured-output mask → temperature → top-k →
    top-p → min-p → seeded draw. ``temperature == 0`` is greedy (argmax after
    penalties, bias and masks);
    a positive temperature is at least `MIN_TEMPERATURE` (1e-5), and the
    repetition penalty at least `MIN_REPETITION_PENALTY` (1e-5): both divide logits.

    ``n`` sequences are returned for the prompt; ``best_of`` (>= n) are generated
    (`num_sequences`), each with its own seed (`engine.sampling.sampler.child_seed`).

    ``structured`` constrains every sequence's output to a grammar (`StructuredOutput`): EOS is
    allowed only where the grammar accepts, and only EOS once it is complete.
    """

    max_tokens: int = 16
    temperature: float = 1.0            # 0 = greedy, else >= MIN_TEMPERATURE
    top_p: float = 1.0
    top_k: int = 0                      # 0 = disabled
    repetition_penalty: float = 1.0     # 1 = disabled, (0, 2] and >= MIN_REPETITION_PENALTY
    frequency_penalty: float = 0.0      # [-2, 2]
    presence_penalty: float = 0.0       # [-2, 2]
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    min_p: float = 0.0                  # [0, 1]; 0 = disabled
    min_tokens: int = 0                 # EOS / stop_token_ids / stop strings cannot end the output before this
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    logit_bias: dict[int, float] = field(default_factory=dict)     # token id -> bias in [-100, 100]
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None         # None: no logprobs; k: the sampled token's + k top alternatives
    prompt_logprobs: int | None = None  # None: none; k: per prompt token from the second on, + k alternatives
    n: int = 1
    best_of: int | None = None          # None = n
    structured: StructuredOutput | None = None      # a grammar the output must match

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        self.stop = tuple(self.stop)
        if isinstance(self.stop_token_ids, (list, tuple)):
            self.stop_token_ids = tuple(self.stop_token_ids)
        if isinstance(self.logit_bias, Mapping):
            self.logit_bias = dict(self.logit_bias)

    @classmethod
    def from_proto(cls, msg: generation_pb2.SamplingParams,
                   defaults: Mapping[str, object] | None = None) -> SamplingParams:
        """Proto → params. An unset (optional) field takes ``defaults[name]`` when present (e.g. the
        model's `GenerationConfig.sampling_defaults`), else the class default. Not validated."""
        params = cls(stop=tuple(msg.stop), ignore_eos=msg.ignore_eos, stop_token_ids=tuple(msg.stop_token_ids),
                     logit_bias=dict(msg.logit_bias), include_stop_str_in_output=msg.include_stop_str_in_output,
                     structured=StructuredOutput.from_proto(msg.structured) if msg.HasField("structured") else None)
        defaults = defaults or {}
        for name in _PROTO_OPTIONAL:
            if msg.HasField(name):
                setattr(params, name, getattr(msg, name))
            elif name in defaults:
                setattr(params, name, defaults[name])
        return params

    def to_proto(self) -> generation_pb2.SamplingParams:
        """Params → proto with every field set (what the router sends to the workers)."""
        msg = generation_pb2.SamplingParams(stop=list(self.stop), ignore_eos=self.ignore_eos,
                                            stop_token_ids=list(self.stop_token_ids), logit_bias=self.logit_bias,
                                            include_stop_str_in_output=self.include_stop_str_in_output)
        for name in _PROTO_OPTIONAL:
            value = getattr(self, name)
            if value is not None:
                setattr(msg, name, value)
        if self.structured is not None:
            msg.structured.CopyFrom(self.structured.to_proto())
        return msg

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def num_sequences(self) -> int:
        """Sequences generated for the prompt: best_of, else n."""
        return self.best_of if self.best_of is not None else self.n

    @property
    def needs_logprobs(self) -> bool:
        """Whether each sampled token's logprob is computed: asked for, or best_of ranks by them."""
        return self.logprobs is not None or self.num_sequences > self.n

    def validate(self) -> None:
        """Raise ``ValueError`` naming the field and its allowed range."""
        _check_int("max_tokens", self.max_tokens, low=1)
        _check_float("temperature", self.temperature, 0.0, None, "a finite number >= 0")
        if 0.0 < self.temperature < _TEMPERATURE_FLOOR:
            raise ValueError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, got {self.temperature}")
        _check_float("top_p", self.top_p, 0.0, 1.0, "in (0, 1]")
        if self.top_p <= 0.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k, low=0)
        _check_float("repetition_penalty", self.repetition_penalty, 0.0, 2.0, "in (0, 2]")
        if self.repetition_penalty < _REPETITION_PENALTY_FLOOR:
            raise ValueError(f"repetition_penalty must be in (0, 2] and at least {MIN_REPETITION_PENALTY:g}, "
                             f"got {self.repetition_penalty}")
        _check_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0, "in [-2, 2]")
        _check_float("presence_penalty", self.presence_penalty, -2.0, 2.0, "in [-2, 2]")
        if self.seed is not None:
            _check_int("seed", self.seed, low=0, high=2**64 - 1)
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop must hold at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError("stop strings must be non-empty strings")
            if len(s) > MAX_STOP_STRING_CHARS:
                raise ValueError(f"stop strings must be at most {MAX_STOP_STRING_CHARS} characters, got {len(s)}")
        _check_float("min_p", self.min_p, 0.0, 1.0, "in [0, 1]")
        _check_int("min_tokens", self.min_tokens, low=0)
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if not isinstance(self.stop_token_ids, tuple):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids must hold at most {MAX_STOP_TOKEN_IDS} ids, "
                             f"got {len(self.stop_token_ids)}")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, low=0)
        if not isinstance(self.logit_bias, dict):
            raise ValueError(f"logit_bias must be a mapping of token id to bias, got {self.logit_bias!r}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(f"logit_bias must hold at most {MAX_LOGIT_BIAS_ENTRIES} entries, "
                             f"got {len(self.logit_bias)}")
        for t, bias in self.logit_bias.items():
            _check_int("logit_bias token id", t, low=0)
            _check_float("logit_bias", bias, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS, "in [-100, 100]")
        _check_bool("ignore_eos", self.ignore_eos)
        _check_bool("include_stop_str_in_output", self.include_stop_str_in_output)
        _check_bool("skip_special_tokens", self.skip_special_tokens)
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), low=0, high=MAX_LOGPROBS)
        _check_int("n", self.n, low=1, high=MAX_SEQUENCES)
        if self.best_of is not None:
            _check_int("best_of", self.best_of, low=1, high=MAX_SEQUENCES)
            if self.best_of < self.n:
                raise ValueError(f"best_of must be in [n ({self.n}), {MAX_SEQUENCES}], got {self.best_of}")
        if self.structured is not None:
            if not isinstance(self.structured, StructuredOutput):
                raise ValueError(f"structured must be a StructuredOutput, got {self.structured!r:.80}")
            self.structured.validate()


# Fields with presence in the proto (`optional`): unset means "use the default".
_PROTO_OPTIONAL = ("max_tokens", "temperature", "top_p", "top_k", "repetition_penalty", "frequency_penalty",
                   "presence_penalty", "seed", "min_p", "min_tokens", "skip_special_tokens", "logprobs",
                   "prompt_logprobs", "n", "best_of")


def _check_int(name: str, value: object, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be {bound}, got {value}")


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r}")


def _check_float(name: str, value: object, low: float, high: float | None, allowed: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number {allowed}, got {value!r}")
    if math.isnan(value) or math.isinf(value) or value < low or (high is not None and value > high):
        raise ValueError(f"{name} must be {allowed}, got {value}")
