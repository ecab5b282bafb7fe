"""A small random Mistral checkpoint with a tiny sliding window, and Hugging Face references for it.

Shared by the engine, worker and kernel tests of the sliding window: HF's eager attention
honours the window in its mask, so its greedy tokens and logits are the reference.
"""
from __future__ import annotations

import contextlib

import torch

from engine.model.presets import hf_config, write_model_dir

WINDOW = 16
ARCH = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=512, tie_word_embeddings=False)


def write_window_model(out_dir: str, sliding_window: int | None = WINDOW) -> str:
    """The same weights whatever the window (seeded), so a windowless copy shows the window matters."""
    cfg = hf_config(ARCH, model_type="mistral", sliding_window=sliding_window)
    return write_model_dir(out_dir, cfg, seed=21, tokenizer_vocab=250)


def hf_model(model_dir: str):
    import transformers
    return transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager").eval()


def random_prompts(lengths: list[int], seed: int = 0, vocab: int = 256) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in lengths]


@contextlib.contextmanager
def one_thread():
    """Tiny models run fastest on one thread, and with no thread spinning against other processes."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@torch.no_grad()
def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@torch.no_grad()
def hf_logits(model, token_ids: list[int]) -> torch.Tensor:
    """[len(token_ids), V] float32 logits of one forward pass over the whole sequence."""
    return model(torch.tensor([token_ids])).logits[0].float()
