"""Resharding KV blocks by head range between tensor-parallel degrees: which rank sends which heads where.

A prefill actor of degree Np and a decode actor of degree Nd hold the model's KV heads split differently
(`shard.kv_head_ranges`; with fewer KV heads than ranks a head sits on several ranks). `reshard_plan` says,
for every receiving rank, which sending rank gives it each of its heads, as few contiguous head ranges as
possible: every receiving rank's every head comes from exactly one sender, and copies of a replicated head
are spread over the senders that hold it. Both directions (Np > Nd and Np < Nd) and equal degrees (one
range per rank pair) come out of the same rule. `apply_plan` performs a plan on cache tensors in one
process: the reference a transport that ships each range as its own transfer must reproduce.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.model.config import ModelConfig
from engine.parallel.shard import kv_head_ranges


@dataclass(frozen=True, slots=True)
class HeadCopy:
    """KV heads `source_heads` of sending rank `source_rank`'s cache go to `dest_heads` of receiving rank
    `dest_rank`'s cache (positions in each rank's own cache, same length)."""

    source_rank: int
    dest_rank: int
    source_heads: range
    dest_heads: range


def reshard_plan(cfg: ModelConfig, source_degree: int, dest_degree: int) -> list[HeadCopy]:
    """The head copies that take a degree-`source_degree` group's KV to a degree-`dest_degree` group
    (each degree must fit the model: `shard.check_degree`)."""
    sources, dests = kv_head_ranges(cfg, source_degree), kv_head_ranges(cfg, dest_degree)
    copies: list[HeadCopy] = []
    for d, wanted in enumerate(dests):
        for position, head in enumerate(wanted):
            holders = [r for r, held in enumerate(sources) if head in held]
            source = holders[d % len(holders)]        # replicated heads: spread the receivers over the holders
            at = head - sources[source].start
            last = copies[-1] if copies else None
            if last is not None and (last.source_rank, last.dest_rank) == (source, d) and \
                    last.source_heads.stop == at and last.dest_heads.stop == position:
                copies[-1] = HeadCopy(source, d, range(last.source_heads.start, at + 1),
                                      range(last.dest_heads.start, position + 1))
            else:
                copies.append(HeadCopy(source, d, range(at, at + 1), range(position, position + 1)))
    return copies


def apply_plan(plan: list[HeadCopy], source_caches: list[torch.Tensor], dest_caches: list[torch.Tensor],
               source_blocks: list[int], dest_blocks: list[int]) -> None:
    """Copy the planned heads of blocks `source_blocks` into `dest_blocks` (same order), every layer, K and V.

    Caches: [L, NB, 2, Hkv_rank, bs, D], one per rank of each side."""
    src_index = torch.tensor(source_blocks, dtype=torch.long)
    dst_index = torch.tensor(dest_blocks, dtype=torch.long)
    for c in plan:
        source = source_caches[c.source_rank]
        cells = source[:, src_index.to(source.device)][:, :, :, c.source_heads.start:c.source_heads.stop]
        dest = dest_caches[c.dest_rank]
        dest[:, dst_index.to(dest.device), :, c.dest_heads.start:c.dest_heads.stop] = cells.to(dest.device)
