"""Small random checkpoints written by transformers' own classes (`save_pretrained`), for parity tests.

Every parameter is drawn from a seeded generator (norm weights near 1, not HF's all-ones init),
so a weight the engine failed to load or applied in the wrong place changes the logits.
The tokenizer files are copied from the `tiny` preset: the engine needs a tokenizer.json.
"""
from __future__ import annotations

import os
import shutil

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def randomize(model: torch.nn.Module, seed: int, std: float = 0.05) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else std * noise)


def write_checkpoint(out_dir: str, config, tokenizer_dir: str, seed: int = 0, dtype: torch.dtype = torch.float32,
                     max_shard_size: str | None = None) -> str:
    """config: a transformers PretrainedConfig; the model is saved in `dtype` (safetensors)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize(model, seed)
    model = model.to(dtype)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out_dir, **kwargs)
    for name in TOKENIZER_FILES:
        shutil.copy(os.path.join(tokenizer_dir, name), os.path.join(out_dir, name))
    return out_dir


def hf_model(model_dir: str):
    """The reference: float32, eager attention (whose mask honours a sliding window)."""
    import transformers
    return transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager").eval()


@torch.no_grad()
def hf_logits(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0].float()


@torch.no_grad()
def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def random_prompt(n: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (n,), generator=g).tolist()
