"""How long serving work takes on one actor: the one performance model of pdserve.

The planner (`deploy.planner`), the autoscaler, auto placement (`router.placement`, through the router's
live model) and the simulator all ask a `PerformanceModel` the same questions:

    prefill_seconds(S)            one prompt of S tokens, alone on a prefill actor
    prefill_capacity(S)           prompt tokens/s one actor sustains on S-token prompts under saturation
    decode_step_seconds(B, C)     one decode step of B sequences that each attend over C tokens
    token_seconds(B, C)           seconds per output token of each of B decoding sequences (the TPOT):
                                  the plain step, or with speculative decoding (`speculation`) the step
                                  the engine would run divided by the tokens it yields per sequence
    link_seconds(kv_bytes)        one prompt's KV over the configured link (transport + codec)

`MeasuredPerformance` answers from a measured profile (`pdserve profile`: `engine.profile` measures the
points, `deploy.profiler` writes the file); `LinearPerformance` from a handful of figures, for a cluster
that has no profile yet. `router.placement.live_profile.LiveProfile` answers from one of those, corrected
by what the running cluster reports; it is the model the router's placement and the autoscaler share.

Speculative decoding (`Speculation`, the `speculative:` settings with an acceptance rate): a step in which
each sequence verifies k proposals (1 + k query tokens, the proposing included) costs
`spec_step_seconds(B, C, k)` and yields `Speculation.tokens_per_step(k)` tokens per sequence
(engine/spec/tokens_per_step.py); the engine's turn-down picks, per step, the k (0 included) with the most
tokens per second (engine/spec/turn_down.py), so `token_seconds` takes the k with the fewest seconds per
token and never predicts a speed-up where the engine would turn proposals off.
"""
from __future__ import annotations

import bisect
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace

from engine.cost_model import ModelCosts
from engine.spec.tokens_per_step import expected_tokens, per_token_acceptance

DEFAULT_KV_BYTES_PER_S = 1e9        # a profile without a link measurement


@dataclass(slots=True, frozen=True)
class Speculation:
    """What the performance model needs of the `speculative:` settings (engine/spec).

    Args:
        method: "ngram" or "draft".
        num_tokens: k, the most proposals per sequence and step.
        acceptance: accepted / proposed tokens at k proposals per step (the ratio the engine reports);
            0.0 when none is known, and then no speed-up is predicted.
        adaptive: the engine picks k per step, 0 included (`speculative.adaptive`): the model takes the k with
            the fewest seconds per token; False: always k, even where that is slower.
        draft_cost: seconds of one draft forward per second of the target's plain step at the same batch; the
            draft method's proposing where the profile has no measured speculative step (`deploy.performance`
            counts it from the two models' weight bytes).
    """

    method: str
    num_tokens: int
    acceptance: float = 0.0
    adaptive: bool = True
    draft_cost: float = 0.0
    alpha: float = field(init=False, repr=False, compare=False)     # the per-token acceptance

    def __post_init__(self) -> None:
        object.__setattr__(self, "alpha", per_token_acceptance(self.acceptance, self.num_tokens))

    @property
    def choices(self) -> range:
        """The k a step may run with."""
        return range(0 if self.adaptive else self.num_tokens, self.num_tokens + 1)

    def tokens_per_step(self, num_tokens: int) -> float:
        """Tokens a step with `num_tokens` proposals yields per sequence at this acceptance."""
        return expected_tokens(self.alpha, num_tokens)

    def with_acceptance(self, acceptance: float) -> Speculation:
        return replace(self, acceptance=acceptance)


@dataclass(slots=True, frozen=True)
class DecodeStep:
    """The decode step the engine runs at a batch and context: `num_tokens` proposals per sequence
    (0: a plain step), its seconds, and the tokens it yields per sequence."""

    num_tokens: int
    step_s: float
    tokens_per_step: float

    @property
    def token_s(self) -> float:
        """Seconds per output token of each sequence."""
        return self.step_s / self.tokens_per_step


