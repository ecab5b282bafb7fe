"""Tokenizer keywords: add_special_tokens on encode, skip_special_tokens on decode."""
from __future__ import annotations

import json
import os
import shutil

from engine.tokenizer import Tokenizer


def test_decode_keeps_special_tokens_only_when_asked(tiny_model_dir):
    tok = Tokenizer(tiny_model_dir, (1,), 0)
    a, b = tok.encode("ab", add_special_tokens=False)[0], tok.encode("cd", add_special_tokens=False)[0]
    plain = tok.decode([a, b])
    assert tok.decode([a, 1, b]) == plain
    assert tok.decode([a, 1, b], skip_special_tokens=True) == plain
    assert tok.decode([a, 1, b], skip_special_tokens=False) == tok.decode([a]) + "</s>" + tok.decode([b])


def test_encode_adds_bos_unless_told_not_to(tiny_model_dir, tmp_path):
    model_dir = str(tmp_path / "bos")
    shutil.copytree(tiny_model_dir, model_dir)
    cfg_path = os.path.join(model_dir, "tokenizer_config.json")
    with open(cfg_path, encoding="utf-8") as f:
        cfg = json.load(f)
    with open(cfg_path, "w", encoding="utf-8") as f:
        json.dump({**cfg, "add_bos_token": True}, f)
    tok = Tokenizer(model_dir, (1,), 0)
    bare = Tokenizer(tiny_model_dir, (1,), 0).encode("hello world")
    assert tok.encode("hello world") == [0] + bare
    assert tok.encode("hello world", add_special_tokens=False) == bare
