"""The roofline step-time model: a step takes as long as its FLOPs or its bytes, whichever is slower.

For one step of chunks (n_i new tokens each, attending over c_i tokens), T = Σ n_i:

    FLOPs   = 2·P·T                               matmuls of the decoder layers (P: engine.cost_model)
            + 4·L·d·Σ (n_i·c_i − n_i(n_i−1)/2)    attention: QKᵀ and PV, 2·d each per causal pair
            + 2·V·h·(number of scored rows)       the LM head: one sampled row per chunk, 1 + k for a
                                                  chunk verifying k proposals
    bytes   = W                                   the weights a step reads (engine.cost_model), once
            + Σ c_i·kv + T·kv                     the KV read over each context, the new tokens' KV written

(L layers, d = query heads·head_dim, V·h the LM head, kv = KV bytes per token.) Activations are
left out: at the batch sizes that matter they are a small share of the weights and KV.

    step_s  = max(FLOPs / tp / (peak·compute_efficiency), bytes per rank / (bandwidth·memory_efficiency))
            + step_overhead_s + all-reduces (+ the draft's proposing, `StepTimeModel.proposing_s`)

A step verifying proposals is priced like any other: its rows read the weights once for all of
them (the reason speculation pays while decode is bound by memory), and they cost their FLOPs, KV
and LM-head rows.

With tensor parallelism every rank holds 1/tp of the weights and of the KV heads (a KV head is
replicated when tp exceeds the KV heads) and does 1/tp of the FLOPs; the ranks meet in 2 all-reduces
per layer (after attention and after the MLP), each of T·h activations, costed as a ring:
2·(tp−1)/tp·bytes over the intra-node link, plus the link latency.

    link_s  = link_latency_s + wire_bytes / (tp · link bytes/s)

The KV handoff leaves from every rank at once (each sends its KV heads over its own link), over the
inter-node network by default (prefill and decode pools usually sit on different nodes). Between
pools of different degrees the KV is resharded by head: the prefill actor's tp_p ranks send and the
decode actor's tp_d ranks receive, each over its own NIC, so the side with fewer NICs binds and the
handoff is priced by the model at min(tp_p, tp_d) (`bench.simulate.sim_cluster.PoolModels`).

`at_degree` gives the same GPU and model at another degree (a pool's `tensor_parallel`), `for_engine`
an actor's own storage and KV budget from its engine settings:

    weights  the decoder layers' projections at the quantization's bytes (int8: 1 a weight; int4: 0.5 plus
             a 16-bit scale and zero per group; a GPTQ / AWQ checkpoint is int4 as stored), the LM head too
             with quantize_lm_head; the embedding, norms and biases at the dtype's. Weight-only: the FLOPs
             and their peak stay the dtype's.
    KV       1 byte an element for an fp8 or int8 cache (its per-block scales left out), else the dtype's.
    budget   kv_cache.memory_fraction of each GPU (default 0.9, as vLLM's gpu_memory_utilization), or
             exactly kv_cache.num_blocks / memory_gib of blocks where they fit beside the weights.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

from bench.simulate.hardware import Hardware
from bench.simulate.step_time import Chunk, StepTimeModel
from engine.cost_model import ModelCosts, decode_weight_params
from engine.model.config import ModelConfig
from engine.parallel.shard import check_degree

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp8": 1, "int8": 1, "fp32": 4}
GIB = 1 << 30
ALL_REDUCES_PER_LAYER = 2                 # attention output and MLP output (row-parallel o_proj, down_proj)


class RooflineModel(StepTimeModel):
    """Step and handoff times of one actor (a tensor-parallel group of `tensor_parallel` GPUs).

    Args:
        hardware: one GPU of the actor.
        cfg: the model's shape (`bench.simulate.models.model_config`).
        dtype: the matmuls' dtype, which picks the peak FLOP/s (bf16, fp16, fp8, int8, fp32).
        tensor_parallel: GPUs in the actor; must divide the query heads.
        kv_dtype_bytes: bytes per KV element (1 for an fp8 cache); default: the dtype's bytes.
        weight_bytes_per_param: bytes per weight (0.5 for int4 weight-only); default: the dtype's bytes.
        inter_node: the KV handoff crosses nodes (the network) rather than the intra-node link.
        model_name: the model's name for `name`; default: its size and type.
        memory_fraction: share of each GPU's memory the engine may use (weights, reserve and KV).
        activation_reserve_bytes: memory per GPU kept for activations, logits and workspaces.
        quantization: none, int8 or int4 (weight-only, the decoder layers' projections; module docstring).
        group_size: int4's group of input channels per scale.
        quantize_lm_head: the LM head is quantized too.
        kv_num_blocks, kv_memory_bytes: an exact KV budget per actor (kv_cache.num_blocks / memory_gib) instead
            of what memory_fraction leaves.
    """

    def __init__(self, hardware: Hardware, cfg: ModelConfig, dtype: str = "bf16", tensor_parallel: int = 1,
                 kv_dtype_bytes: int | None = None, weight_bytes_per_param: float | None = None,
                 inter_node: bool = True, *, model_name: str | None = None, memory_fraction: float = 0.9,
                 activation_reserve_bytes: float = 1e9, quantization: str = "none", group_size: int = 128,
                 quantize_lm_head: bool = False, kv_num_blocks: int | None = None,
                 kv_memory_bytes: float | None = None) -> None:
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"unknown dtype {dtype!r} (dtypes: {', '.join(DTYPE_BYTES)})")
        if quantization not in QUANTIZED_BYTES:
            raise ValueError(f"unknown quantization {quantization!r} (none, int8, int4)")
        if cfg.quantization is not None:
            quantization = "int4"                   # a 4-bit checkpoint, served as stored
        check_degree(cfg, tensor_parallel, "tensor_parallel", quantization)      # as the engine checks it
        if not 0.0 < memory_fraction <= 1.0:
            raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction}")
        self.hardware, self.cfg, self.dtype, self.tensor_parallel = hardware, cfg, dtype, tensor_parallel
        self._settings = dict(kv_dtype_bytes=kv_dtype_bytes, weight_bytes_per_param=weight_bytes_per_param,
                              inter_node=inter_node, model_name=model_name, memory_fraction=memory_fraction,
                              activation_reserve_bytes=activation_reserve_bytes, quantization=quantization,
                              group_size=group_size, quantize_lm_head=quantize_lm_head, kv_num_blocks=kv_num_blocks,
                              kv_memory_bytes=kv_memory_bytes)
        self._degrees: dict[int, RooflineModel] = {tensor_parallel: self}
        self.inter_node, self.memory_fraction = inter_node, memory_fraction
        self.activation_reserve_bytes = activation_reserve_bytes
        self.quantization = quantization
        self.kv_num_blocks, self.kv_memory_bytes = kv_num_blocks, kv_memory_bytes
        dtype_bytes = DTYPE_BYTES[dtype]
        self.costs = ModelCosts.of(cfg, dtype_bytes)
        # what a step reads; what the GPU holds adds the embedding table, unless the LM head is that tensor
        embedding = (0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size) * dtype_bytes
        if weight_bytes_per_param is not None:
            self.weight_bytes = decode_weight_params(cfg) * weight_bytes_per_param
            embedding = embedding / dtype_bytes * weight_bytes_per_param
        else:
            quantized = QUANTIZED_BYTES[quantization](group_size) if quantization != "none" else dtype_bytes
            head = self.costs.head_params
            self.weight_bytes = (self.costs.layer_params * quantized + head * (quantized if quantize_lm_head
                                                                                 else dtype_bytes)
                                 + (decode_weight_params(cfg) - self.costs.layer_params - head) * dtype_bytes)
        self.resident_weight_bytes = self.weight_bytes + embedding
        self.kv_bytes_per_token = cfg.kv_bytes_per_token(dtype_bytes if kv_dtype_bytes is None else kv_dtype_bytes)
        self.num_layers = cfg.num_hidden_layers
        # fp8 / int8 matmuls still pass 16-bit activations between layers (and through the all-reduce)
        self.activation_bytes = max(dtype_bytes, 2)
        self.kv_share = math.ceil(cfg.num_key_value_heads / tensor_parallel) / cfg.num_key_value_heads
        self.flops_per_s = hardware.flops(dtype) * hardware.compute_efficiency
        self.bytes_per_s = hardware.memory_bytes_per_s * hardware.memory_efficiency
        model = model_name or f"{cfg.num_params / 1e9:.1f}B {cfg.model_type}"
        self.name = f"roofline: {hardware.name}, {model}, tp={tensor_parallel}"

    def at_degree(self, pool: str, degree: int) -> RooflineModel:
        """This GPU and model with `degree` GPUs per actor; a degree the engine cannot split the model over
        (`engine.parallel.shard.check_degree`, quantized projections included) is a ValueError naming
        `pools.<pool>.tensor_parallel`."""
        if degree not in self._degrees:
            check_degree(self.cfg, degree, f"pools.{pool}.tensor_parallel", self.quantization)
            self._degrees[degree] = RooflineModel(self.hardware, self.cfg, self.dtype, degree, **self._settings)
            self._degrees[degree]._degrees = self._degrees
        return self._degrees[degree]

    def for_engine(self, args, kv) -> RooflineModel:
        """This model for an actor built with engine settings `args` (`engine.EngineArgs`) and KV section `kv`
        (`deploy.config.KVCacheSection`): its cache's dtype, its weights' quantization and its KV budget (module
        docstring), at this model's degree."""
        settings = dict(self._settings, kv_dtype_bytes=None if args.kv_cache_dtype == "auto" else 1,
                        quantization=args.quantization, group_size=args.quantization_group_size,
                        quantize_lm_head=args.quantize_lm_head, memory_fraction=kv.device_fraction() or 0.9,
                        kv_num_blocks=kv.num_blocks,
                        kv_memory_bytes=None if kv.memory_gib is None else kv.memory_gib * GIB)
        if settings == self._settings:
            return self
        return RooflineModel(self.hardware, self.cfg, self.dtype, self.tensor_parallel, **settings)

    # -- the step ---------------------------------------------------------------------------------

    def step_s(self, chunks: Sequence[Chunk]) -> float:
        """compute or memory time of one rank, whichever is longer, + overhead + all-reduces."""
        assert chunks, "a step has at least one chunk"
        num_tokens, pairs, kv_tokens, proposals = _step_terms(chunks)
        compute_s = self._flops(num_tokens, pairs, len(chunks) + proposals) / self.tensor_parallel / self.flops_per_s
        memory_s = self._rank_bytes(kv_tokens) / self.bytes_per_s
        seconds = max(compute_s, memory_s) + self.hardware.step_overhead_s + self.all_reduce_s(num_tokens)
        if self.speculation is not None:
            seconds += self.proposing_s(chunks)
        return seconds

    def step_flops(self, chunks: Sequence[Chunk]) -> float:
        """FLOPs of the whole step over all ranks: matmuls, causal attention, the LM head's rows (one per
        chunk, 1 + k for a chunk verifying k proposals)."""
        num_tokens, pairs, _, proposals = _step_terms(chunks)
        return self._flops(num_tokens, pairs, len(chunks) + proposals)

    def rank_bytes(self, chunks: Sequence[Chunk]) -> float:
        """HBM bytes one rank moves: its share of the weights, of the KV read and of the KV written."""
        return self._rank_bytes(_step_terms(chunks)[2])

    def _flops(self, num_tokens: int, pairs: int, rows: int) -> float:
        c = self.costs
        return (2.0 * c.layer_params * num_tokens + 4.0 * c.num_layers * c.attn_dim * pairs
                + 2.0 * c.head_params * rows)

    def _rank_bytes(self, kv_tokens: int) -> float:
        return self.weight_bytes / self.tensor_parallel + kv_tokens * self.kv_bytes_per_token * self.kv_share

    def all_reduce_s(self, num_tokens: int) -> float:
        """The step's all-reduces: 2 per layer of num_tokens·h activations, ring over the intra-node link."""
        tp = self.tensor_parallel
        if tp == 1:
            return 0.0
        message_bytes = num_tokens * self.cfg.hidden_size * self.activation_bytes
        one_s = 2.0 * (tp - 1) / tp * message_bytes / self.hardware.intra_node_link_bytes_per_s
        return ALL_REDUCES_PER_LAYER * self.num_layers * (one_s + self.hardware.link_latency_s)

    # -- the handoff and the KV budget ------------------------------------------------------------

    def link_s(self, wire_bytes: float) -> float:
        """Latency, then the bytes over tp parallel links (each rank sends its own KV heads)."""
        hw = self.hardware
        bandwidth = hw.inter_node_link_bytes_per_s if self.inter_node else hw.intra_node_link_bytes_per_s
        return hw.link_latency_s + wire_bytes / (bandwidth * self.tensor_parallel)

    def kv_blocks(self, block_size: int) -> int:
        """Blocks that fit in what each rank keeps after its weights and the activation reserve.

            blocks = ⌊(memory·memory_fraction − resident weights/tp − reserve)
                      / (block_size·kv bytes per token/tp)⌋

        The resident weights count the embedding table, which a step only gathers from.

        Raises ValueError when a rank's share of the weights and the reserve exceed its usable memory, or leave
        it less than one block: every request would fail, so a run is refused before it starts.
        """
        hw, tp = self.hardware, self.tensor_parallel
        block_bytes = block_size * self.kv_bytes_per_token * self.kv_share
        usable = hw.memory_bytes * self.memory_fraction
        rank_weights = self.resident_weight_bytes / tp
        free = usable - rank_weights - self.activation_reserve_bytes
        if free < 0:
            raise ValueError(f"{self.name}: the weights ({rank_weights / 1e9:.1f} GB per GPU) and the activation "
                             f"reserve ({self.activation_reserve_bytes / 1e9:.1f} GB) do not fit in "
                             f"{usable / 1e9:.1f} GB ({self.memory_fraction:.0%} of {hw.memory_bytes / 1e9:.0f} GB)")
        blocks = math.floor(free / block_bytes)
        # (as the engine sizes it: memory_gib over a whole block of the model, per actor, whatever its degree)
        asked = self.kv_num_blocks if self.kv_memory_bytes is None else \
            math.floor(self.kv_memory_bytes / (block_size * self.kv_bytes_per_token))
        if asked is not None:
            key = "kv_cache.num_blocks" if self.kv_memory_bytes is None else "kv_cache.memory_gib"
            if asked > blocks:
                raise ValueError(f"{key}: {asked} KV blocks per actor do not fit: {self.name} has room for {blocks} "
                                 f"beside the weights ({rank_weights / 1e9:.1f} GB per GPU)")
            if asked < 1:
                raise ValueError(f"{key}: less than one KV block ({block_bytes:.0f} bytes per GPU)")
            return asked
        if blocks < 1:
            raise ValueError(f"{self.name}: memory_bytes {hw.memory_bytes:.0f} leaves no room for a KV block: of "
                             f"{usable:.0f} bytes ({self.memory_fraction:.0%}), the weights ({rank_weights:.0f} bytes "
                             f"per GPU) and the activation reserve ({self.activation_reserve_bytes:.0f} bytes) leave "
                             f"{free:.0f}, and one KV block ({block_size} tokens) needs {block_bytes:.0f} bytes")
        return blocks


QUANTIZED_BYTES = {
    "none": None,
    "int8": lambda group_size: 1.0,                        # (one scale per output channel: left out)
    "int4": lambda group_size: 0.5 + 4.0 / group_size,     # two nibbles a byte, a 16-bit scale and zero per group
}


def attended_pairs(chunk: Chunk) -> int:
    """Causal (query, key) pairs of n new tokens ending at context c: row i sees c − n + 1 + i keys.

    Σ_{i<n} (c − n + 1 + i) = n·c − n(n−1)/2; a decode row (1, c) sees c.
    """
    n, c = chunk.new_tokens, chunk.context
    return n * c - n * (n - 1) // 2


def _step_terms(chunks: Sequence[Chunk]) -> tuple[int, int, int, int]:
    """One pass over a step's chunks (one per scheduled sequence): tokens computed, attended pairs,
    KV tokens read and written, proposals verified."""
    num_tokens = pairs = kv_tokens = proposals = 0
    for chunk in chunks:
        n, c, k = chunk
        num_tokens += n
        pairs += attended_pairs(chunk)
        kv_tokens += c + n
        proposals += k
    return num_tokens, pairs, kv_tokens, proposals