class PerformanceModel(ABC):
    """Seconds of the phases on one actor and of the KV link between two.

    Attributes:
        kv_bytes_per_token: K and V of one prompt token over all layers (what a handoff moves per token).
        speculation: the decode actors' speculative decoding; None: off.
    """

    kv_bytes_per_token: float
    speculation: Speculation | None = None

    @abstractmethod
    def prefill_seconds(self, prompt_len: float) -> float:
        """One prompt of `prompt_len` tokens computed alone (its TTFT share on an idle actor)."""

    @abstractmethod
    def prefill_capacity(self, prompt_len: float) -> float:
        """Prompt tokens/s one actor sustains on `prompt_len`-token prompts when it always has work."""

    @abstractmethod
    def decode_step_seconds(self, batch: float, context: float) -> float:
        """One decode step of `batch` sequences that each attend over `context` tokens."""

    def spec_step_seconds(self, batch: float, context: float, num_tokens: int) -> float:
        """One decode step in which each of `batch` sequences verifies `num_tokens` proposals (1 + k query
        tokens), the proposing included. Where it was not measured: a plain step of batch · (1 + k)
        sequences (the same query rows; it also counts their KV reads, so it errs slow), plus, for the draft
        method, k draft forwards of `draft_cost` plain steps each."""
        plain = self.decode_step_seconds(batch, context)
        if num_tokens <= 0:
            return plain
        seconds = self.decode_step_seconds(batch * (1 + num_tokens), context)
        spec = self.speculation
        if spec is not None and spec.method == "draft":
            seconds += num_tokens * spec.draft_cost * plain
        return seconds

    def decode_step(self, batch: float, context: float, acceptance: float | None = None) -> DecodeStep:
        """The step the engine runs with `batch` sequences at `context` tokens: a plain one without
        speculation; with it, the k of `speculation.choices` with the fewest seconds per token (the turn-down's
        choice: the most tokens per second at this batch), at `acceptance` (None: the speculation's own)."""
        spec = self.speculation
        if spec is None:
            return DecodeStep(0, self.decode_step_seconds(batch, context), 1.0)
        if acceptance is not None:
            spec = spec.with_acceptance(acceptance)
        steps = [DecodeStep(k, self.spec_step_seconds(batch, context, k), spec.tokens_per_step(k))
                 for k in spec.choices]
        return min(steps, key=lambda s: (s.token_s, s.num_tokens))

    def token_seconds(self, batch: float, context: float, acceptance: float | None = None) -> float:
        """Seconds per output token of each of `batch` sequences decoding at `context` tokens: the TPOT the
        planner and auto placement predict (`decode_step`; without speculation, the plain step)."""
        return self.decode_step(batch, context, acceptance).token_s

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


