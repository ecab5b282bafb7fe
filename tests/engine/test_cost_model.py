"""The cost model: exact FLOP and byte counts, and the weights it counts are the model's own."""
from __future__ import annotations

import torch

from engine.cost_model import ModelCosts, decode_weight_params

COSTS = ModelCosts(num_layers=4, hidden_size=256, attn_dim=256, layer_params=2_000_000, head_params=250_000,
                   weight_bytes=9_000_000, kv_bytes_per_token=4096, dtype_bytes=4)


def test_flop_and_byte_counts():
    s = 1000
    assert COSTS.prefill_flops(s) == 2 * 2_000_000 * s + 4 * 4 * s * s * 256 + 2 * 250_000
    assert COSTS.decode_bytes(8, 500) == 9_000_000 + 8 * 500 * 4096


def _config(**overrides):
    from engine.model.config import ModelConfig
    raw = dict(model_type="qwen2", vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return ModelConfig.from_dict({**raw, **overrides})


def test_decode_weights_are_every_parameter_the_model_reads_but_the_embedding():
    from engine.model.model import LlamaModel
    for cfg in (_config(), _config(model_type="llama", mlp_bias=True), _config(tie_word_embeddings=True)):
        model = LlamaModel(cfg, 64, torch.device("cpu"), torch.float32)
        read = sum(p.numel() for name, p in model.named_parameters()
                   if name != "embed_tokens.weight" or cfg.tie_word_embeddings)    # tied: it is the LM head
        assert decode_weight_params(cfg) == read, cfg
        assert ModelCosts.of(cfg, 2).weight_bytes == 2 * read
