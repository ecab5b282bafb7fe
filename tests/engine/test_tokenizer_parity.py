"""Prompts encode, and ids decode, exactly as `AutoTokenizer.from_pretrained(dir)` does, for
tokenizers built here in the three styles real checkpoints ship:

- Llama-3: byte-level BPE whose tokenizer.json post-processor (TemplateProcessing) prepends
  <|begin_of_text|>; no add_bos_token.
- Llama-2: SentencePiece-style BPE (▁ spaces, byte fallback), TemplateProcessing prepending <s>,
  tokenizer_config `add_bos_token: true`, class LlamaTokenizerFast.
- GPT-2 / Qwen: byte-level BPE with a ByteLevel post-processor: no special tokens added.
"""
from __future__ import annotations

import json
import logging
import os
import sys

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

from engine.model.presets import _corpus
from engine.tokenizer import IncrementalDetokenizer, Tokenizer

transformers = pytest.importorskip("transformers")

TEXTS = ["Hello world", " leading space", "two  spaces\nand a newline", "", "é ü → 你好 😀",
         "The cache block prefill, decode; stream?", "<|eot_id|> inside <s> the text </s>", "x" * 40]
CORPUS = _corpus(seed=1, num_sentences=2000)


def _byte_level(specials: list[str]) -> HFTokenizer:
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=600, special_tokens=specials, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


def _sentencepiece_style() -> HFTokenizer:
    tok = HFTokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    byte_tokens = [f"<0x{i:02X}>" for i in range(256)]
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=800, special_tokens=["<unk>", "<s>", "</s>"]
                                                        + byte_tokens, show_progress=False))
    return tok


def _write(path, tok: HFTokenizer, tokenizer_config: dict) -> str:
    os.makedirs(path, exist_ok=True)
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(tokenizer_config, f)
    return str(path)


def _template(bos: str, bos_id: int) -> processors.TemplateProcessing:
    return processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])


def _llama3(path) -> str:
    tok = _byte_level(["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"])
    tok.post_processor = _template("<|begin_of_text|>", 0)
    return _write(path, tok, {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
                              "eos_token": "<|end_of_text|>", "clean_up_tokenization_spaces": True})


def _llama2(path, post_processor: bool = True) -> str:
    tok = _sentencepiece_style()
    if post_processor:
        tok.post_processor = _template("<s>", 1)
    return _write(path, tok, {"tokenizer_class": "LlamaTokenizerFast", "add_bos_token": True, "add_eos_token": False,
                              "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "legacy": False})


def _qwen(path) -> str:
    tok = _byte_level(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return _write(path, tok, {"tokenizer_class": "Qwen2Tokenizer", "bos_token": None, "eos_token": "<|im_end|>",
                              "pad_token": "<|endoftext|>", "add_bos_token": False, "add_prefix_space": False})


STYLES = {"llama3": (_llama3, 0), "llama2": (_llama2, 1), "qwen": (_qwen, None)}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tokenizers")
    return {name: build(root / name) for name, (build, _) in STYLES.items()}


def _pair(dirs, name: str) -> tuple[Tokenizer, object]:
    ours = Tokenizer(dirs[name], eos_token_ids=(2,), bos_token_id=STYLES[name][1])
    return ours, transformers.AutoTokenizer.from_pretrained(dirs[name])


@pytest.mark.parametrize("name", list(STYLES))
def test_encode_equals_auto_tokenizer(dirs, name):
    ours, hf = _pair(dirs, name)
    for text in TEXTS:
        assert ours.encode(text) == hf(text)["input_ids"], text
        assert ours.encode(text, add_special_tokens=False) == hf(text, add_special_tokens=False)["input_ids"], text
    bos = STYLES[name][1]
    first = ours.encode("Hello world")[0]
    assert (first == bos) == (name != "qwen") == ours.add_bos       # a BOS for every tokenizer but qwen's


@pytest.mark.parametrize("name", list(STYLES))
def test_decode_equals_auto_tokenizer_with_and_without_special_tokens(dirs, name):
    ours, hf = _pair(dirs, name)
    for text in TEXTS:
        ids = hf(text)["input_ids"] + hf("</s><|im_end|> tail", add_special_tokens=False)["input_ids"]
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), (text, skip)


@pytest.mark.parametrize("name", list(STYLES))
def test_streamed_text_equals_auto_tokenizer_decode(dirs, name):
    """The incremental detokenizer's deltas join to HF's decode of the completion after its prompt."""
    ours, hf = _pair(dirs, name)
    prompt = hf("The cache")["input_ids"]
    completion = hf(" block prefill é ü → 你好 😀, decode; stream?", add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(ours, prompt)
    streamed = "".join(detok.push(t) for t in completion) + detok.flush()
    full, head = (hf.decode(ids, skip_special_tokens=True) for ids in (prompt + completion, prompt))
    assert full.startswith(head) and streamed == full[len(head):]


def test_add_bos_token_without_a_post_processor_follows_auto_tokenizer_and_warns(tmp_path, caplog):
    """Whatever the installed transformers makes of add_bos_token, the engine adds the same BOS (or none);
    when that contradicts tokenizer_config.json's add_bos_token, a warning says so."""
    model_dir = _llama2(tmp_path / "no_post", post_processor=False)
    with caplog.at_level(logging.WARNING, logger="pdserve.engine.tokenizer"):
        ours = Tokenizer(model_dir, bos_token_id=1)
    hf = transformers.AutoTokenizer.from_pretrained(model_dir)
    for text in TEXTS:
        assert ours.encode(text) == hf(text)["input_ids"], text
    assert ours.add_bos == (hf("Hello world")["input_ids"][0] == 1)
    assert ("add_bos_token is True but the tokenizer's post-processor does not add the BOS" in caplog.text) \
        == (not ours.add_bos)


def test_generic_class_needs_no_transformers_and_a_named_class_falls_back_loudly(dirs, monkeypatch, caplog):
    hf = _pair(dirs, "llama3")[1]
    monkeypatch.setitem(sys.modules, "transformers", None)          # import transformers -> ImportError
    with caplog.at_level(logging.WARNING, logger="pdserve.engine.tokenizer"):
        ours = Tokenizer(dirs["llama3"], bos_token_id=0)
        assert not caplog.text
        assert all(ours.encode(t) == hf(t)["input_ids"] for t in TEXTS)
        raw = Tokenizer(dirs["llama2"], bos_token_id=1)
    assert "tokenizer_class LlamaTokenizerFast may encode differently in transformers (not installed here)" \
        in caplog.text
    assert raw.encode("Hello world")[0] == 1                         # tokenizer.json's own template


def test_bad_tokenizer_config_is_refused_naming_the_file(tmp_path):
    model_dir = _qwen(tmp_path / "bad")
    with open(os.path.join(model_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        f.write("{nope")
    with pytest.raises(ValueError, match="tokenizer_config.json: not valid JSON"):
        Tokenizer(model_dir)
