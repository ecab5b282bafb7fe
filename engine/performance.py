"""How long serving work takes on one actor: the one performance model of pdserve.

The planner (`deploy.planner`), the autoscaler, auto placement (`router.placement`, through the router's
live model) and the simulator all ask a `PerformanceModel` the same questions:

    prefill_seconds(S)            one prompt of S tokens, alone on a prefill actor
    prefill_capacity(S)           prompt tokens/s one actor sustains on S-token prompts under saturation
    decode_step_seconds(B, C)     one decode step of B sequences that each attend over C tokens
    link_seconds(kv_bytes)        one prompt's KV over the configured link (transport + codec)

`MeasuredPerformance` answers from a measured profile (`pdserve profile`: `engine.profile` measures the
points, `deploy.profiler` writes the file); `LinearPerformance` from a handful of figures, for a cluster
that has no profile yet. `router.placement.live_profile.LiveProfile` answers from one of those, corrected
by what the running cluster reports; it is the model the router's placement and the autoscaler share.
"""
from __future__ import annotations

import bisect
from abc import ABC, abstractmethod

from engine.cost_model import ModelCosts

DEFAULT_KV_BYTES_PER_S = 1e9        # a profile without a link measurement


class PerformanceModel(ABC):
    """Seconds of the phases on one actor and of the KV link between two.

    Attributes:
        kv_bytes_per_token: K and V of one prompt token over all layers (what a handoff moves per token).
    """

    kv_bytes_per_token: float

    @abstractmethod
    def prefill_seconds(self, prompt_len: float) -> float:
        """One prompt of `prompt_len` tokens computed alone (its TTFT share on an idle actor)."""

    @abstractmethod
    def prefill_capacity(self, prompt_len: float) -> float:
        """Prompt tokens/s one actor sustains on `prompt_len`-token prompts when it always has work."""

    @abstractmethod
    def decode_step_seconds(self, batch: float, context: float) -> float:
        """One decode step of `batch` sequences that each attend over `context` tokens."""

    @property
    @abstractmethod
    def kv_bytes_per_s(self) -> float:
        """Uncompressed KV bytes per second the link moves, encode and decode included."""

    def link_seconds(self, kv_bytes: float) -> float:
        return kv_bytes / self.kv_bytes_per_s

    def prefill_share_seconds(self, prompt_len: float, new_tokens: float) -> float:
        """The last `new_tokens` of a `prompt_len`-token prompt (the rest cached or computed before):
        the prompt's time less its cached prefix's."""
        before = max(prompt_len - new_tokens, 0.0)
        return max(self.prefill_seconds(prompt_len) - (self.prefill_seconds(before) if before else 0.0), 1e-6)

    @property
    def measured(self) -> MeasuredPerformance | None:
        """The measured profile this model rests on (the planner's ledger reads its costs and peaks)."""
        return None


def _interp(xs: list[float], ys: list[float], x: float) -> float:
    """Piecewise-linear through (xs, ys) (sorted xs); linear extension beyond the ends."""
    if len(xs) == 1:
        return ys[0] * (x / xs[0] if xs[0] else 1.0)
    i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return max(y0 + (y1 - y0) * (x - x0) / (x1 - x0), 1e-9)


def _monotone(ys: list[float]) -> list[float]:
    """Non-decreasing by a running minimum from the right: work that grows never takes less
    time, and on a shared machine noise only adds time, so the lower evidence wins."""
    out = list(ys)
    for i in range(len(out) - 2, -1, -1):
        out[i] = min(out[i], out[i + 1])
    return out


