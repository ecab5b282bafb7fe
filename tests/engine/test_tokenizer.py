"""Tokenizer keywords: add_special_tokens on encode, skip_special_tokens on decode."""
from __future__ import annotations

import json
import os
import shutil

import pytest

from engine.tokenizer import Tokenizer


def test_decode_keeps_special_tokens_only_when_asked(tiny_model_dir):
    tok = Tokenizer(tiny_model_dir, (1,), 0)
    a, b = tok.encode("ab", add_special_tokens=False)[0], tok.encode("cd", add_special_tokens=False)[0]
    plain = tok.decode([a, b])
    assert tok.decode([a, 1, b]) == plain
    assert tok.decode([a, 1, b], skip_special_tokens=True) == plain
    assert tok.decode([a, 1, b], skip_special_tokens=False) == tok.decode([a]) + "</s>" + tok.decode([b])


def test_encode_adds_the_bos_auto_tokenizer_adds(tiny_model_dir, tmp_path):
    """add_bos_token in tokenizer_config.json: the engine adds a BOS exactly when AutoTokenizer does
    (transformers >= 5: when tokenizer.json's post-processor does; test_tokenizer_parity.py has the styles)."""
    transformers = pytest.importorskip("transformers")
    model_dir = str(tmp_path / "bos")
    shutil.copytree(tiny_model_dir, model_dir)
    cfg_path = os.path.join(model_dir, "tokenizer_config.json")
    with open(cfg_path, encoding="utf-8") as f:
        cfg = json.load(f)
    with open(cfg_path, "w", encoding="utf-8") as f:
        json.dump({**cfg, "add_bos_token": True}, f)
    tok = Tokenizer(model_dir, (1,), 0)
    hf = transformers.AutoTokenizer.from_pretrained(model_dir)
    bare = Tokenizer(tiny_model_dir, (1,), 0).encode("hello world", add_special_tokens=False)
    assert tok.encode("hello world") == hf("hello world")["input_ids"]
    assert tok.encode("hello world", add_special_tokens=False) == bare == hf("hello world",
                                                                            add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("content,shown", [
    ("version https://git-lfs.github.com/spec/v1\noid sha256:4d7a21\nsize 9085657\n", "a Git LFS pointer"),
    ('{"version": "1.0", "model": {"type": "NoSuchModel"}}', "data did not match any variant"),
])
def test_unreadable_tokenizer_json_is_refused_naming_it(tiny_model_dir, tmp_path, content, shown):
    model_dir = str(tmp_path / "tok")
    shutil.copytree(tiny_model_dir, model_dir)
    with open(os.path.join(model_dir, "tokenizer.json"), "w", encoding="utf-8") as f:
        f.write(content)
    with pytest.raises(ValueError, match=f"tokenizer.json: not a readable tokenizer.json \\({shown}"):
        Tokenizer(model_dir, (1,), 0)
