"""What the weight-quantization tests share: a small float32 engine and its logits of one prompt."""
from __future__ import annotations

import torch

from engine import Engine, EngineArgs


def small_engine(model_dir: str, **kw) -> Engine:
    """A float32 engine on the eager attention path with 32 blocks; `kw`: more `EngineArgs`."""
    return Engine(EngineArgs(model_dir, dtype="float32", num_blocks=32, attention="eager", **kw))


def prompt_logits(engine: Engine, ids: list[int]) -> torch.Tensor:
    """Logits at every position of `ids` as one fresh sequence ([len(ids), vocab], float32)."""
    blocks = engine.block_manager.allocate(4)
    try:
        return engine.runner.score(ids, blocks)
    finally:
        engine.block_manager.free(blocks)
