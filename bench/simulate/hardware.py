"""One GPU's limits for the roofline model: peak FLOP/s, memory, links, and how much of them is reached.

A hardware file is YAML with exactly these keys (unknown keys are refused, so a typo never falls
back to a default silently):

    name: H100-SXM
    peak_flops:                      # dense tensor-core FLOP/s (no 2:4 sparsity), per dtype; absent = unsupported
      bf16: 989.4e+12
      fp8: 1978.9e+12
    memory_bytes: 80.0e+9            # capacity
    memory_bytes_per_s: 3.35e+12     # HBM / GDDR bandwidth
    intra_node_link_bytes_per_s: 450.0e+9   # NVLink (PCIe without it), one direction
    inter_node_link_bytes_per_s: 50.0e+9    # the GPU's network share, one direction (400 Gbit/s)
    link_latency_s: 1.0e-5           # one all-reduce or one KV handoff, before its bytes
    compute_efficiency: 0.65         # share of peak FLOP/s that large GEMMs reach
    memory_efficiency: 0.8           # share of bandwidth that streaming reads reach
    step_overhead_s: 3.0e-4          # kernel launches and scheduling of one step
    sources:                         # where each figure comes from (URL: figure)
      - "https://...: BF16 1,979 TFLOPS with sparsity"

Numbers may be written as strings too ("1e12"): PyYAML reads an exponent without a sign as text.
Datasheet figures use decimal units (GB = 1e9 bytes, TB/s = 1e12 bytes/s). `memory_bytes` above
`MAX_MEMORY_BYTES` is refused as a typo (80.0e+12 for 80.0e+9): the simulated engines size their block
tables by it. The shipped files are in `bench/simulate/hardware/`, one per GPU; `Hardware.load` takes
their name or a path.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields

import yaml

HARDWARE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hardware")
DTYPES = ("bf16", "fp16", "fp8", "int8", "fp32")
_FRACTIONS = ("compute_efficiency", "memory_efficiency")
# A sanity bound on one GPU's memory: the largest today has under 300 GB. Above it a file is a typo (80.0e+12 for
# 80.0e+9), and the simulated engines' block tables, sized by it, would take the host's memory.
MAX_MEMORY_BYTES = 10e12


@dataclass(frozen=True, slots=True)
class PeakFlops:
    """Dense peak FLOP/s (int8: OP/s) per dtype; None where the GPU has no such tensor-core path."""

    bf16: float | None = None
    fp16: float | None = None
    fp8: float | None = None
    int8: float | None = None
    fp32: float | None = None


@dataclass(frozen=True, slots=True)
class Hardware:
    """One GPU as the roofline model sees it (see the module docstring for each field's meaning)."""

    name: str
    peak_flops: PeakFlops
    memory_bytes: float
    memory_bytes_per_s: float
    intra_node_link_bytes_per_s: float
    inter_node_link_bytes_per_s: float
    link_latency_s: float
    compute_efficiency: float
    memory_efficiency: float
    step_overhead_s: float
    sources: tuple[str, ...] = ()

    def flops(self, dtype: str) -> float:
        """Peak dense FLOP/s at `dtype`; ValueError when the GPU has none at that dtype."""
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r} (dtypes: {', '.join(DTYPES)})")
        peak = getattr(self.peak_flops, dtype)
        if peak is None:
            have = [d for d in DTYPES if getattr(self.peak_flops, d) is not None]
            raise ValueError(f"{self.name} has no {dtype} peak FLOP/s (it has: {', '.join(have)})")
        return peak

    @classmethod
    def load(cls, name_or_path: str) -> "Hardware":
        """A shipped hardware file by name (case-insensitive, e.g. "h100-sxm") or any YAML file by path."""
        if os.path.isfile(name_or_path):
            return cls.from_yaml(name_or_path)
        files = shipped()
        path = {name.lower(): p for name, p in files.items()}.get(name_or_path.lower())
        if path is None:
            raise ValueError(f"hardware {name_or_path!r} is neither a file nor a shipped name "
                             f"(shipped: {', '.join(files)})")
        return cls.from_yaml(path)

    @classmethod
    def from_yaml(cls, path: str) -> "Hardware":
        with open(path, "rb") as f:
            data = f.read()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{path}: not UTF-8 text ({e})") from None
        try:
            raw = yaml.load(text, Loader=_UniqueKeyLoader)
        except yaml.YAMLError as e:
            mark, problem = getattr(e, "problem_mark", None), getattr(e, "problem", None)
            where = f"{path}:{mark.line + 1}" if mark is not None else path
            raise ValueError(f"{where}: not valid YAML ({problem or str(e).splitlines()[0]})") from None
        return cls.from_dict(raw, source=path)

    @classmethod
    def from_dict(cls, raw: object, source: str = "hardware") -> "Hardware":
        """Validate `raw` (a parsed hardware file); every problem is a ValueError naming its key."""
        if not isinstance(raw, dict):
            raise ValueError(f"{source}: a hardware file is a mapping, got {type(raw).__name__}")
        known = {f.name for f in fields(cls)}
        _refuse_unknown(raw, known, source, "")
        missing = sorted(known - {"sources"} - set(raw))
        if missing:
            raise ValueError(f"{source}: missing key(s) {', '.join(missing)}")
        if not isinstance(raw["name"], str) or not raw["name"]:
            raise ValueError(f"{source}: key 'name' must be a non-empty string")
        values = {k: _positive(raw[k], k, source) for k in known - {"name", "peak_flops", "sources"}}
        for k, value in values.items():
            _plausible(value, k, source)
        for k in _FRACTIONS:
            if values[k] > 1.0:
                raise ValueError(f"{source}: key {k!r} is a fraction of peak, at most 1, got {values[k]}")
        if values["memory_bytes"] > MAX_MEMORY_BYTES:
            raise ValueError(f"{source}: key 'memory_bytes' is {values['memory_bytes']:.4g} bytes, above the sanity "
                             f"bound of {MAX_MEMORY_BYTES:.0e} bytes ({MAX_MEMORY_BYTES / 1e12:.0f} TB; the largest "
                             "GPU today has under 300 GB): a typo? (80 GB is 80.0e+9)")
        return cls(name=raw["name"], peak_flops=_peak_flops(raw["peak_flops"], source),
                   sources=_sources(raw.get("sources", []), source), **values)


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (the last would silently win)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":      # `<<`: merged keys may be overridden, as YAML says
                continue
            key = self.construct_object(key_node, deep=deep)
            try:
                given_twice = key in seen
            except TypeError:
                raise yaml.constructor.ConstructorError(None, None, f"found an unhashable key ({type(key).__name__})",
                                                        key_node.start_mark) from None
            if given_twice:
                raise yaml.constructor.ConstructorError(None, None, f"key {key!r} given twice",
                                                        key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def shipped() -> dict[str, str]:
    """Shipped hardware files, name as the file spells it (A100-80GB, H100-SXM, ...) → path."""
    names = sorted(f for f in os.listdir(HARDWARE_DIR) if f.endswith(".yaml"))
    return {f[: -len(".yaml")]: os.path.join(HARDWARE_DIR, f) for f in names}


def _refuse_unknown(raw: dict, known: set[str], source: str, prefix: str) -> None:
    unknown = sorted(str(k) for k in raw if k not in known)
    if unknown:
        raise ValueError(f"{source}: unknown key(s) {', '.join(prefix + k for k in unknown)} "
                         f"(known: {', '.join(sorted(known))})")


def _positive(value: object, key: str, source: str) -> float:
    """A finite number > 0; numeric strings count (PyYAML reads `1e12` as a string)."""
    number = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    elif isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            pass
    if number is None or not math.isfinite(number) or number <= 0:
        raise ValueError(f"{source}: key {key!r} must be a positive number, got {value!r}")
    return number


def _peak_flops(raw: object, source: str) -> PeakFlops:
    if not isinstance(raw, dict) or not raw:
        raise ValueError(f"{source}: key 'peak_flops' must map dtypes ({', '.join(DTYPES)}) to FLOP/s")
    _refuse_unknown(raw, set(DTYPES), source, "peak_flops.")
    peaks = {d: None if v is None else _positive(v, f"peak_flops.{d}", source) for d, v in raw.items()}
    for d, v in peaks.items():
        if v is not None:
            _plausible(v, f"peak_flops.{d}", source)
    return PeakFlops(**peaks)


PLAUSIBLE = {              # key: (least, most) a device's figure can be; outside it, a typo or a unit slip
    "peak_flops": (1e9, 1e18),
    "memory_bytes": (1e8, None),                 # (the upper bound: MAX_MEMORY_BYTES, with its own message)
    "memory_bytes_per_s": (1e9, 1e15),
    "intra_node_link_bytes_per_s": (1e6, 1e15),
    "inter_node_link_bytes_per_s": (1e6, 1e15),
    "link_latency_s": (None, 1.0),
    "step_overhead_s": (None, 1.0),
    "compute_efficiency": (0.01, None),
    "memory_efficiency": (0.01, None),
}


def _plausible(value: float, key: str, source: str) -> None:
    """ValueError naming `key` where `value` is outside what any device has (`PLAUSIBLE`): a step or a handoff
    priced from it would take years, or nothing."""
    least, most = PLAUSIBLE[key.split(".")[0]]
    if least is not None and value < least:
        raise ValueError(f"{source}: key {key!r} is {value:.4g}, below the least a device has ({least:g}): a typo?")
    if most is not None and value > most:
        raise ValueError(f"{source}: key {key!r} is {value:.4g}, above the most a device has ({most:g}): a typo?")


def _sources(raw: object, source: str) -> tuple[str, ...]:
    if not isinstance(raw, list) or not all(isinstance(s, str) and s for s in raw):
        raise ValueError(f"{source}: key 'sources' must be a list of citation strings")
    return tuple(raw)
