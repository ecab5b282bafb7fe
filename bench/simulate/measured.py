"""Step times from a measured profile of this machine (`pdserve profile`, read by
`engine.performance.MeasuredPerformance`).

The profile holds what the planner knows of the hardware: one prompt's prefill seconds by length,
the decode step's seconds by batch and context, and the KV link's measured transfer. A step of the
simulated scheduler is priced from those points:

    decode rows (1 new token each)     decode_step_seconds(rows, their mean context)
    decode rows verifying proposals    spec_step_seconds(rows, their mean context, their mean proposals)
    each prefill chunk (n tokens → c)  prefill_seconds(c) − prefill_seconds(c − n)   (its share of the prompt)
    a mixed step                       the sum of both
    a step of prefill chunks alone     also the serving path's fixed cost of a step

(the speculative step: the profile's measured one where it has points for the actor's method, the
draft's proposing timed in; else `engine.performance`'s estimate, a plain step of rows · (1 + k) plus
the draft's forwards — exactly what the planner predicts from the same profile.)
(the profile's answers include its serving-path calibration, `bench.serving.plan_check --calibrate`:
time factors and the fixed costs of a step and of a handoff). The link moves wire bytes at the
measured wire bytes per second (through the configured transport and codec, encode and decode
included), plus the calibrated fixed cost of a handoff; the calibrated cost of a send (fixed and
per wire MB) is the prefill actor's own time (`send_busy_s`): it lengthens the step that sends, as
the send's work does on the CPU cores the prefill computes on.

With `--shared-host` (`with_shared_host`) every simulated actor is on the one host the profile was
measured on, as `pdserve bench serve --embedded` runs them: a step with a prompt chunk (its send
included) that starts while k other actors are in a step takes 1 + k·(`shared_prefill` − 1) times as
long; a decode step 1 + k·(`shared_decode` − 1), k counting only the actors in a step with a prompt
chunk (`bench.simulate.sim_cluster.SimActor._shared`). Both factors are the calibration's, measured
with one other actor busy (`bench.serving.plan_check`'s shared phase).

A pool at tensor-parallel degree N > 1 is priced from the points `pdserve profile --tp N` measured
for that pool at N (`MeasuredPerformance.at_degree`); a profile without them refuses the degree
(no prediction: measure it, or simulate the GPU with --hardware). The link is the measured one at
every degree.
"""
from __future__ import annotations

import copy
from collections.abc import Sequence

from bench.simulate.step_time import Chunk, StepTimeModel
from deploy.profiler import load_profile
from engine.performance import MeasuredPerformance, Speculation

DEFAULT_LINK_BYTES_PER_S = 1e9      # a profile without a link measurement


class MeasuredModel(StepTimeModel):
    def __init__(self, profile: MeasuredPerformance, name: str = "measured"):
        self.profile = profile
        self.name = name
        self.kv_bytes_per_token = profile.costs.kv_bytes_per_token
        self.num_layers = profile.costs.num_layers
        link = profile.transfer
        wire, seconds = link.get("wire_bytes") or link.get("kv_bytes"), link.get("seconds")
        self.link_bytes_per_s = wire / seconds if wire and seconds else DEFAULT_LINK_BYTES_PER_S

    def at_degree(self, pool: str, degree: int) -> StepTimeModel:
        """The model over `pool`'s points measured at `degree`; ValueError naming the key when there are none."""
        if degree == 1:
            return self
        at = self.profile.at_degree(pool, degree)
        if at is None:
            measured = ", ".join(map(str, self.profile.degrees(pool)))
            raise ValueError(f"pools.{pool}.tensor_parallel {degree}: the profile measured {pool} at tensor-parallel "
                             f"degree {measured} only; run `pdserve profile --tp 1,{degree}` for this config, or "
                             "simulate a GPU with --hardware")
        model = MeasuredModel(at, f"{self.name}, {pool} tp={degree}")
        model.shared_host = self.shared_host
        return model

    @classmethod
    def from_file(cls, path: str) -> MeasuredModel:
        return cls(MeasuredPerformance(load_profile(path)), f"measured: {path}")

    def with_speculation(self, speculation: Speculation) -> MeasuredModel:
        """The profile's speculative steps (or its estimate of them) for `speculation`'s method."""
        model = MeasuredModel(MeasuredPerformance(self.profile.data, speculation), self.name)
        model.speculation, model.shared_host = speculation, self.shared_host
        return model

    def step_s(self, chunks: Sequence[Chunk]) -> float:
        decode = [c for c in chunks if c.new_tokens - c.proposals == 1]
        if decode:           # (the serving path's fixed cost of a step is in the decode step's time)
            batch = len(decode)
            context = sum(c.context - c.proposals for c in decode) / batch
            proposals = sum(c.proposals for c in decode) / batch
            seconds = self.profile.spec_step_seconds(batch, context, proposals) if proposals else \
                self.profile.decode_step_seconds(batch, context)
        else:
            seconds = self.profile.step_overhead_s
        for c in chunks:
            if c.new_tokens - c.proposals > 1:
                seconds += self.profile.prefill_share_seconds(c.context, c.new_tokens)
        return seconds

    def link_s(self, wire_bytes: float) -> float:
        return self.profile.handoff_s + wire_bytes / self.link_bytes_per_s

    def shared_factor(self, prefill: bool) -> float:
        return self.profile.shared_factor(prefill) if self.shared_host else 1.0

    def with_shared_host(self) -> MeasuredModel:
        """The profile's shared-host factors (`shared_prefill`, `shared_decode`, measured by plan_check's shared
        phase) in every step that overlaps another actor's; ValueError naming the calibration where it has none."""
        if not self.profile.shares_calibrated:
            return super().with_shared_host()
        model = copy.copy(self)
        model.shared_host, model.name = True, f"{self.name}, every actor on one shared host"
        return model

    def send_busy_s(self, wire_bytes: float) -> float:
        """The calibrated time of a send on the prefill actor (`MeasuredPerformance.send_seconds`): on the CPU
        host a profile measures, the send's encode and socket work share the cores of the forward pass."""
        return self.profile.send_seconds(wire_bytes)
