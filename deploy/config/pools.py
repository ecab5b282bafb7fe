"""The ``pools`` section: actor counts (fixed or ``auto`` within min/max),
Ray resources per actor, batch policy, and optional per-pool model and KV
cache overrides (cross-checked against the top level in ``deploy.config.root``)."""
from __future__ import annotations

from typing import Annotated, Literal, Optional, Union

from pydantic import AfterValidator, Field, field_validator, model_validator

from deploy.config.base import FieldProblem, Float, Int, Section
from deploy.config.kv_cache import KVCacheSection
from deploy.config.model import Quantization, QuantizationGroupSize, check_model_name

RESERVED_RESOURCES = {"CPU": "num_cpus", "GPU": "num_gpus", "memory": "num_cpus",
                      "object_store_memory": "num_cpus"}


class ResourcesSection(Section):
    """Ray resources one actor of the pool reserves."""

    num_cpus: Float = Field(1.0, gt=0, description="CPUs per actor (Ray num_cpus).")
    num_gpus: Float = Field(0.0, ge=0, description="GPUs per actor (Ray num_gpus); "
                            "fractions share a GPU.")
    torch_threads: Optional[Int] = Field(None, ge=1, description="torch.set_num_threads in "
                                         "the actor; unset = max(1, floor(num_cpus)).")
    custom: dict[str, Float] = Field(
        default_factory=dict, description="Ray custom resources per actor, e.g. "
        "{prefill_node: 1} to pin the pool to nodes started with that resource.")

    @field_validator("custom")
    @classmethod
    def _custom_names(cls, value: dict[str, float]) -> dict[str, float]:
        for name, amount in value.items():
            if name in RESERVED_RESOURCES:
                raise FieldProblem(name, f"use resources.{RESERVED_RESOURCES[name]}"
                                   " instead of a custom resource")
            if not name.strip():
                raise ValueError("resource names must not be empty")
            if amount <= 0:
                raise FieldProblem(name, f"must be > 0, got {amount!r}")
        return value

    def threads(self) -> int:
        """Threads torch should use in this actor."""
        return self.torch_threads or max(1, int(self.num_cpus))


def _count(value: object) -> object:
    if value == "auto":
        return value
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"expected an integer or 'auto', got {value!r}")
    if value < 1:
        raise ValueError(f"must be >= 1 or 'auto', got {value}")
    return value


def _optional_model(value: Optional[str], info) -> Optional[str]:
    return None if value is None else check_model_name(value, info)


class PoolSection(Section):
    """Fields every pool has."""

    count: Union[int, Literal["auto"]] = Field(
        1, description="Actors in the pool, or 'auto' (planner + autoscaler within min..max).")
    min: Optional[Int] = Field(None, ge=1, description="Fewest actors; required with count: auto.")
    max: Optional[Int] = Field(None, ge=1, description="Most actors; required with count: auto.")
    resources: ResourcesSection = Field(default_factory=ResourcesSection,
                                        description="Ray resources per actor.")
    max_restarts: Int = Field(3, ge=-1, description="Ray restarts of a dead actor before the "
                              "pool manager replaces it; -1 = unlimited.")
    model: Annotated[Optional[str], AfterValidator(_optional_model)] = Field(
        None, description="Override of model.name for this pool; all pools must agree.")
    kv_cache: Optional[KVCacheSection] = Field(
        None, description="Override of the top-level kv_cache for this pool (e.g. a "
        "smaller budget on prefill); block_size must agree across pools.")
    quantization: Optional[Quantization] = Field(
        None, description="Override of model.quantization for this pool, e.g. int4 on decode (bytes per "
        "step) while prefill runs unquantized; pools may differ (the KV handshake compares the model's "
        "weights, not how a pool stores them).")
    quantization_group_size: Optional[QuantizationGroupSize] = Field(
        None, description="Override of model.quantization_group_size for this pool.")
    tensor_parallel: Int = Field(
        1, ge=1, description="Ranks each actor of the pool splits the model over (tensor parallelism: one Ray "
        "actor per rank, placed together in a placement group; resources are per rank). Must divide the "
        "model's attention heads. Prefill and decode pools may differ: KV is resharded by head on the way "
        "(any kv_cache.dtype, any transport). Above 1 needs routing.role_flips off.")

    @field_validator("count", mode="before")
    @classmethod
    def _count_before(cls, value: object) -> object:
        return _count(value)

    @model_validator(mode="after")
    def _bounds(self) -> "PoolSection":
        if self.count == "auto":
            for key in ("min", "max"):
                if getattr(self, key) is None:
                    raise FieldProblem(key, "required when count is 'auto'")
        if self.min is not None and self.max is not None and self.min > self.max:
            raise FieldProblem("max", f"must be >= {{here}}.min ({self.min} > {self.max})")
        if isinstance(self.count, int):
            lo, hi = self.min or 1, self.max or self.count
            if not lo <= self.count <= hi:
                raise FieldProblem("count", f"must be within {{here}}.min..max "
                                   f"({self.count} not in {lo}..{hi})")
        return self

    @property
    def is_auto(self) -> bool:
        """True when the planner and autoscaler choose the count."""
        return self.count == "auto"

    def bounds(self) -> tuple[int, int]:
        """(min, max) actor counts; a fixed count is its own bounds."""
        if isinstance(self.count, int):
            return self.count, self.count
        assert self.min is not None and self.max is not None
        return self.min, self.max


class PrefillPoolSection(PoolSection):
    """Prefill actors: batched, chunked prompt processing."""

    max_batch_tokens: Int = Field(8192, ge=1, description="Prompt tokens in one prefill "
                                  "batch (the token budget of a step).")
    chunk_tokens: Int = Field(512, ge=1, description="Long prompts are prefilled in chunks "
                              "of this many tokens.")

    @model_validator(mode="after")
    def _chunk_fits(self) -> "PrefillPoolSection":
        if self.chunk_tokens > self.max_batch_tokens:
            raise FieldProblem("chunk_tokens", f"must be <= {{here}}.max_batch_tokens "
                               f"({self.chunk_tokens} > {self.max_batch_tokens})")
        return self


class DecodePoolSection(PoolSection):
    """Decode actors: continuous-batching token generation."""

    max_batch_size: Int = Field(64, ge=1, description="Most sequences decoded in one step.")


class PoolsSection(Section):
    """The actor pools. ``long_context`` is an optional second decode pool
    for requests longer than ``routing.long_request_tokens``."""

    prefill: PrefillPoolSection = Field(default_factory=PrefillPoolSection,
                                        description="Prefill pool.")
    decode: DecodePoolSection = Field(default_factory=DecodePoolSection,
                                      description="Decode pool.")
    long_context: Optional[DecodePoolSection] = Field(
        None, description="Decode pool for long requests (routing.long_request_tokens).")

    def items(self) -> list[tuple[str, PoolSection]]:
        """(name, pool) for every configured pool, prefill first."""
        pools: list[tuple[str, PoolSection]] = [("prefill", self.prefill), ("decode", self.decode)]
        if self.long_context is not None:
            pools.append(("long_context", self.long_context))
        return pools
