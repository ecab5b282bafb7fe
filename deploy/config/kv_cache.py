"""The ``kv_cache`` section (also a per-pool override): block size, storage dtype and the block memory budget."""
from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, field_validator, model_validator

from deploy.config.base import GIB, FieldProblem, Float, Int, Section
from deploy.config.kv_tiers import KVTierSection


class KVCacheSection(Section):
    """Paged KV cache: block size and the memory budget for blocks.

    Set at most one of ``memory_fraction``, ``num_blocks``, ``memory_gib``;
    with none set the budget is ``memory_fraction`` = 0.9.
    """

    block_size: Int = Field(16, description="Tokens per KV block; a power of 2 in 1..256. "
                            "Prefill and decode must agree (it fixes the transfer layout).")
    dtype: Literal["auto", "fp8", "int8"] = Field(
        "auto", description="How the cache stores K and V: auto (the model dtype), fp8 (float8_e4m3fn + one "
        "float32 scale per block × layer × K/V × head) or int8 (+ one scale per token × head): about half the "
        "bytes of bf16, a quarter of float32, so about 2x / 4x the blocks at equal memory. Blocks then travel as "
        "stored (kv_transfer.compression is implied); every pool must use the same.")
    memory_fraction: Optional[Float] = Field(
        None, gt=0, le=1, description="GPU: the actor's share of its device's total memory; the KV "
        "cache gets it less the weights, a profiled largest step's activations and a reserve "
        "(engine/kv_cache/memory_budget.py), as vLLM's gpu_memory_utilization. CPU: this fraction of a 1 GiB base.")
    num_blocks: Optional[Int] = Field(None, ge=1,
                                      description="Exact number of KV blocks per actor.")
    memory_gib: Optional[Float] = Field(None, gt=0, description="KV block memory per actor, GiB.")
    tiers: list[KVTierSection] = Field(
        default_factory=list, description="Tiers below each actor's paged cache, top first: at most one host "
        "tier, then at most one disk tier (docs/kv-tiers.md). Empty: no tiers.")
    offload_queue_blocks: Int = Field(64, ge=1, description="With tiers: the most evicted blocks waiting to be "
                                      "written down; more are dropped (counted), never waited for.")

    @field_validator("block_size")
    @classmethod
    def _power_of_two(cls, value: int) -> int:
        if not 1 <= value <= 256 or value & (value - 1):
            raise ValueError(f"must be a power of 2 in 1..256, got {value}")
        return value

    @model_validator(mode="after")
    def _one_budget(self) -> "KVCacheSection":
        chosen = self.budget_keys()
        if len(chosen) > 1:
            raise FieldProblem(chosen[1], f"cannot be combined with {{here}}.{chosen[0]} "
                               "(set one of memory_fraction, num_blocks, memory_gib)")
        return self

    @field_validator("tiers")
    @classmethod
    def _tier_order(cls, tiers: list[KVTierSection]) -> list[KVTierSection]:
        kinds = [tier.kind for tier in tiers]
        for i, kind in enumerate(kinds):
            if kind in kinds[:i]:
                raise FieldProblem(f"{i}.kind", f"one {kind} tier at most")
        if kinds == ["disk", "host"]:
            raise FieldProblem("1.kind", "the host tier goes above the disk tier (list it first)")
        return tiers

    def budget_keys(self) -> list[str]:
        """Names of the budget fields that are set, in declaration order."""
        names = ("memory_fraction", "num_blocks", "memory_gib")
        return [name for name in names if getattr(self, name) is not None]

    def device_fraction(self) -> float | None:
        """memory_fraction (0.9 when no budget key is set) when the budget is a fraction, else None:
        GPU actors then size their cache from the device."""
        if self.num_blocks is not None or self.memory_gib is not None:
            return None
        return 0.9 if self.memory_fraction is None else self.memory_fraction

    def resolve_num_blocks(self, bytes_per_block: int, free_bytes: int = 0) -> int:
        """Blocks one actor allocates.

        Args:
            bytes_per_block: KV bytes of one block over all layers (K and V).
            free_bytes: memory left after weights; only used for memory_fraction.
        Returns:
            The block count (0 when the budget does not fit one block).
        """
        assert bytes_per_block > 0
        if self.num_blocks is not None:
            return self.num_blocks
        if self.memory_gib is not None:
            return int(self.memory_gib * GIB) // bytes_per_block
        fraction = 0.9 if self.memory_fraction is None else self.memory_fraction
        return int(fraction * free_bytes) // bytes_per_block
