"""The measured profile as the planner reads it: prefill seconds(S) and decode step seconds(B, C),
interpolated between the points `deploy.profiler` measured. Pure, no I/O."""
from __future__ import annotations

import bisect

from engine.profile import ModelCosts


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


class Profile:
    """Measured points, with interpolation: prefill seconds(S), decode step seconds(B, C).

    Times are made non-decreasing in prompt length, batch and context first (see `_monotone`)."""

    def __init__(self, data: dict):
        self.data = data
        self.prefill_costs = ModelCosts.from_dict(data["prefill"]["engine"]["costs"])
        self.costs = ModelCosts.from_dict(data["decode"]["engine"]["costs"])
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
        # serving-path factors measured on the running cluster (bench.plan_check --calibrate):
        # time in serving / time in the profile, for prefill and for decode steps
        self.calibration = {k: float(v) for k, v in data.get("calibration", {}).items() if k in ("prefill", "decode")}
        for i, c in enumerate(self._contexts[:-1]):          # a longer context never steps faster
            longer = grid[self._contexts[i + 1]]
            for b in grid[c]:
                grid[c][b] = min(grid[c][b], longer.get(b, grid[c][b]))
        self._decode = {c: (sorted(grid[c]), _monotone([grid[c][b] for b in sorted(grid[c])]))
                        for c in self._contexts}

    @property
    def peak_flops_per_s(self) -> float:
        return max(self._rate)

    @property
    def peak_bytes_per_s(self) -> float:
        return max(p["bytes_per_s"] for p in self.data["decode"]["points"])

    def prefill_seconds(self, prompt_len: float) -> float:
        """One prompt, from the achieved FLOP/s interpolated at its length."""
        rate = _interp(self._s, self._rate, prompt_len) if prompt_len <= self._s[-1] else self._rate[-1]
        return self.prefill_costs.prefill_flops(round(prompt_len)) / rate

    def prefill_capacity(self, prompt_len: float) -> float:
        """Prompt tokens/s one actor sustains under saturation: from the saturated-step
        measurement nearest in length (scaled by the single-prompt times), else one prompt at a time."""
        single = prompt_len / self.prefill_seconds(prompt_len)
        xs, ys = self._sat
        if not xs:
            return single
        i = min(range(len(xs)), key=lambda j: abs(xs[j] - prompt_len))
        gain = ys[i] / (xs[i] / self.prefill_seconds(xs[i]))      # batching speed-up (or slow-down) there
        return single * gain

    def decode_step_seconds(self, batch: float, context: float) -> float:
        """One step of `batch` sequences at `context` tokens: piecewise-linear in batch,
        then linear in context between the measured contexts (clamped to the nearest outside)."""
        cs = self._contexts
        at = [_interp(*self._decode[c], batch) for c in cs]
        if len(cs) == 1 or context <= cs[0]:
            return at[0]
        if context >= cs[-1]:
            return at[-1]
        return _interp(cs, at, context)
