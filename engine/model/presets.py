"""Embedded models: one trained model shipped in the repository, and random-weight presets.

`pydoc` (~4 M params, trained by `python -m bench.train` on the Python 3.11 documentation,
committed under engine/weights/pydoc) is the default of `pdserve serve` and `make demo`: it
writes readable text, so quality figures (held-out bits per byte, FP8 KV) are measured on
real activations. `tiny` (~3 M params) serves tests; `small` (~100 M params, GQA) serves
benchmarks. Those two have deterministic random weights written as real Hugging Face
directories with a byte-level BPE `tokenizer.json` trained on a fixed generated corpus,
so any HF tool can load them.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import tempfile

import torch
from safetensors.torch import save_file

SPECIAL_TOKENS = ["<s>", "</s>"]          # ids 0 (bos) and 1 (eos)

PRESETS: dict[str, dict] = {
    "tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=4, vocab_size=1024, max_position_embeddings=2048,
                 tie_word_embeddings=False),
    "small": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                  num_key_value_heads=4, vocab_size=16384, max_position_embeddings=4096,
                  tie_word_embeddings=False),
}
PRESET_VERSION = "v3"                     # v3: tokenizer_config.json has a chat template

TRAINED: dict[str, str] = {
    "pydoc": os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "weights", "pydoc"),
    # pydoc's speculative draft: the same tokenizer, 0.36 M parameters (engine/weights/pydoc-draft/README.md)
    "pydoc-draft": os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "weights", "pydoc-draft"),
}
"""Trained models committed with the repository: name → directory (returned as is)."""

CHAT_TEMPLATE = (                         # ChatML, as router.openai_api's default
    "{{ bos_token if bos_token else '' }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_WORDS = ("the of and to in is that for it as was with be by on not he this are or his from at which "
          "but have an they you were her she there been one all we their has would when if so no what "
          "up out into them some could time these two may then do first any my now such like our over "
          "man me even most made after also did many before must through back years where much your way "
          "well down should because each just those people how too little state good very make world "
          "still own see men work long get here between both life being under never day same another know "
          "while last might us great old year off come since against go came right used take three model "
          "token cache block prefill decode request server cluster memory latency batch stream tensor").split()
_EXTRA = ["你好世界", "缓存", "模型", "こんにちは", "データ", "é", "ü", "→", "∑", "😀",
          "def f(x):", "return x + 1", "{\"key\": [1, 2, 3]}", "0123456789", "    ", "\n"]


_SYLLABLES = [c + v for c in "bcdfghjklmnprstvwz" for v in ("a", "e", "i", "o", "u", "ai", "ou")]


def _corpus(seed: int = 0, num_sentences: int = 30000) -> list[str]:
    """English-like lines: common words plus pseudo-words, so BPE can learn a large vocabulary."""
    rng = random.Random(seed)
    pseudo = ["".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 4))) for _ in range(20000)]
    lines = []
    for _ in range(num_sentences):
        words = [rng.choice(_WORDS) if rng.random() < 0.6 else rng.choice(pseudo)
                 for _ in range(rng.randint(4, 16))]
        if rng.random() < 0.2:
            words.insert(rng.randrange(len(words)), rng.choice(_EXTRA))
        if rng.random() < 0.1:
            words.append(str(rng.randint(0, 99999)))
        line = " ".join(words)
        lines.append(line[0].upper() + line[1:] + rng.choice([".", ",", "?", "!", ";"]))
    return lines


def build_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer (256 byte symbols + merges + <s>, </s>)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_corpus(), trainer=trainer)
    return tok


def hf_config(arch: dict, model_type: str = "llama", **extra) -> dict:
    cfg = {
        "architectures": [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                           "mistral": "MistralForCausalLM"}[model_type]],
        "model_type": model_type, "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "float32", "attention_bias": False,
        "mlp_bias": False, "initializer_range": 0.02, "use_cache": True,
    }
    cfg.update(arch)
    cfg["head_dim"] = cfg["hidden_size"] // cfg["num_attention_heads"]
    cfg.update(extra)
    return cfg


def random_weights(cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    """HF-named tensors: normal(0, 0.02) matrices, norms near 1, small biases."""
    gen = torch.Generator().manual_seed(seed)
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    d = cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    bias = cfg["model_type"] == "qwen2" or cfg.get("attention_bias", False)

    def mat(*shape: int, std: float = 0.02) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    def norm(n: int) -> torch.Tensor:
        return 1.0 + mat(n, std=0.1)

    w = {"model.embed_tokens.weight": mat(v, h), "model.norm.weight": norm(h)}
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        for name, rows in (("q", q), ("k", kv), ("v", kv)):
            w[p + f"self_attn.{name}_proj.weight"] = mat(rows, h)
            if bias:
                w[p + f"self_attn.{name}_proj.bias"] = mat(rows, std=0.1)
        w[p + "self_attn.o_proj.weight"] = mat(h, q)
        w[p + "mlp.gate_proj.weight"] = mat(i, h)
        w[p + "mlp.up_proj.weight"] = mat(i, h)
        w[p + "mlp.down_proj.weight"] = mat(h, i)
        w[p + "input_layernorm.weight"] = norm(h)
        w[p + "post_attention_layernorm.weight"] = norm(h)
    if not cfg.get("tie_word_embeddings", False):
        w["lm_head.weight"] = mat(v, h)
    return w


def write_model_dir(out_dir: str, cfg: dict, seed: int = 0, tokenizer_vocab: int | None = None,
                    max_shard_bytes: int | None = None, match_vocab: bool = False) -> str:
    """Write config.json, safetensors (sharded over `max_shard_bytes`) and tokenizer files.

    match_vocab: shrink the model's vocab_size to the tokenizer's (no untokenizable ids).
    """
    os.makedirs(out_dir, exist_ok=True)
    tok = build_tokenizer(min(tokenizer_vocab or cfg["vocab_size"], cfg["vocab_size"]))
    if match_vocab:
        cfg = {**cfg, "vocab_size": tok.get_vocab_size(with_added_tokens=True)}
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2)
    weights = random_weights(cfg, seed)
    if max_shard_bytes is None:
        save_file(weights, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    else:
        _save_sharded(out_dir, weights, max_shard_bytes)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump({"add_bos_token": False, "bos_token": "<s>", "eos_token": "</s>",
                   "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length":
                   cfg["max_position_embeddings"], "chat_template": CHAT_TEMPLATE}, f, indent=2)
    with open(os.path.join(out_dir, "generation_config.json"), "w", encoding="utf-8") as f:
        json.dump({"bos_token_id": 0, "eos_token_id": 1}, f)
    return out_dir


def _save_sharded(out_dir: str, weights: dict[str, torch.Tensor], max_bytes: int) -> None:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in weights.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    weight_map = {}
    for n, shard in enumerate(shards):
        fname = f"model-{n + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(out_dir, fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
    total = sum(t.numel() * t.element_size() for t in weights.values())
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


def cache_root() -> str:
    return os.environ.get("PDSERVE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pdserve")


def init_preset(name: str, out_dir: str) -> str:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r} (presets: {', '.join(PRESETS)})")
    return write_model_dir(out_dir, hf_config(PRESETS[name]), seed=1234 + len(name), match_vocab=True)


def resolve_model(model: str) -> str:
    """A directory for `model`: itself if it is one, a trained model's committed directory,
    else the random preset, materialized on first use."""
    if os.path.isdir(model):
        return model
    if model in TRAINED:
        return TRAINED[model]
    if model not in PRESETS:
        raise ValueError(f"model {model!r} is neither a directory nor a preset "
                         f"(presets: {', '.join([*TRAINED, *PRESETS])})")
    final = os.path.join(cache_root(), "models", f"{model}-{PRESET_VERSION}")
    if os.path.isfile(os.path.join(final, "tokenizer_config.json")):
        return final
    os.makedirs(os.path.dirname(final), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{model}-", dir=os.path.dirname(final))
    init_preset(model, tmp)
    try:
        os.rename(tmp, final)            # atomic: concurrent actors race safely
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
