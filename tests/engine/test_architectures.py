"""Qwen3 and Phi-3 checkpoints saved by transformers: logits and greedy tokens equal HF's (float32).

Each architecture's particulars are exercised: Qwen3's per-head q/k RMSNorm, an explicit
head_dim unequal to hidden/heads and tied embeddings; Phi-3's fused qkv_proj and gate_up_proj
and its partial rotary factor. Prompts run through the Engine in chunks (chunk_size 16) and
decode batched; the disaggregated path runs this same engine, so it needs nothing more.
"""
from __future__ import annotations

import pytest
import torch
from hf_checkpoints import hf_greedy, hf_logits, hf_model, random_prompt, write_checkpoint

from engine import Engine, EngineArgs, SamplingParams
from engine.model.config import ModelConfig

transformers = pytest.importorskip("transformers")

VOCAB = 1024          # the tiny preset's tokenizer
ATOL = 1e-4           # as tests/engine/test_hf_equivalence.py


def _configs() -> dict:
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  bos_token_id=0, eos_token_id=1, pad_token_id=None, rms_norm_eps=1e-6)
    return {
        "qwen3": transformers.Qwen3Config(**common, head_dim=32, tie_word_embeddings=True,
                                          rope_theta=1_000_000.0),
        "phi3": transformers.Phi3Config(**common, tie_word_embeddings=False, sliding_window=None),
        "phi3_partial_rope": transformers.Phi3Config(**common, tie_word_embeddings=False, sliding_window=None,
                                                     partial_rotary_factor=0.75),
    }


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tiny_model_dir) -> dict[str, str]:
    root = tmp_path_factory.mktemp("arch")
    return {name: write_checkpoint(str(root / name), cfg, tiny_model_dir, seed=n)
            for n, (name, cfg) in enumerate(_configs().items())}


def _engine(model_dir: str, **kw) -> Engine:
    return Engine(EngineArgs(model_dir, dtype="float32", num_blocks=64, block_size=16, attention="eager", **kw))


def test_configs_read_the_architecture(checkpoints):
    qwen3 = ModelConfig.from_dir(checkpoints["qwen3"])
    assert (qwen3.model_type, qwen3.qk_norm, qwen3.head_dim, qwen3.tie_word_embeddings) == ("qwen3", True, 32, True)
    assert not qwen3.attention_bias and qwen3.sliding_window is None
    phi3 = ModelConfig.from_dir(checkpoints["phi3_partial_rope"])
    assert (phi3.model_type, phi3.rotary_dim, phi3.qk_norm) == ("phi3", 12, False)


@pytest.mark.parametrize("name", ["qwen3", "phi3", "phi3_partial_rope"])
def test_logits_match_hf_at_every_position(checkpoints, name):
    engine = _engine(checkpoints[name])
    ref = hf_model(checkpoints[name])
    ids = random_prompt(200, seed=7, vocab=VOCAB)
    blocks = engine.block_manager.allocate(13)
    ours = engine.runner.score(ids, blocks)
    engine.block_manager.free(blocks)
    torch.testing.assert_close(ours, hf_logits(ref, ids), atol=ATOL, rtol=ATOL)


@pytest.mark.parametrize("name", ["qwen3", "phi3_partial_rope"])
def test_chunked_prefill_and_decode_equal_hf_generate(checkpoints, name):
    """Greedy tokens equal HF generate; each token's logprob equals HF's log_softmax there."""
    engine = _engine(checkpoints[name], chunk_size=16)
    ref = hf_model(checkpoints[name])
    prompts = [random_prompt(n, seed=n, vocab=VOCAB) for n in (1, 37, 90)]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=0)
    for prompt, c in zip(prompts, engine.generate(prompts, params)):
        assert c.token_ids == hf_greedy(ref, prompt, 20)
        expected = torch.log_softmax(hf_logits(ref, prompt + c.token_ids), dim=-1)
        for j, (token, entry) in enumerate(zip(c.token_ids, c.logprobs)):
            assert abs(entry.logprob - expected[len(prompt) - 1 + j, token].item()) <= ATOL
    engine.block_manager.check_no_leaks()
