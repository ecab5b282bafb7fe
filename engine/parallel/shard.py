"""What one rank of a tensor-parallel group holds: its attention heads, KV heads and MLP slice.

Megatron's split over `size` ranks: q/k/v and gate/up are column-parallel (each rank computes its heads
and its share of the intermediate size), o and down are row-parallel (each rank multiplies its share of
their input and one all-reduce sums the partial outputs). Rank r holds query heads
[r * Hq / size, (r + 1) * Hq / size). KV heads are split the same way when there are at least as many as
ranks; with fewer (GQA, say 2 KV heads over 4 ranks) each rank holds the one KV head its query heads read,
so `size / Hkv` ranks hold a copy of each (as vLLM does). Each rank's paged cache holds its KV heads only.

The embedding is replicated on every rank and the LM head lives on rank 0 alone (the rank that samples):
no gather of logits, at the price of one embedding table per rank. Row-parallel biases (o_proj, down_proj
where the architecture has them) are added by rank 0 only, so the all-reduce adds them once.

`weight_slices` maps a checkpoint tensor's name to the rows or columns of it a rank loads, so a rank reads
its shard straight from the safetensors files and never the whole model.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.model.config import ModelConfig

TP_KEY = "tensor_parallel"      # the name a degree that does not fit is reported under


@dataclass(frozen=True, slots=True)
class HeadShard:
    """Rank `rank` of `size`: its query heads, KV heads (from `kv_head_start`) and intermediate slice."""

    rank: int
    size: int
    num_heads: int                # query heads on this rank
    num_kv_heads: int             # KV heads on this rank (and in its paged cache)
    head_start: int               # first query head
    kv_head_start: int            # first KV head
    intermediate_size: int        # columns of gate/up (rows of down) on this rank
    intermediate_start: int

    @property
    def kv_heads(self) -> range:
        """The model's KV heads this rank computes and caches."""
        return range(self.kv_head_start, self.kv_head_start + self.num_kv_heads)


def check_degree(cfg: ModelConfig, size: int, key: str = TP_KEY, quantization: str = "none") -> None:
    """Raise ValueError naming `key` and the model's head counts when `size` ranks cannot split it, or
    when its projections are quantized (`quantization`, or a quantized checkpoint): those are not sharded."""
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"{key} must be a positive integer, got {size!r}")
    if size > 1 and (quantization != "none" or cfg.quantization is not None):
        what = f"a {cfg.quantization.method} checkpoint" if cfg.quantization is not None else quantization
        raise ValueError(f"{key} {size}: quantized projections ({what}) are not sharded across ranks; "
                         f"use tensor_parallel 1 for a quantized model, or quantization none")
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    if heads % size:
        raise ValueError(f"{key} {size} does not divide the model's {heads} attention heads "
                         f"({kv_heads} KV heads); choose a divisor of {heads}")
    if kv_heads % size and size % kv_heads:
        raise ValueError(f"{key} {size} neither divides the model's {kv_heads} KV heads nor is a multiple of "
                         f"them ({heads} attention heads)")
    if cfg.intermediate_size % size:
        raise ValueError(f"{key} {size} does not divide the model's intermediate_size {cfg.intermediate_size}")


def shard_heads(cfg: ModelConfig, size: int = 1, rank: int = 0, key: str = TP_KEY,
                quantization: str = "none") -> HeadShard:
    """Rank `rank`'s share of the model over `size` ranks (size 1: the whole model)."""
    check_degree(cfg, size, key, quantization)
    if not 0 <= rank < size:
        raise ValueError(f"tensor-parallel rank {rank} is outside [0, {size})")
    heads, kv_heads = cfg.num_attention_heads // size, max(cfg.num_key_value_heads // size, 1)
    # with fewer KV heads than ranks, rank r's query heads all read KV head r * Hkv // size
    kv_start = rank * kv_heads if cfg.num_key_value_heads >= size else rank * cfg.num_key_value_heads // size
    inter = cfg.intermediate_size // size
    return HeadShard(rank, size, heads, kv_heads, rank * heads, kv_start, inter, rank * inter)


def kv_head_ranges(cfg: ModelConfig, size: int) -> list[range]:
    """The KV heads each of `size` ranks caches, in rank order (the map KV resharding works from)."""
    return [shard_heads(cfg, size, r).kv_heads for r in range(size)]


def weight_slices(name: str, cfg: ModelConfig, shard: HeadShard) -> tuple[int, list[tuple[int, int]]] | None:
    """(dim, [(start, end), ...]) of checkpoint tensor `name` that `shard` loads (the pieces concatenated
    along dim), or None for the whole tensor."""
    if shard.size == 1:
        return None
    d, q = cfg.head_dim, cfg.num_attention_heads * cfg.head_dim
    kv, inter = cfg.num_key_value_heads * cfg.head_dim, cfg.intermediate_size
    q_rows = (shard.head_start * d, (shard.head_start + shard.num_heads) * d)
    kv_rows = (shard.kv_head_start * d, (shard.kv_head_start + shard.num_kv_heads) * d)
    i_rows = (shard.intermediate_start, shard.intermediate_start + shard.intermediate_size)
    parts = name.split(".")
    module, kind = (parts[-2], parts[-1]) if len(parts) >= 2 else ("", "")
    if module == "q_proj":
        return 0, [q_rows]
    if module in ("k_proj", "v_proj"):
        return 0, [kv_rows]
    if module == "qkv_proj":          # Phi-3: [q | k | v] rows in one tensor
        return 0, [q_rows, (q + kv_rows[0], q + kv_rows[1]), (q + kv + kv_rows[0], q + kv + kv_rows[1])]
    if module in ("gate_proj", "up_proj"):
        return 0, [i_rows]
    if module == "gate_up_proj":      # Phi-3: [gate | up]
        return 0, [i_rows, (inter + i_rows[0], inter + i_rows[1])]
    if kind == "weight" and module == "o_proj":
        return 1, [q_rows]
    if kind == "weight" and module == "down_proj":
        return 1, [i_rows]
    return None