class _StepGrid:
    """Step seconds measured at (batch, context) points: piecewise-linear in batch, then linear in context
    between the measured contexts (clamped to the nearest outside them); made non-decreasing in batch and
    context first (see `_monotone`)."""

    def __init__(self, points: list[dict]):
        grid: dict[int, dict[int, float]] = {}
        for p in points:
            grid.setdefault(p["context"], {})[p["batch"]] = p["seconds"]
        self.contexts = sorted(grid)
        for i, c in enumerate(self.contexts[:-1]):          # a longer context never steps faster
            longer = grid[self.contexts[i + 1]]
            for b in grid[c]:
                grid[c][b] = min(grid[c][b], longer.get(b, grid[c][b]))
        self.steps = {c: (sorted(grid[c]), _monotone([grid[c][b] for b in sorted(grid[c])])) for c in self.contexts}

    def seconds(self, batch: float, context: float) -> float:
        cs = self.contexts
        at = [_interp(*self.steps[c], batch) for c in cs]
        if len(cs) == 1 or context <= cs[0]:
            return at[0]
        if context >= cs[-1]:
            return at[-1]
        return _interp(cs, at, context)


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
    actor, the transit, the adopt), and to every send on the prefill actor its time by the MB (10^6 bytes)
    it ships on the wire (the sender's own work beyond the idle link's measured rate, where it shares the
    prefill's cores: `send_curve`, [wire MB, seconds] points measured at a few prompt lengths, plus `send_s`
    and `send_s_per_mb` from older calibrations; `send_seconds`), so whoever asks gets serving's time, not
    the bare engine's. On a host the actors share, `shared_prefill` and `shared_decode` are how much longer
    a prefill or decode step takes while another actor on the host is in a step (`shared_factor`).

    Speculative steps: where the profile measured them (`"speculative"`: the decode steps again with k
    proposals per sequence, at one k or a few, for the method `speculation` names), a step with j proposals
    is piecewise-linear in j through the plain step (j = 0) and the measured ones (linear beyond the last),
    never faster with more proposals; otherwise `PerformanceModel.spec_step_seconds`'s stated assumption.
    """

    def __init__(self, data: dict, speculation: Speculation | None = None):
        self.data = data
        self.speculation = speculation
        self.prefill_costs = ModelCosts.from_dict(data["prefill"]["engine"]["costs"])
        self.costs = ModelCosts.from_dict(data["decode"]["engine"]["costs"])
        self.kv_bytes_per_token = float(self.costs.kv_bytes_per_token)
        prefill = data["prefill"]["points"]
        # one prompt's seconds by length; a length measured twice keeps its faster time (the saturated step is
        # one prompt too where the token budget takes one, and noise only adds time)
        single: dict[float, float] = {}
        for p in prefill:
            if p.get("batch", 1) == 1:
                single[p["prompt_len"]] = min(p["seconds"], single.get(p["prompt_len"], p["seconds"]))
        self._s = sorted(single)
        seconds = _monotone([single[s] for s in self._s])
        self._rate = [self.prefill_costs.prefill_flops(s) / t for s, t in zip(self._s, seconds)]
        # saturated steps (several prompts batched): prompt tokens/s at each length
        full = sorted((p for p in prefill if p.get("batch", 1) > 1), key=lambda p: p["prompt_len"])
        self._sat = ([p["prompt_len"] for p in full], [p["batch"] * p["prompt_len"] / p["seconds"] for p in full])
        self._decode = _StepGrid(data["decode"]["points"])
        spec = self.spec_measured
        by_k: dict[int, list[dict]] = {}
        for p in spec.get("points") or []:
            by_k.setdefault(p["num_tokens"], []).append(p)
        self._spec = {k: _StepGrid(by_k[k]) for k in sorted(by_k) if k > 0}       # proposals per sequence → steps
        self._spec_method = spec.get("method")                                    # the method they were run with
        # serving-path factors measured on the running cluster: time in serving / time in the profile
        calibration = data.get("calibration", {})
        self.calibration = {k: float(v) for k, v in calibration.items()
                            if k in ("prefill", "decode", "shared_prefill", "shared_decode")}
        self.step_overhead_s = float(calibration.get("step_s", 0.0))      # added to every decode step
        self.handoff_s = float(calibration.get("handoff_s", 0.0))         # added to every KV handoff
        self.send_s = float(calibration.get("send_s", 0.0))               # a send's time on the prefill actor
        self.send_s_per_byte = float(calibration.get("send_s_per_mb", 0.0)) / 1e6    # ... and per wire byte
        curve = sorted((float(mb) * 1e6, float(s)) for mb, s in calibration.get("send_curve", []))
        self._send_bytes, self._send_s = [b for b, _ in curve], _monotone([s for _, s in curve])
        link = self.transfer
        self._kv_bytes_per_s = float(link.get("kv_bytes_per_s") or DEFAULT_KV_BYTES_PER_S)

    @property
    def spec_measured(self) -> dict:
        """The speculative measurements (`deploy.profiler`): {"method", "num_tokens", "points", "acceptance"},
        {} in profiles made without speculation or before it was measured."""
        return dict(self.data.get("speculative") or {})

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
        if not points:
            return None
        data = {**self.data, pool: points}
        if pool == "decode":                # the speculative steps were measured at degree 1 only
            data["speculative"] = {k: v for k, v in self.spec_measured.items() if k != "points"}
        return MeasuredPerformance(data, self.speculation)

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
        return self._serving(self._decode.seconds(batch, context))

    def spec_step_seconds(self, batch: float, context: float, num_tokens: int) -> float:
        spec = self.speculation
        if num_tokens <= 0 or not self._spec or spec is None or self._spec_method != spec.method:
            return super().spec_step_seconds(batch, context, num_tokens)
        seconds = [self._decode.seconds(batch, context)]
        for grid in self._spec.values():          # more proposals never verify faster (noise only adds time)
            seconds.append(max(grid.seconds(batch, context), seconds[-1]))
        return self._serving(max(_interp([0, *self._spec], seconds, num_tokens), seconds[0]))

    def _serving(self, seconds: float) -> float:
        """A profiled decode step's time in serving (the calibration's factor and fixed cost)."""
        return self.calibration.get("decode", 1.0) * seconds + self.step_overhead_s

    def send_seconds(self, wire_bytes: float) -> float:
        """A KV send's time on the prefill actor beyond the link's: `send_s` + `send_s_per_mb`, plus
        `send_curve` piecewise-linear in the wire bytes (its first point's time below it, its last
        segment's slope beyond it, never less with more bytes)."""
        seconds = self.send_s + wire_bytes * self.send_s_per_byte
        xs, ys = self._send_bytes, self._send_s
        if not xs:
            return seconds
        if wire_bytes <= xs[0] or len(xs) == 1:
            return seconds + ys[0]
        if wire_bytes >= xs[-1]:
            slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]) if xs[-1] > xs[-2] else 0.0
            return seconds + ys[-1] + slope * (wire_bytes - xs[-1])
        return seconds + _interp(xs, ys, wire_bytes)

    def shared_factor(self, prefill: bool) -> float:
        """How much longer a step takes on a shared host while one other actor there is in a step (the
        calibration's `shared_prefill` for a step with a prompt chunk, else `shared_decode`; 1 uncalibrated)."""
        return self.calibration.get("shared_prefill" if prefill else "shared_decode", 1.0)

    @property
    def shares_calibrated(self) -> bool:
        return "shared_prefill" in self.calibration or "shared_decode" in self.calibration


