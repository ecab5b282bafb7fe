from __future__ import annotations

import pytest

from engine.model.presets import hf_config, write_model_dir

ARCH = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512, max_position_embeddings=1024, tie_word_embeddings=False)

CONFIGS = {
    "gqa_untied": hf_config(ARCH),
    "mha_tied": hf_config({**ARCH, "num_key_value_heads": 4, "tie_word_embeddings": True}),
    "llama3_rope": hf_config(ARCH, rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}),
    "linear_rope": hf_config(ARCH, rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "qwen2_bias": hf_config({**ARCH, "num_key_value_heads": 1}, model_type="qwen2",
                            use_sliding_window=False, sliding_window=None),
    "mistral": hf_config(ARCH, model_type="mistral", sliding_window=None),
}


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("models")
    dirs = {}
    for n, (name, cfg) in enumerate(CONFIGS.items()):
        shard = 200_000 if name == "gqa_untied" else None      # one sharded checkpoint
        dirs[name] = write_model_dir(str(root / name), cfg, seed=n, tokenizer_vocab=300,
                                     max_shard_bytes=shard)
    return dirs


@pytest.fixture(autouse=True)
def _default_attention(monkeypatch):
    """Engine tests run the engine's own default decode attention (compiled on CPU);
    the rest of the suite pins the eager path for speed (tests/conftest.py)."""
    monkeypatch.delenv("PDSERVE_ATTENTION", raising=False)


@pytest.fixture
def float32_plan(monkeypatch):
    """Quantized projections with both paths in float32 (the packed kernel for up to 4 rows): tests
    compare the loaded weights, not the machine's bfloat16 rounding of activations."""
    import torch

    from engine.model import kernel_choice
    from engine.model.quantized_linear import QuantPlan

    def plan(cfg, scheme, group_size, dtype, device, prefill_tokens=256):
        return QuantPlan(scheme, group_size, torch.float32, torch.float32, 4)
    monkeypatch.setattr(kernel_choice, "quantized_plan", plan)