class MeasuredPerformance(PerformanceModel):
    """A measured profile's points (the file format is in `deploy.profiler`), interpolated.

    Prefill: the achieved FLOP/s by prompt length (`engine.cost_model` counts a prompt's FLOPs), and
    the batching gain of a saturated step. Decode: step seconds piecewise-linear in batch, then linear
    in context between the measured contexts. Times are made non-decreasing in prompt length, batch and
    context first (see `_monotone`). A profile calibrated on the running cluster (`"calibration"`, from
    `bench.serving.plan_check --calibrate`) scales every prefill and decode time by its factors (measured
    at saturation) and adds its fixed costs (measured one request at a time): `step_s` to every decode
    step (the worker's output processing and the token's message to the router, which the profile of the
    bare engine step does not see) and `handoff_s` to every KV handoff (the router's call to the prefill
    actor, the send, the adopt), so whoever asks gets serving's time, not the bare engine's.
    """

    def __init__(self, data: dict):
        self.data = data
        self.prefill_costs = ModelCosts.from_dict(data["prefill"]["engine"]["costs"])
        self.costs = ModelCosts.from_dict(data["decode"]["engine"]["costs"])
        self.kv_bytes_per_token = float(self.costs.kv_bytes_per_token)
        prefill = data["prefill"]["points"]
        pts = sorted((p for p in prefill if p.get("batch", 1) == 1), key=lambda p: p["prompt_len"])
        self._s = [p["prompt_len"] for p in pts]
        seconds = _monotone([p["seconds"] for p in pts])
        self._rate = [self.prefill_costs.prefill_flops(s) / t for s, t in zip(self._s, seconds)]
        # saturated steps (several prompts batched): prompt tokens/s at each length
        full = sorted((p for p in prefill if p.get("batch", 1) > 1), key=lambda p: p["prompt_len"])
        self._sat = ([p["prompt_len"] for p in full], [p["batch"] * p["prompt_len"] / p["seconds"] for p in full])
        grid: dict[int, dict[int, float]] = {}
        for p in data["decode"]["points"]:
            grid.setdefault(p["context"], {})[p["batch"]] = p["seconds"]
        self._contexts = sorted(grid)
        # serving-path factors measured on the running cluster: time in serving / time in the profile
        calibration = data.get("calibration", {})
        self.calibration = {k: float(v) for k, v in calibration.items() if k in ("prefill", "decode")}
        self.step_overhead_s = float(calibration.get("step_s", 0.0))      # added to every decode step
        self.handoff_s = float(calibration.get("handoff_s", 0.0))         # added to every KV handoff
        for i, c in enumerate(self._contexts[:-1]):          # a longer context never steps faster
            longer = grid[self._contexts[i + 1]]
            for b in grid[c]:
                grid[c][b] = min(grid[c][b], longer.get(b, grid[c][b]))
        self._decode = {c: (sorted(grid[c]), _monotone([grid[c][b] for b in sorted(grid[c])]))
                        for c in self._contexts}
        link = self.transfer
        self._kv_bytes_per_s = float(link.get("kv_bytes_per_s") or DEFAULT_KV_BYTES_PER_S)

    @property
    def measured(self) -> MeasuredPerformance:
        return self

    def degrees(self, pool: str) -> list[int]:
        """The tensor-parallel degrees `pool` ("prefill" | "decode") was measured at: 1 (the top-level
        points) and those under ``"degrees"`` (``pdserve profile --tp``)."""
        return [1, *sorted(int(d) for d, pools in (self.data.get("degrees") or {}).items() if pool in pools)]

    def at_degree(self, pool: str, degree: int) -> MeasuredPerformance | None:
        """This profile with `pool`'s points measured at tensor-parallel `degree` (the other pool's kept);
        None when that degree was not measured."""
        if degree == 1:
            return self
        points = (self.data.get("degrees") or {}).get(str(degree), {}).get(pool)
        return MeasuredPerformance({**self.data, pool: points}) if points else None

    @property
    def transfer(self) -> dict:
        """The KV link measurement (`deploy.link_profiler`), {} in profiles made before it existed."""
        return dict(self.data.get("transfer") or {})

    @property
    def kv_bytes_per_s(self) -> float:
        return self._kv_bytes_per_s

    @property
    def peak_flops_per_s(self) -> float:
        return max(self._rate)

    @property
    def peak_bytes_per_s(self) -> float:
        return max(p["bytes_per_s"] for p in self.data["decode"]["points"])

    def prefill_seconds(self, prompt_len: float) -> float:
        """One prompt, from the achieved FLOP/s interpolated at its length."""
        rate = _interp(self._s, self._rate, prompt_len) if prompt_len <= self._s[-1] else self._rate[-1]
        return self.calibration.get("prefill", 1.0) * self.prefill_costs.prefill_flops(round(prompt_len)) / rate

    def prefill_capacity(self, prompt_len: float) -> float:
        """From the saturated-step measurement nearest in length (scaled by the single-prompt times),
        else one prompt at a time."""
        single = prompt_len / self.prefill_seconds(prompt_len)
        xs, ys = self._sat
        if not xs:
            return single
        i = min(range(len(xs)), key=lambda j: abs(xs[j] - prompt_len))
        factor = self.calibration.get("prefill", 1.0)
        gain = ys[i] / factor / (xs[i] / self.prefill_seconds(xs[i]))   # batching speed-up (or slow-down) there
        return single * gain

    def decode_step_seconds(self, batch: float, context: float) -> float:
        """Piecewise-linear in batch, then linear in context between the measured contexts (clamped to the
        nearest outside them)."""
        cs = self._contexts
        at = [_interp(*self._decode[c], batch) for c in cs]
        if len(cs) == 1 or context <= cs[0]:
            seconds = at[0]
        elif context >= cs[-1]:
            seconds = at[-1]
        else:
            seconds = _interp(cs, at, context)
        return self.calibration.get("decode", 1.0) * seconds + self.step_overhead_s


class LinearPerformance(PerformanceModel):
    """A few figures, for a cluster that has measured nothing yet: prompts at a flat rate, a decode step
    linear in batch (context left out), a fixed link rate. The router's live model corrects them from
    the first requests' reports."""

    def __init__(self, prefill_tokens_per_s: float = 2000.0, step_base_s: float = 0.02,
                 step_per_seq_s: float = 0.001, kv_bytes_per_s: float = DEFAULT_KV_BYTES_PER_S,
                 kv_bytes_per_token: float = 0.0):
        self.prefill_tokens_per_s, self.step_base_s, self.step_per_seq_s = (prefill_tokens_per_s, step_base_s,
                                                                           step_per_seq_s)
        self._kv_bytes_per_s, self.kv_bytes_per_token = kv_bytes_per_s, kv_bytes_per_token

    @property
    def kv_bytes_per_s(self) -> float:
        return self._kv_bytes_per_s

    def prefill_seconds(self, prompt_len: float) -> float:
        return prompt_len / self.prefill_tokens_per_s

    def prefill_capacity(self, prompt_len: float) -> float:
        return self.prefill_tokens_per_s

    def decode_step_seconds(self, batch: float, context: float) -> float:
        return self.step_base_s + self.step_per_seq_s * max(batch, 0.0)
