"""The tokenizers the mask benchmark measures, as `tokenizer.json` strings.

- `pydoc` (4096 tokens): the committed trained model's byte-level BPE (engine/weights/pydoc).
- `small` (16384 tokens): the benchmark preset's, whose decode step is the yardstick.
- `synthetic-150k`: a byte-level BPE trained here on a generated corpus (English words, pseudo-words,
  numbers, JSON snippets) up to ~150k tokens, the size of today's large vocabularies (Llama 3: 128k,
  Qwen 2: 152k); built once (~15 s) and cached under the preset cache.
"""
from __future__ import annotations

import os
import random
from dataclasses import dataclass

from engine.model.presets import _SYLLABLES, _WORDS, TRAINED, cache_root, resolve_model

SYNTHETIC_VOCAB = 150_000
SYNTHETIC_VERSION = "v1"


@dataclass(frozen=True)
class Vocab:
    name: str
    tokenizer_json: str
    vocab_size: int
    eos_token_id: int = 1            # every tokenizer here: <s> = 0, </s> = 1


def load(name: str) -> Vocab:
    from tokenizers import Tokenizer
    if name == "synthetic-150k":
        text = synthetic_tokenizer_json()
    else:
        directory = TRAINED[name] if name in TRAINED else resolve_model(name)
        with open(os.path.join(directory, "tokenizer.json"), encoding="utf-8") as f:
            text = f.read()
    size = Tokenizer.from_str(text).get_vocab_size(with_added_tokens=True)
    return Vocab(name, text, size)


def synthetic_tokenizer_json(vocab_size: int = SYNTHETIC_VOCAB) -> str:
    path = os.path.join(cache_root(), "bench", f"bpe-{vocab_size}-{SYNTHETIC_VERSION}.json")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(), trainer=trainer)
    text = tok.to_str()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)
    return text


def _corpus(seed: int = 0, num_lines: int = 200_000):
    """Enough distinct words (400k pseudo-words) for BPE to learn ~150k merges."""
    rng = random.Random(seed)
    pseudo = ["".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 5))) for _ in range(400_000)]
    for _ in range(num_lines):
        words = [rng.choice(_WORDS) if rng.random() < 0.3 else rng.choice(pseudo) for _ in range(rng.randint(4, 16))]
        if rng.random() < 0.3:
            words.append(str(rng.randint(0, 10 ** rng.randint(1, 8))))
        if rng.random() < 0.2:
            words.append('{"%s": [%d, "%s"]}' % (rng.choice(pseudo), rng.randint(0, 999), rng.choice(pseudo)))
        yield " ".join(w.capitalize() if rng.random() < 0.1 else w for w in words) + rng.choice(".,;!?\n")
