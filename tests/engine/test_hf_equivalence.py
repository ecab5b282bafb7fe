"""Logits and greedy generation equal Hugging Face transformers on the same directory (float32)."""
from __future__ import annotations

import pytest
import torch

from engine import Engine, EngineArgs, SamplingParams
from engine.model.linear import ONEDNN_PACKED, PACKED_WITH_GEMV, layouts_for

transformers = pytest.importorskip("transformers")
# the measured choice, and each packed layout whatever this machine measured (engine/model/linear.py)
LAYOUTS = ["auto", ONEDNN_PACKED, PACKED_WITH_GEMV]


def engine_in(model_dir: str, layout: str, **kwargs) -> Engine:
    if layout not in ("auto", *layouts_for(torch.zeros(1))):
        pytest.skip(f"{layout} is not available here (oneDNN cannot pack float32 weights)")
    return Engine(EngineArgs(model_dir, dtype="float32", block_size=16, weight_layout=layout, **kwargs))

def hf_model(model_dir: str):
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize("name,layout", [
    *[(name, "auto") for name in ("gqa_untied", "mha_tied", "llama3_rope", "linear_rope", "qwen2_bias", "mistral")],
    *[(name, layout) for name in ("mha_tied", "qwen2_bias") for layout in LAYOUTS[1:]],   # tied head, biases
])
def test_logits_match_hf_at_every_position(model_dirs, name, layout):
    engine = engine_in(model_dirs[name], layout, num_blocks=64)
    ref = hf_model(model_dirs[name])
    expected_cls = {"qwen2_bias": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}.get(name, "LlamaForCausalLM")
    assert type(ref).__name__ == expected_cls
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, engine.vocab_size, (300,), generator=g).tolist()
    blocks = engine.block_manager.allocate(19)
    ours = engine.runner.score(ids, blocks)
    engine.block_manager.free(blocks)
    with torch.no_grad():
        theirs = ref(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_greedy_generation_matches_hf_generate(model_dirs, layout):
    model_dir = model_dirs["gqa_untied"]
    engine = engine_in(model_dir, layout, num_blocks=256)
    ref = hf_model(model_dir)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, engine.vocab_size, (n,), generator=g).tolist() for n in (1, 17, 64, 230, 500)]
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    ours = engine.generate(prompts, params)
    for prompt, completion in zip(prompts, ours):
        with torch.no_grad():
            out = ref.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False,
                               eos_token_id=None, pad_token_id=0)
        assert completion.token_ids == out[0, len(prompt):].tolist()
    engine.block_manager.check_no_leaks()
