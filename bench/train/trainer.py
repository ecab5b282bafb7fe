"""Train the `pydoc` model: a byte-level BPE tokenizer and a small Llama, from scratch, on one CPU thread.

The recipe (`Recipe`) is the whole specification: with the same corpus and seed the run
is bit-for-bit repeatable (one thread, seeded init, seeded window order). The result is a
plain Hugging Face Llama directory (bf16 safetensors) plus `training.json` (corpus hash,
recipe, loss curve, held-out bits per byte, sha256 of every file) and `loss_curve.png`.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import time
from dataclasses import asdict, dataclass

import torch

from bench.train.corpus import Corpus

BOS, EOS = "<s>", "</s>"
CHAT_TEMPLATE = ("{{ bos_token }}{% for message in messages %}{{ message['content'] | trim }}\n\n{% endfor %}")
MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
               "generation_config.json")


@dataclass(frozen=True)
class Recipe:
    seed: int = 0
    vocab_size: int = 4096
    hidden_size: int = 256
    intermediate_size: int = 768
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    seq_len: int = 512
    batch_size: int = 4
    steps: int = 1700
    lr: float = 2e-3
    min_lr: float = 2e-4
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 100
    eval_windows: int = 24               # held-out windows scored at each eval (the final eval scores all)


def train_tokenizer(corpus: Corpus, vocab_size: int):
    """Byte-level BPE on the training documents only (256 byte symbols + merges + <s>, </s>).
    Its post-processor prepends <s>, so `AutoTokenizer` adds BOS as our engine does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BOS, EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((text for _, text in corpus.train), trainer=trainer)
    add_bos_post_processor(tok)
    return tok


def add_bos_post_processor(tok) -> None:
    from tokenizers import processors

    bos = (BOS, tok.token_to_id(BOS))
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                       special_tokens=[bos])


def encode_documents(tok, docs: list[tuple[str, str]]) -> list[list[int]]:
    """Each document as [<s>] + text tokens + [</s>]."""
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    return [[bos] + enc.ids + [eos] for enc in tok.encode_batch([t for _, t in docs], add_special_tokens=False)]


def heldout_windows(docs_ids: list[list[int]], seq_len: int) -> list[list[int]]:
    """Non-overlapping windows of seq_len + 1 tokens (one token of overlap), each scored from a fresh
    context: every token after a document's <s> is scored exactly once, </s> included."""
    windows = []
    for ids in docs_ids:
        for start in range(0, len(ids) - 1, seq_len):
            windows.append(ids[start:start + seq_len + 1])
    return windows


def hf_llama_config(recipe: Recipe, vocab_size: int, bos_id: int, eos_id: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": recipe.hidden_size, "intermediate_size": recipe.intermediate_size,
        "num_hidden_layers": recipe.num_hidden_layers, "num_attention_heads": recipe.num_attention_heads,
        "num_key_value_heads": recipe.num_key_value_heads,
        "head_dim": recipe.hidden_size // recipe.num_attention_heads,
        "vocab_size": vocab_size, "max_position_embeddings": recipe.seq_len, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "tie_word_embeddings": True, "attention_bias": False, "mlp_bias": False,
        "bos_token_id": bos_id, "eos_token_id": eos_id, "initializer_range": 0.02, "use_cache": True,
        "torch_dtype": "bfloat16",
    }


def nll_sum(model, windows: list[list[int]], batch: int = 8) -> float:
    """Summed next-token negative log-likelihood (nats) of `windows` under an HF causal LM."""
    total = 0.0
    model.eval()
    with torch.no_grad():
        for w in sorted(windows, key=len):          # group equal lengths; the sum does not depend on order
            x = torch.tensor([w])
            logits = model(input_ids=x[:, :-1]).logits.float()
            total += torch.nn.functional.cross_entropy(logits[0], x[0, 1:], reduction="sum").item()
    return total


