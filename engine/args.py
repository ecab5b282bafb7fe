"""Engine construction arguments as one plain, picklable settings object."""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(slots=True)
class EngineArgs:
    model: str = "small"
    dtype: str = "auto"
    device: str | None = None
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_gib: float = 1.0
    kv_memory_fraction: float | None = None     # CUDA: KV sized from the device (Engine)
    max_num_batched_tokens: int = 2048
    chunk_size: int | None = 512
    max_num_seqs: int = 64
    enable_prefix_cache: bool = True
    max_model_len: int | None = None
    attention: str = "auto"
    cuda_graphs: bool = False                   # pure-decode steps as CUDA graphs (Engine; needs flex)
    weight_layout: str = "auto"                 # projection weights' layout (engine/linear.py; auto: measured)
    torch_threads: int | None = None

    def build(self):
        """Create the engine (setting torch's thread count first, when given)."""
        import torch

        from engine.engine import Engine
        if self.torch_threads:
            torch.set_num_threads(self.torch_threads)
        kwargs = asdict(self)
        kwargs.pop("torch_threads")
        return Engine(kwargs.pop("model"), **kwargs)
