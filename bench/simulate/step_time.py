"""What the simulator asks of the hardware: how long one engine step takes, and one KV handoff.

The simulator runs the real schedulers; each step they produce is a list of `Chunk`s (one per
scheduled sequence: the tokens it computes this step and the context it attends over), and a
`StepTimeModel` turns that list into seconds. Two models implement it:

    bench.simulate.measured.MeasuredModel   a `pdserve profile` file of this machine
    bench.simulate.roofline.RooflineModel   a hardware file (peak FLOP/s, bytes/s, links) + a model's shape

Both answer for one actor (a tensor-parallel group counts as one actor: its all-reduces are in
`step_s`), and for the KV link between two actors (`link_s`). A pool's actors run at the pool's
degree (`pools.<pool>.tensor_parallel`): `at_degree` gives the model of an actor of that degree.

Speculative decoding: a sequence verifying k proposals is Chunk(1 + k, its length + k, proposals=k)
(its last sampled token and the proposals, each with its logits row). An actor that speculates is
priced by `with_speculation` of its pool's model: the model then knows the method (the draft
method's proposing is part of the step, `proposing_s`) and the acceptance its engine's stand-in
proposer meets (bench/simulate/sim_spec.py).
"""
from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from engine.args import EngineArgs
from engine.performance import Speculation


class Chunk(NamedTuple):
    """One sequence's share of a step: `new_tokens` computed, attending over `context` tokens
    (those computed before plus the new ones). A decode row is Chunk(1, its length); a decode row
    verifying k proposals is Chunk(1 + k, its length + k, k): every one of its rows is scored.
    (A tuple: one is made per scheduled sequence per simulated step.)"""

    new_tokens: int
    context: int
    proposals: int = 0


class StepTimeModel(ABC):
    """Seconds of one engine step and of one KV handoff, for one simulated actor.

    Attributes:
        name: what the model is, for the report ("measured: <profile>", "roofline: H100-SXM, llama-3-8b").
        kv_bytes_per_token: K and V of one token over all layers, at the cache's dtype (the transfer's bytes
            and the KV budget count with it).
        num_layers: decoder layers (the layer-wise handoff overlaps its send with them).
    """

    name: str
    kv_bytes_per_token: int
    num_layers: int
    speculation: Speculation | None = None     # set by `with_speculation` on an actor that speculates
    shared_host: bool = False                  # every actor on one host (`shared_factor`); `with_shared_host`

    @abstractmethod
    def step_s(self, chunks: Sequence[Chunk]) -> float:
        """One step of the batch `chunks` (non-empty), forward pass and sampling included; with chunks that
        verify proposals, also their proposing (`proposing_s` where the model has no measurement of it)."""

    def with_speculation(self, speculation: Speculation) -> StepTimeModel:
        """This model for an actor whose engine speculates with `speculation` (method, k, acceptance, the
        draft's cost)."""
        model = copy.copy(self)
        model.speculation = speculation
        return model

    def proposing_s(self, chunks: Sequence[Chunk]) -> float:
        """The draft method's proposing for the step's verifying chunks, as `engine.performance` counts it
        (`Speculation.draft_cost`): k draft forwards, each `draft_cost` × the target's plain step over the
        same sequences, k the rows' mean proposals. 0 for n-gram proposals (a few dict reads)."""
        spec = self.speculation
        if spec is None or spec.method != "draft":
            return 0.0
        rows = [c for c in chunks if c.new_tokens - c.proposals == 1]
        proposals = sum(c.proposals for c in rows)
        if not proposals:
            return 0.0
        plain = self.step_s([Chunk(1, c.context - c.proposals) for c in rows])
        return proposals / len(rows) * spec.draft_cost * plain

    @abstractmethod
    def link_s(self, wire_bytes: float) -> float:
        """Moving `wire_bytes` of KV from a prefill actor to a decode actor (latency included)."""

    def send_busy_s(self, wire_bytes: float) -> float:
        """The prefill actor's own work to ship `wire_bytes` (encode, copies, socket), on the cores its forward
        pass runs on: it lengthens the step that sends, before the link's time. None here: a GPU's copy
        engines and NIC move KV beside the compute."""
        return 0.0

    def shared_factor(self, prefill: bool) -> float:
        """With `shared_host`: how much longer a step (one with a prompt chunk if `prefill`) takes while one
        other actor is in a step on the host; 1 here (every actor has a device of its own)."""
        return 1.0

    def with_shared_host(self) -> StepTimeModel:
        """This model with every simulated actor on one host (as `pdserve bench serve --embedded` runs them);
        ValueError where the model cannot say what sharing costs."""
        raise ValueError(f"--shared-host: the time model {self.name!r} has no measure of actors sharing a host; "
                         "it needs a measured profile calibrated with `python -m bench.serving.plan_check --phases "
                         "light,shared --calibrate`")

    def at_degree(self, pool: str, degree: int) -> StepTimeModel:
        """The model of an actor of `pool` at tensor-parallel `degree` (`pools.<pool>.tensor_parallel`).
        This one serves degree 1; a model that knows no other degree refuses it, naming the key."""
        if degree == 1:
            return self
        raise ValueError(f"pools.{pool}.tensor_parallel {degree}: the time model {self.name!r} has no times at "
                         "tensor-parallel degrees above 1")

    def for_engine(self, args, kv) -> StepTimeModel:
        """This model for an actor built with engine settings `args` and KV section `kv` (its cache's dtype, its
        weights' quantization, its KV budget). This one times what it measured, as it was configured: itself."""
        return self

    def kv_blocks(self, block_size: int) -> int | None:
        """KV blocks one actor holds when its budget comes from the hardware (memory left after the
        weights), or None when the pool's configured budget applies."""
        return None


