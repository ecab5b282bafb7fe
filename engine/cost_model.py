"""What one prefill or decode step of the model costs: FLOPs and bytes, counted from `engine/model/model.py`.

The one cost model of pdserve: the profiler (`engine.profile`, read by the planner in `deploy/`)
and the engine benchmark (`bench.engine`) both count with it.

    prefill FLOPs(S)    = 2·P·S + 4·L·S²·d + 2·V·h        (matmuls, attention as a full square, one sampled row)
    decode FLOPs(B, C)  = B·(2·P + 4·L·C·d + 2·V·h)
    decode bytes(B, C)  = W + B·C·(KV bytes per token)

P = matmul parameters of the decoder layers (q/k/v, o, gate/up, down), L = layers, d = query heads ·
head_dim, V·h = the LM head. W = the weights a decode step reads whole: P, the q/k/v and MLP biases
(when the model has them), the 2·L + 1 RMSNorm vectors and the LM head, at the weights' dtype; with
int8 / int4 weight-only projections (engine/model/quantized_linear.py) P (and the LM head, when it is
quantized too) count their stored bytes, and an fp8 / int8 KV cache its stored bytes per token.
Left out: the embedding gather (B rows of h: B/V of the LM head's bytes), so decode bytes stay
linear in B·C; and the RoPE, softmax and norm arithmetic.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from engine.model.config import ModelConfig


def layer_matmul_params(cfg: ModelConfig) -> int:
    """Weights every token multiplies through in the decoder layers (P: no embedding, no LM head)."""
    h, q, kv = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * cfg.intermediate_size
    return cfg.num_hidden_layers * per_layer


def decode_weight_params(cfg: ModelConfig) -> int:
    """Parameters a decode step reads whole (W in elements): matmuls, biases, norm vectors, LM head."""
    h, q, kv = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    biases = (q + 2 * kv) * cfg.attention_bias + (2 * cfg.intermediate_size + h) * cfg.mlp_bias
    norms = 2 * h
    head = cfg.vocab_size * h
    return layer_matmul_params(cfg) + cfg.num_hidden_layers * (biases + norms) + h + head


@dataclass(slots=True, frozen=True)
class ModelCosts:
    """The counts above for one model at one dtype; saved in every profile (`to_dict`)."""

    num_layers: int
    hidden_size: int
    attn_dim: int              # query heads · head_dim (d)
    layer_params: int          # matmul parameters of all decoder layers (P)
    head_params: int           # LM head (V·h)
    weight_bytes: int          # bytes a decode step reads for weights (W · dtype bytes)
    kv_bytes_per_token: int    # K and V of one token over all layers
    dtype_bytes: int

    @classmethod
    def of(cls, cfg: ModelConfig, dtype_bytes: int, quantized: tuple[int, int] | None = None,
           kv_bytes_per_token: float | None = None) -> "ModelCosts":
        """`quantized`: (bytes as stored, parameters) of the projections stored int8 / int4, which a
        decode step reads instead of parameters · dtype_bytes (`LlamaModel.quantized_weights`).
        `kv_bytes_per_token`: what a token's K and V take in the cache when it is not stored in the model
        dtype (an fp8 / int8 cache: `KVFormat.bytes_per_token`, scales included)."""
        weight_bytes = decode_weight_params(cfg) * dtype_bytes
        if quantized is not None:
            stored, params = quantized
            weight_bytes += stored - params * dtype_bytes
        return cls(num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size,
                   attn_dim=cfg.num_attention_heads * cfg.head_dim, layer_params=layer_matmul_params(cfg),
                   head_params=cfg.vocab_size * cfg.hidden_size,
                   weight_bytes=weight_bytes,
                   kv_bytes_per_token=round(kv_bytes_per_token or cfg.kv_bytes_per_token(dtype_bytes)),
                   dtype_bytes=dtype_bytes)

    @classmethod
    def from_dict(cls, d: dict, key: str = "costs") -> "ModelCosts":
        """The counts `to_dict` saved; ValueError naming `key`.<count> where one is missing or not a positive
        integer."""
        if not isinstance(d, dict):
            raise ValueError(f"{key} must be a mapping of the model's counts, got {d!r}")
        for name in cls.__slots__:
            value = d.get(name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{key}.{name} must be a positive integer, "
                                 + (f"got {value!r}" if name in d else "missing"))
        return cls(**{k: d[k] for k in cls.__slots__})

    def to_dict(self) -> dict:
        return asdict(self)

    def prefill_flops(self, prompt_len: int) -> float:
        """One prompt of `prompt_len` tokens, logits for its last row only."""
        s = prompt_len
        return 2.0 * self.layer_params * s + 4.0 * self.num_layers * s * s * self.attn_dim + 2.0 * self.head_params

    def decode_flops(self, batch: int, context: float) -> float:
        """One step of `batch` sequences that each attend over `context` tokens."""
        return batch * (2.0 * (self.layer_params + self.head_params) + 4.0 * self.num_layers * context * self.attn_dim)

    def decode_bytes(self, batch: int, context: float) -> float:
        """Bytes one step of `batch` sequences at `context` tokens reads: the weights once, each KV."""
        return float(self.weight_bytes) + batch * context * self.kv_bytes_per_token
