"""The committed trained model (engine/weights/pydoc): its files, their recorded hashes, and
that our engine and HF transformers load it and score held-out text alike. No training here."""
from __future__ import annotations

import json
import math
import os

import pytest
import torch

from engine import Engine, EngineArgs
from engine.model.presets import TRAINED, resolve_model
from bench.train.passages import load_passages
from bench.train.trainer import MODEL_FILES, sha256_file

MODEL_DIR = TRAINED["pydoc"]


def _record() -> dict:
    with open(os.path.join(MODEL_DIR, "training.json"), encoding="utf-8") as f:
        return json.load(f)


def test_files_exist_and_match_their_recorded_hashes():
    record = _record()
    assert set(record["sha256"]) == set(MODEL_FILES)
    for name in MODEL_FILES:
        assert sha256_file(os.path.join(MODEL_DIR, name)) == record["sha256"][name], name
    assert os.path.getsize(os.path.join(MODEL_DIR, "model.safetensors")) <= 16 << 20
    assert os.path.isfile(os.path.join(MODEL_DIR, "loss_curve.png"))
    assert len(record["corpus"]["sha256"]) == 64 and record["heldout"]["bits_per_byte"] > 0


def test_directory_is_a_plain_llama_with_chat_template_and_generation_defaults():
    with open(os.path.join(MODEL_DIR, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    with open(os.path.join(MODEL_DIR, "tokenizer_config.json"), encoding="utf-8") as f:
        assert "{% for message in messages %}" in json.load(f)["chat_template"]
    with open(os.path.join(MODEL_DIR, "generation_config.json"), encoding="utf-8") as f:
        assert json.load(f)["eos_token_id"] == cfg["eos_token_id"]
    assert resolve_model("pydoc") == MODEL_DIR


def test_held_out_passages_come_from_held_out_documents_only():
    from bench.train.corpus import is_heldout
    with open(os.path.join(MODEL_DIR, "heldout_passages.json"), encoding="utf-8") as f:
        passages = json.load(f)["passages"]
    assert len(passages) == 64
    assert all(is_heldout(p["doc"]) for p in passages)
    assert set(p["doc"] for p in passages) == set(_record()["corpus"]["heldout_docs"])


@pytest.fixture(scope="module")
def engine():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)           # a 4 M-param model: one thread is fastest, and steady on a busy machine
    yield Engine(EngineArgs("pydoc", dtype="float32", num_blocks=64, enable_prefix_cache=False, attention="eager"))
    torch.set_num_threads(threads)


def test_engine_and_hf_agree_on_held_out_bits_per_token(engine):
    from transformers import AutoModelForCausalLM

    from bench.trained_quality import engine_nll
    from bench.train.trainer import nll_sum
    windows = load_passages(MODEL_DIR)[:4]
    e_nll, n = engine_nll(engine, windows)
    hf = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32)
    h_nll = nll_sum(hf, windows)
    e_bits, h_bits = e_nll / n / math.log(2), h_nll / n / math.log(2)
    assert abs(e_bits - h_bits) < 1e-4, (e_bits, h_bits)
    assert e_bits < 0.6 * math.log2(engine.vocab_size)      # trained: far below a uniform guess


def test_engine_tokenizes_like_auto_tokenizer(engine):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(MODEL_DIR)
    text = "The json module exposes an API familiar to users of pickle. Ünïcode → ok\n    >>> x = 1"
    assert engine.tokenizer.encode(text) == hf(text)["input_ids"]
    assert engine.tokenizer.encode(text)[0] == engine.config.bos_token_id