class LinearPerformance(PerformanceModel):
    """A few figures, for a cluster that has measured nothing yet: prompts at a flat rate, a decode step
    linear in batch (context left out), a fixed link rate. The router's live model corrects them from
    the first requests' reports."""

    def __init__(self, prefill_tokens_per_s: float = 2000.0, step_base_s: float = 0.02,
                 step_per_seq_s: float = 0.001, kv_bytes_per_s: float = DEFAULT_KV_BYTES_PER_S,
                 kv_bytes_per_token: float = 0.0, speculation: Speculation | None = None):
        self.prefill_tokens_per_s, self.step_base_s, self.step_per_seq_s = (prefill_tokens_per_s, step_base_s,
                                                                           step_per_seq_s)
        self._kv_bytes_per_s, self.kv_bytes_per_token = kv_bytes_per_s, kv_bytes_per_token
        self.speculation = speculation

    @property
    def kv_bytes_per_s(self) -> float:
        return self._kv_bytes_per_s

    def prefill_seconds(self, prompt_len: float) -> float:
        return prompt_len / self.prefill_tokens_per_s

    def prefill_capacity(self, prompt_len: float) -> float:
        return self.prefill_tokens_per_s

    def decode_step_seconds(self, batch: float, context: float) -> float:
        return self.step_base_s + self.step_per_seq_s * max(batch, 0.0)