def sim_args(args: EngineArgs, model: StepTimeModel) -> EngineArgs:
    """The actor's engine settings with the pool size the hardware gives, when the time model knows it."""
    blocks = model.kv_blocks(args.block_size)
    if blocks is not None:
        args.num_blocks = blocks
    return args


@dataclass(frozen=True, slots=True)
class PoolModels:
    """The time model of each pool's actors at the pool's degree, and of the KV handoff between them.

    pools: each pool's `StepTimeModel.at_degree` of its `tensor_parallel` (prefill, decode and, where the config
        has one, long_context). Colocated actors run at one degree, the decode pool's (they take its engine
        settings, as `deploy.launcher` starts them).
    link: the handoff's model. KV resharded by head leaves the prefill actor's ranks and reaches the decode
        actor's, each rank over its own NIC: the side with fewer ranks binds, so the model at the lower
        degree prices it (a long-context actor's handoff is priced as a decode actor's).
    """

    pools: dict[str, StepTimeModel]
    link: StepTimeModel
    degrees: dict[str, int]

    @classmethod
    def of(cls, model: StepTimeModel, degrees: dict[str, int], colocated: bool = False) -> PoolModels:
        if colocated:
            degrees = {"prefill": degrees["decode"], "decode": degrees["decode"]}
        pools = {pool: model.at_degree(pool, degree) for pool, degree in degrees.items()}
        link = pools["prefill"] if degrees["prefill"] <= degrees["decode"] else pools["decode"]
        return cls(pools, link, degrees)

    @property
    def prefill(self) -> StepTimeModel:
        return self.pools["prefill"]

    @property
    def decode(self) -> StepTimeModel:
        return self.pools["decode"]

    def of_pool(self, pool: str) -> StepTimeModel:
        return self.pools.get(pool, self.pools["decode"])

    def describe(self) -> str:
        """"prefill tp=2, decode tp=1" for the report."""
        return ", ".join(f"{pool} tp={d}" for pool, d in self.degrees.items())
