"""The engine's configuration: one plain, picklable settings object that `Engine` is built from."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.spec.config import SpecConfig

if TYPE_CHECKING:
    import torch

    from engine.kv_cache.tiers.spec import TierSpec

    from engine.model.config import ModelConfig
    from engine.sampling.generation_config import GenerationConfig
    from engine.tokenizer import Tokenizer


@dataclass(slots=True)
class EngineArgs:
    """Args:
        model: a preset name (`tiny`, `small`, `pydoc`) or a Hugging Face model directory.
        dtype: `auto` (bf16 on CUDA, float32 on CPU), `float32`, `bfloat16`, `float16` (or a torch dtype).
        device: `cuda` or `cpu` (default: CUDA when available).
        block_size: tokens per KV block.
        num_blocks: KV blocks in the pool (default: from `kv_cache_gib`).
        kv_cache_gib: the pool's size when `num_blocks` is not given.
        kv_cache_dtype: `auto` (the model dtype), `fp8` or `int8`: how the paged cache stores K and V
            (engine/kv_cache/kv_format.py: one byte per value with float32 scales; the budget then holds
            about 2x the blocks of bf16, 4x of float32).
        kv_memory_fraction: on a CUDA device, size the KV cache from the device instead of
            `num_blocks`/`kv_cache_gib`: this share of its memory less the weights, a profiled
            largest step's activations and a reserve (engine/kv_cache/memory_budget.py); ignored on CPU.
        max_num_batched_tokens: per-step token budget shared by prefill chunks and decodes.
        chunk_size: most prompt tokens one request computes per step; None disables chunking.
        max_num_seqs: most requests in the running batch.
        enable_prefix_cache: reuse full blocks of earlier prompts.
        max_model_len: context limit (default, and at most: the model's context, `ModelConfig.context_limit`).
        attention: `compiled`: decode reads K/V through the block table in one Inductor kernel
            (compiled at start-up, cached on disk), prefill through SDPA; `eager` gathers the decode
            blocks and runs bmm; `flex`: prefill and decode both through `flex_attention` over the
            paged cache (attention_flex; compiled and checked at start-up); `flex-eager`: the same
            through flex's reference math (slow: CPU tests); `auto` = compiled on CPU (unless the
            eager path measured faster on this machine: engine/model/kernel_choice.py), flex on CUDA
            (eager if the kernel cannot be built), or $PDSERVE_ATTENTION.
        cuda_graphs: run pure-decode steps as CUDA graphs, one per padded batch size up to
            `max_num_seqs` (engine/runner/decode_graphs.py; needs the flex kernel; one KV block is kept as
            the padding's scratch). Off by default: on CPU the same static-buffer path runs without
            capture.
        weight_layout: how the projection weights are stored and multiplied (engine/model/linear.py):
            `auto` = the layout measured fastest on this machine (engine/model/kernel_choice.py; CPU only,
            row-major elsewhere), or `row-major`, `input-major`, `onednn-packed`,
            `onednn-packed+input-major` (a layout the weights' dtype and CPU cannot take is an error).
        quantization: `none`, `int8` or `int4`: the decoder layers' projections quantized at load,
            weight-only (engine/model/quantized_linear.py: int8 per output channel, int4 per group of
            `quantization_group_size` input channels; embeddings and the LM head stay in `dtype`). A
            GPTQ / AWQ / compressed-tensors 4-bit checkpoint is served int4 as stored under `none` or
            `int4` (its own group size); `int8` is refused for it.
        quantization_group_size: int4's group (32, 64 or 128).
        quantize_lm_head: with `quantization` int8 / int4, the LM head is quantized the same way (it is
            read whole every decode step: a large vocabulary makes it a large share of the bytes).
        torch_threads: torch's intra-op thread count, set when the engine is built (None: unchanged).
        kv_tiers: tiers below the paged cache, top first (`engine.kv_cache.tiers.TierSpec`: host memory, then
            disk): evicted full blocks are offloaded into them, and a prompt prefix found there is loaded back
            before it is scheduled. Empty (the default): no tiers.
        kv_offload_queue_blocks: the most evicted blocks waiting to be offloaded; more are dropped (counted).
        speculative: speculative decoding (engine/spec/config.py; off by default): decoding sequences
            propose tokens that the next step verifies; greedy output is unchanged.
        tensor_parallel: ranks the model is split over (engine/parallel/: attention and KV heads and the MLP
            split Megatron-style, one process per rank). Every rank builds an Engine from the same args
            but its own `tensor_parallel_rank`; rank 0 is the engine that serves, the others call
            `Engine.follow()`. A degree that does not divide the model's heads is a ValueError naming it.
        tensor_parallel_rank: this process's rank in [0, tensor_parallel).
        tensor_parallel_address: "host:port" where rank 0 hosts the group's store (every rank the same).
        tensor_parallel_timeout_s: the bound on joining the group and on every collective: a rank that
            dies fails its peers' next step within this time instead of hanging them.
        tensor_parallel_backend: `auto` (NCCL on CUDA, gloo on CPU), `nccl` or `gloo` (on CUDA: ranks may
            share one device, which NCCL refuses; a diagnostic, slower).
    """

    model: str = "tiny"
    dtype: str | torch.dtype = "auto"
    device: str | None = None
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_gib: float = 1.0
    kv_memory_fraction: float | None = None
    kv_cache_dtype: str = "auto"
    max_num_batched_tokens: int = 2048
    chunk_size: int | None = 512
    max_num_seqs: int = 64
    enable_prefix_cache: bool = True
    max_model_len: int | None = None
    attention: str = "auto"
    cuda_graphs: bool = False
    weight_layout: str = "auto"
    quantization: str = "none"
    quantization_group_size: int = 128
    quantize_lm_head: bool = False
    torch_threads: int | None = None
    kv_tiers: tuple[TierSpec, ...] = ()
    kv_offload_queue_blocks: int = 64
    speculative: SpecConfig = field(default_factory=SpecConfig)
    tensor_parallel: int = 1
    tensor_parallel_rank: int = 0
    tensor_parallel_address: str = "127.0.0.1:0"
    tensor_parallel_timeout_s: float = 60.0
    tensor_parallel_backend: str = "auto"

    def model_dir(self) -> str:
        """The model's directory (a preset's is written on first use)."""
        from engine.model.presets import resolve_model
        return resolve_model(self.model)

    def context_length(self, config: ModelConfig | None = None) -> int:
        """`max_model_len`, at most (and by default) the model's context: max_position_embeddings, or with YaRN
        the original context times its factor (`ModelConfig.context_limit`)."""
        from engine.model.config import ModelConfig
        config = config or ModelConfig.from_dir(self.model_dir())
        return min(self.max_model_len or config.context_limit, config.context_limit)

    def load_tokenizer(self, config: ModelConfig | None = None,
                       generation: GenerationConfig | None = None) -> Tokenizer:
        """The model's tokenizer; its EOS ids are config.json's, then any more that generation_config.json lists."""
        from engine.model.config import ModelConfig
        from engine.sampling.generation_config import GenerationConfig
        from engine.tokenizer import Tokenizer
        model_dir = self.model_dir()
        config = config or ModelConfig.from_dir(model_dir)
        generation = generation or GenerationConfig.from_dir(model_dir)
        eos_token_ids = tuple(dict.fromkeys(config.eos_token_ids + generation.eos_token_ids))
        return Tokenizer(model_dir, eos_token_ids, config.bos_token_id)