def lr_at(step: int, r: Recipe) -> float:
    if step < r.warmup_steps:
        return r.lr * (step + 1) / r.warmup_steps
    progress = (step - r.warmup_steps) / max(1, r.steps - r.warmup_steps)
    return r.min_lr + 0.5 * (r.lr - r.min_lr) * (1 + math.cos(math.pi * progress))


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def train(corpus: Corpus, out_dir: str, recipe: Recipe, log=print) -> dict:
    """Train and write the model directory; returns the training record (also in training.json)."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(1)
    torch.manual_seed(recipe.seed)
    t0 = time.time()
    tok = train_tokenizer(corpus, recipe.vocab_size)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    bos_id, eos_id = tok.token_to_id(BOS), tok.token_to_id(EOS)
    train_ids = torch.tensor([i for ids in encode_documents(tok, corpus.train) for i in ids], dtype=torch.int32)
    heldout = heldout_windows(encode_documents(tok, corpus.heldout), recipe.seq_len)
    log(f"tokenizer: vocab {vocab}, {len(train_ids)} train tokens "
        f"({corpus.num_train_bytes / len(train_ids):.2f} bytes/token), {len(heldout)} held-out windows, "
        f"{time.time() - t0:.0f}s")

    cfg = hf_llama_config(recipe, vocab, bos_id, eos_id)
    model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in cfg.items() if k != "torch_dtype"},
                                         attn_implementation="sdpa"))
    num_params = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.dim() == 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() == 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": recipe.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=recipe.lr, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(recipe.seed)
    eval_subset = heldout[:: max(1, len(heldout) // recipe.eval_windows)][:recipe.eval_windows]
    eval_tokens = sum(len(w) - 1 for w in eval_subset)
    curve, evals = [], []
    tokens_per_step = recipe.batch_size * recipe.seq_len
    log(f"model: {num_params / 1e6:.2f}M params, {recipe.steps} steps x {tokens_per_step} tokens")
    t_train = time.time()
    for step in range(recipe.steps):
        model.train()
        starts = torch.randint(0, len(train_ids) - recipe.seq_len - 1, (recipe.batch_size,), generator=gen)
        batch = torch.stack([train_ids[s:s + recipe.seq_len + 1] for s in starts.tolist()]).long()
        for group in opt.param_groups:
            group["lr"] = lr_at(step, recipe)
        logits = model(input_ids=batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), batch[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        curve.append(round(loss.item(), 4))
        done = step + 1
        if done % recipe.eval_every == 0 or done == recipe.steps:
            ev = nll_sum(model, eval_subset) / eval_tokens
            evals.append((done, round(ev, 4)))
            elapsed = time.time() - t_train
            log(f"step {done}/{recipe.steps} loss {sum(curve[-20:]) / len(curve[-20:]):.3f} heldout {ev:.3f} "
                f"lr {lr_at(step, recipe):.2e} {done * tokens_per_step / elapsed:.0f} tok/s "
                f"ETA {elapsed / done * (recipe.steps - done) / 60:.1f} min")
        elif done % 20 == 0:
            elapsed = time.time() - t_train
            eta = elapsed / done * (recipe.steps - done) / 60
            log(f"step {done}/{recipe.steps} loss {sum(curve[-20:]) / 20:.3f} "
                f"{done * tokens_per_step / elapsed:.0f} tok/s ETA {eta:.1f} min")
    train_seconds = time.time() - t_train

    os.makedirs(out_dir, exist_ok=True)
    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()
             if k != "lm_head.weight"}                   # tied to embed_tokens
    save_file(state, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    _write_json(os.path.join(out_dir, "config.json"), cfg)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    _write_json(os.path.join(out_dir, "tokenizer_config.json"), {
        "add_bos_token": True, "add_eos_token": False, "bos_token": BOS, "eos_token": EOS,
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": recipe.seq_len,
        "clean_up_tokenization_spaces": False, "chat_template": CHAT_TEMPLATE})
    _write_json(os.path.join(out_dir, "generation_config.json"), {
        "bos_token_id": bos_id, "eos_token_id": eos_id, "do_sample": True, "temperature": 0.7,
        "top_p": 0.9, "top_k": 40, "repetition_penalty": 1.1})

    # Held-out bits per byte of the committed (bf16-rounded) weights, scored in float32.
    model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    model.tie_weights()
    total_nll = nll_sum(model, heldout)
    heldout_bytes = corpus.num_heldout_bytes
    bpb = total_nll / math.log(2) / heldout_bytes
    record = {
        "model": "pydoc", "recipe": asdict(recipe), "num_params": num_params,
        "corpus": {"package": corpus.deb_name, "deb_sha256": corpus.deb_sha256, "sha256": corpus.sha256,
                   "license": "PSF License Agreement (Python documentation)",
                   "num_train_docs": len(corpus.train), "num_heldout_docs": len(corpus.heldout),
                   "heldout_docs": [p for p, _ in corpus.heldout], "train_bytes": corpus.num_train_bytes,
                   "heldout_bytes": heldout_bytes, "train_tokens": len(train_ids)},
        "heldout": {"windows": len(heldout), "tokens": sum(len(w) - 1 for w in heldout), "nll_nats": total_nll,
                    "bits_per_byte": bpb, "weights": "bf16, scored in float32 by transformers"},
        "train_seconds": round(train_seconds, 1), "torch": torch.__version__,
        "loss_curve": curve, "heldout_loss": evals,
        "sha256": {name: sha256_file(os.path.join(out_dir, name)) for name in MODEL_FILES},
    }
    _write_json(os.path.join(out_dir, "training.json"), record)
    plot_loss(record, os.path.join(out_dir, "loss_curve.png"))
    log(f"done: held-out {bpb:.4f} bits/byte, {train_seconds / 60:.1f} min of training")
    return record


def plot_loss(record: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curve = record["loss_curve"]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(range(1, len(curve) + 1), curve, lw=0.6, alpha=0.5, label="train (per step)")
    k = 25
    smooth = [sum(curve[max(0, i - k + 1):i + 1]) / len(curve[max(0, i - k + 1):i + 1]) for i in range(len(curve))]
    ax.plot(range(1, len(curve) + 1), smooth, lw=1.5, label=f"train ({k}-step mean)")
    steps, losses = zip(*record["heldout_loss"]) if record["heldout_loss"] else ((), ())
    ax.plot(steps, losses, "o-", label="held-out (subset)")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(f"pydoc: {record['num_params'] / 1e6:.1f}M params, held-out "
                 f"{record['heldout']['bits_per_byte']:.3f} bits/byte")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
