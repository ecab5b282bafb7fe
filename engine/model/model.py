"""Llama-family decoder (Llama, Mistral, Qwen2/3, Phi-3) in plain torch, reading K/V through a paged cache."""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.attention import AttentionMetadata, paged_attention
from engine.model.config import ModelConfig
from engine.model.linear import PACKED_WITH_GEMV, ROW_MAJOR, Linear
from engine.model.quantized_linear import DenseScratch, QuantizedLinear, QuantPlan
from engine.model.rope import RotaryEmbedding
from engine.parallel.shard import HeadShard, shard_heads

Reduce = Callable[[torch.Tensor], torch.Tensor]


def _no_reduce(x: torch.Tensor) -> torch.Tensor:
    return x


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def projection(in_features: int, out_features: int, bias: bool, quant: QuantPlan | None,
               scratch: DenseScratch | None) -> Linear | QuantizedLinear:
    """A decoder projection: dense, or int8 / int4 weight-only under `quant` (engine/model/quantized_linear.py)."""
    if quant is None:
        return Linear(in_features, out_features, bias=bias)
    return QuantizedLinear(in_features, out_features, bias, quant, scratch)


class DecoderLayer(nn.Module):
    """One block. q/k/v and gate/up are fused into single matmuls (one weight read per step).

    Under tensor parallelism (`shard`, engine/parallel/shard.py) the layer holds its rank's heads and
    intermediate slice; `reduce` sums o_proj's and down_proj's partial outputs over the ranks."""

    def __init__(self, cfg: ModelConfig, quant: QuantPlan | None = None, scratch: DenseScratch | None = None,
                 shard: HeadShard | None = None, reduce: Reduce = _no_reduce):
        super().__init__()
        shard = shard or shard_heads(cfg)
        self.num_heads, self.num_kv_heads, self.head_dim = shard.num_heads, shard.num_kv_heads, cfg.head_dim
        self.reduce = reduce
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        inter = shard.intermediate_size
        self.split = (q_size, kv_size, kv_size)
        self.qkv_proj = projection(cfg.hidden_size, q_size + 2 * kv_size, cfg.attention_bias, quant, scratch)
        self.o_proj = projection(q_size, cfg.hidden_size, cfg.o_proj_bias, quant, scratch)
        self.gate_up_proj = projection(cfg.hidden_size, 2 * inter, cfg.mlp_bias, quant, scratch)
        self.down_proj = projection(inter, cfg.hidden_size, cfg.mlp_bias, quant, scratch)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # Qwen3: each head of q and k is RMS-normalised (weights over head_dim) before RoPE.
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = self.head_dim ** -0.5

    def forward(self, h: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                layer_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        # h: [T, hidden]
        x = self.input_layernorm(h)
        q, k, v = self.qkv_proj(x).split(self.split, dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)        # [T, Hq, D]
        k = k.view(-1, self.num_kv_heads, self.head_dim)     # [T, Hkv, D]
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope.apply(q, k, positions)
        attn = paged_attention(q, k, v, layer_cache, meta, self.scale)
        h = h + self.reduce(self.o_proj(attn.reshape(h.shape[0], -1)))
        gate, up = self.gate_up_proj(self.post_attention_layernorm(h)).chunk(2, dim=-1)
        return h + self.reduce(self.down_proj(F.silu(gate) * up))


class LlamaModel(nn.Module):
    """`quant`: the decoder layers' projections are int8 / int4 weight-only under this plan, and the LM
    head too with `quantize_lm_head`; the embedding and the norms stay in `dtype`.

    `shard` / `reduce`: one rank of a tensor-parallel group (engine/parallel/shard.py): its share of every
    layer, the embedding replicated, and the LM head on rank 0 only (the rank that samples; the others'
    forward returns no logits)."""

    def __init__(self, cfg: ModelConfig, max_positions: int, device: torch.device, dtype: torch.dtype,
                 quant: QuantPlan | None = None, quantize_lm_head: bool = False, shard: HeadShard | None = None,
                 reduce: Reduce | None = None):
        super().__init__()
        self.cfg = cfg
        self.quant = quant
        self.shard = shard or shard_heads(cfg)
        scratch = DenseScratch() if quant is not None else None     # shared by every quantized projection
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, quant, scratch, self.shard, reduce or _no_reduce)
                                    for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None
        if self.shard.rank == 0:
            self.lm_head = projection(cfg.hidden_size, cfg.vocab_size, False, quant if quantize_lm_head else None,
                                      scratch)
        if cfg.tie_word_embeddings and isinstance(self.lm_head, Linear):
            self.lm_head.weight = self.embed_tokens.weight      # a quantized head packs its own copy
        self.to(device=device, dtype=dtype)
        self.rope = RotaryEmbedding(cfg, max_positions, device, dtype)
        self.weight_layout = ROW_MAJOR

    def store_weights(self, layout: str) -> None:
        """Store every projection's weight in `layout` (engine/model/linear.py), once, after loading.

        A tied lm_head keeps the embedding's row-major weight (lookups want rows).
        """
        if layout == self.weight_layout:
            return
        if self.weight_layout != ROW_MAJOR:
            raise RuntimeError(f"weights are already stored {self.weight_layout}; cannot store them {layout}")
        for module in self.modules():
            if isinstance(module, Linear) and module.weight is not self.embed_tokens.weight:
                module.store(layout)
        self.weight_layout = layout

    def use_dense_rows(self, rows: int) -> None:
        """Products of up to `rows` rows take the dense copy of `PACKED_WITH_GEMV` weights (linear.py)."""
        for module in self.modules():
            if isinstance(module, Linear) and module.layout == PACKED_WITH_GEMV:
                module.dense_rows = rows

    @property
    def quantization(self) -> str:
        """`none`, `int8` or `int4`: how the decoder layers' projections are stored."""
        return "none" if self.quant is None else self.quant.scheme

    def quantized_weights(self) -> tuple[int, int]:
        """(bytes as stored, parameters) of the quantized projections: what a decode step reads of them
        and what they stand for (engine/cost_model.py `ModelCosts.of`)."""
        modules = [m for m in self.modules() if isinstance(m, QuantizedLinear)]
        return sum(m.nbytes for m in modules), sum(m.out_features * m.in_features for m in modules)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, logit_rows: torch.Tensor | None,
                layer_hook: Callable[[int], None] | None = None) -> torch.Tensor:
        """input_ids, positions: [T]; kv_cache: [L, NB, 2, Hkv, bs, D].

        Returns float32 logits [len(logit_rows), vocab] (all rows when logit_rows is None); None on a
        tensor-parallel rank other than 0.
        `layer_hook(i)` runs after layer i wrote its K/V into the cache (engine/runner/layer_hook.py).
        """
        h = self.embed_tokens(input_ids)
        for i, layer in enumerate(self.layers):
            h = layer(h, positions, self.rope, kv_cache[i], meta)
            if layer_hook is not None:
                layer_hook(i)
        if self.lm_head is None:
            return None
        if logit_rows is not None:
            h = h[logit_rows]
        return self.lm_head(self.norm(h)).float()
