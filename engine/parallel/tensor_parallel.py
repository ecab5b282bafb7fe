"""One rank's part in a tensor-parallel engine: its shard, its group, and its end of the plan channel.

Every rank builds the same `Engine` from the same `EngineArgs` but its own `tensor_parallel_rank`: the
model holds that rank's shard and the paged cache its KV heads. Rank 0 is the engine the worker drives (it
schedules, samples, owns the block tables and the KV events); its runner posts each step's plan. Every
other rank calls `Engine.follow()`, which runs those plans until rank 0 closes the group (`Engine.close`)
or dies. A rank's failure surfaces on rank 0 as `RankGroupError` from the step's all-reduce, and on a
follower as an error from its plan channel: either way the whole actor is done.

A degree of 1 builds nothing: no store, no group, no plans.
"""
from __future__ import annotations

import logging

import torch

from engine.model.config import ModelConfig
from engine.parallel.group import RankGroup
from engine.parallel.shard import HeadShard, shard_heads
from engine.parallel.step_plan import PlanChannel, StepPlan

log = logging.getLogger(__name__)


class TensorParallel:
    """Args:
        cfg: the model's config (its head counts are split; a degree that does not fit is a ValueError
            naming `tensor_parallel` and the counts).
        size, rank: the group's degree and this process's rank.
        address: "host:port" of rank 0's store (ignored at degree 1).
        device: the rank's device (NCCL on CUDA, gloo otherwise).
        timeout_s: the bound on joining the group and on every collective.
        quantization: the engine's `quantization` (quantized projections are not sharded: a ValueError
            at a degree above 1, before any rank waits for the others).
        backend: the group's backend (`RankGroup`): auto, nccl or gloo.
    """

    def __init__(self, cfg: ModelConfig, size: int = 1, rank: int = 0, address: str = "127.0.0.1:0",
                 device: torch.device | None = None, timeout_s: float = 60.0, quantization: str = "none",
                 backend: str = "auto"):
        self.shard: HeadShard = shard_heads(cfg, size, rank, quantization=quantization)
        self.group = RankGroup(rank, size, address, device, timeout_s, backend)
        self.channel = PlanChannel(self.group.store, rank) if size > 1 else None

    @property
    def rank(self) -> int:
        return self.shard.rank

    @property
    def size(self) -> int:
        return self.shard.size

    def follow(self, runner) -> None:
        """A rank other than 0: run rank 0's plans through `runner` until it closes the group."""
        assert self.rank > 0, "rank 0 schedules; it does not follow"
        log.info("tensor-parallel rank %d of %d following rank 0's step plans", self.rank, self.size)
        try:
            runner.follow(self.channel)
        finally:
            self.group.close()
        log.info("tensor-parallel rank %d of %d: rank 0 closed the group", self.rank, self.size)

    def close(self) -> None:
        """Rank 0: the other ranks return from `follow` (idempotent)."""
        if self.channel is not None and self.rank == 0:
            try:
                self.channel.post(StepPlan([], [], [], [], stop=True))
            except Exception:         # a follower or the store already gone: nothing left to tell
                pass
            self.group.close()
            self.channel = None

