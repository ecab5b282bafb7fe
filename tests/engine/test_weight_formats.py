"""Weights: bf16/fp16/fp32 safetensors, one file or sharded, load exactly; anything else is refused
with an error naming the file, tensor or config key and what was found there."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from hf_checkpoints import hf_logits, hf_model, random_prompt, write_checkpoint
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from engine import Engine, EngineArgs
from engine.model.config import ModelConfig
from engine.model.loader import INDEX_FILE

transformers = pytest.importorskip("transformers")

VOCAB = 1024


def _llama_config():
    return transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                    bos_token_id=0, eos_token_id=1, pad_token_id=None, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def plain_dir(tmp_path_factory, tiny_model_dir) -> str:
    return write_checkpoint(str(tmp_path_factory.mktemp("fmt") / "plain"), _llama_config(), tiny_model_dir, seed=5)


def _copy(src: str, tmp_path, name: str = "model") -> str:
    dst = str(tmp_path / name)
    shutil.copytree(src, dst)
    return dst


def _engine(model_dir: str) -> Engine:
    return Engine(EngineArgs(model_dir, dtype="float32", num_blocks=32, block_size=16, attention="eager"))


@pytest.mark.parametrize("dtype,sharded", [(torch.bfloat16, True), (torch.float16, False), (torch.float32, True)])
def test_each_float_dtype_and_sharding_loads_exactly(tmp_path, tiny_model_dir, dtype, sharded):
    """The engine (float32) upcasts the stored values as HF does: logits equal HF's float32 load."""
    model_dir = write_checkpoint(str(tmp_path / "ckpt"), _llama_config(), tiny_model_dir, seed=5, dtype=dtype,
                                 max_shard_size="100KB" if sharded else None)
    files = sorted(n for n in os.listdir(model_dir) if n.endswith(".safetensors"))
    assert (len(files) > 2 and os.path.isfile(os.path.join(model_dir, INDEX_FILE))) == sharded
    with safe_open(os.path.join(model_dir, files[0]), framework="pt") as f:
        assert f.get_tensor(next(iter(f.keys()))).dtype == dtype
    ids = random_prompt(60, seed=1, vocab=VOCAB)
    engine = _engine(model_dir)
    blocks = engine.block_manager.allocate(4)
    torch.testing.assert_close(engine.runner.score(ids, blocks), hf_logits(hf_model(model_dir), ids),
                               atol=1e-4, rtol=1e-4)


def _edit_config(model_dir: str, **changes) -> str:
    path = os.path.join(model_dir, "config.json")
    with open(path, encoding="utf-8") as f:
        raw = json.load(f)
    raw.update(changes)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(raw, f)
    return model_dir


@pytest.mark.parametrize("quant,shown", [              # accepted formats: tests/engine/test_quantized_checkpoint.py
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes'"),
    ({"quant_method": "hqq", "nbits": 4}, "'hqq'"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "'fp8'"),
])
def test_quantization_config_is_refused_naming_the_method(plain_dir, tmp_path, quant, shown):
    model_dir = _edit_config(_copy(plain_dir, tmp_path), quantization_config=quant)
    with pytest.raises(ValueError, match=f"config.json: quantized checkpoint .*quant_method.: {shown}"):
        _engine(model_dir)


@pytest.mark.parametrize("extra,shown", [
    ({"model.layers.0.self_attn.q_proj.qweight": torch.zeros(16, 64, dtype=torch.int32)}, "q_proj.qweight"),
    ({"model.layers.0.self_attn.q_proj.g_idx": torch.zeros(64, dtype=torch.int32)}, "q_proj.g_idx"),
    ({"model.layers.0.self_attn.q_proj.scales": torch.zeros(1, 64)}, "q_proj.scales"),
])
def test_quantized_tensor_names_are_refused_naming_file_and_tensor(plain_dir, tmp_path, extra, shown):
    model_dir = _copy(plain_dir, tmp_path)
    path = os.path.join(model_dir, "model.safetensors")
    save_file({**load_file(path), **extra}, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"model.safetensors: tensor '.*{shown}' belongs to a quantized"):
        _engine(model_dir)


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.float8_e4m3fn])
def test_non_float_weights_are_refused_naming_tensor_and_dtype(plain_dir, tmp_path, dtype):
    model_dir = _copy(plain_dir, tmp_path)
    path = os.path.join(model_dir, "model.safetensors")
    weights = load_file(path)
    name = "model.layers.1.mlp.down_proj.weight"
    weights[name] = weights[name].to(dtype)
    save_file(weights, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"model.safetensors: tensor '{name}' has dtype {dtype}"):
        _engine(model_dir)


def test_pickled_only_checkpoint_is_refused_naming_the_file(plain_dir, tmp_path):
    model_dir = _copy(plain_dir, tmp_path)
    path = os.path.join(model_dir, "model.safetensors")
    torch.save(load_file(path), os.path.join(model_dir, "pytorch_model.bin"))
    os.remove(path)
    with pytest.raises(ValueError, match="only pickled PyTorch weights found \\(pytorch_model.bin\\)"):
        _engine(model_dir)


def test_missing_shard_and_bad_index_are_refused_naming_the_file(tmp_path, tiny_model_dir):
    model_dir = write_checkpoint(str(tmp_path / "sharded"), _llama_config(), tiny_model_dir, max_shard_size="100KB")
    shards = sorted(n for n in os.listdir(model_dir) if n.endswith(".safetensors"))
    os.remove(os.path.join(model_dir, shards[1]))
    with pytest.raises(FileNotFoundError, match=f"{shards[1]}: weight shard named in {INDEX_FILE} is missing"):
        _engine(model_dir)
    with open(os.path.join(model_dir, INDEX_FILE), "w", encoding="utf-8") as f:
        json.dump({"metadata": {}}, f)
    with pytest.raises(ValueError, match=f"{INDEX_FILE}: not a safetensors index"):
        _engine(model_dir)


def test_missing_and_misshapen_weights_are_refused_naming_the_weight(plain_dir, tmp_path):
    model_dir = _copy(plain_dir, tmp_path)
    path = os.path.join(model_dir, "model.safetensors")
    weights = load_file(path)
    down = weights.pop("model.layers.1.mlp.down_proj.weight")
    save_file(weights, path, metadata={"format": "pt"})
    with pytest.raises(KeyError, match="'model.layers.1.mlp.down_proj.weight' is missing"):
        _engine(model_dir)
    save_file({**weights, "model.layers.1.mlp.down_proj.weight": down[:, :100].contiguous()}, path,
              metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"'model.layers.1.mlp.down_proj.weight' has shape \(64, 100\), "
                                         r"config.json implies \(64, 128\)"):
        _engine(model_dir)


@pytest.mark.parametrize("changes,shown", [
    ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}},
     "rope_scaling type 'longrope'"),
    ({"rope_scaling": {"type": "su", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}}, "rope_scaling type 'su'"),
    ({"hidden_act": "gelu_pytorch_tanh"}, "hidden_act 'gelu_pytorch_tanh'"),
    ({"model_type": "gemma2"}, "model_type 'gemma2' is not supported"),
    ({"model_type": "qwen3", "use_sliding_window": True, "sliding_window": 64, "max_window_layers": 1,
      "layer_types": None}, "sliding_window on some layers only"),
])
def test_unsupported_architecture_fields_are_refused_naming_the_key(changes, shown):
    raw = {**_llama_config().to_dict(), "model_type": "phi3", **changes}
    with pytest.raises(ValueError, match=f"config.json: {shown}"):
        ModelConfig.from_dict(raw)


@pytest.mark.parametrize("changes,window", [
    ({"model_type": "phi3", "sliding_window": 2047}, 2047),
    ({"model_type": "mistral", "sliding_window": 4096}, 4096),
    ({"model_type": "qwen3", "sliding_window": 4096, "use_sliding_window": False}, None),
    ({"model_type": "qwen3", "sliding_window": 64, "use_sliding_window": True, "max_window_layers": 0}, 64),
    ({"model_type": "qwen2", "sliding_window": 64, "use_sliding_window": True, "max_window_layers": 2}, None),
])
def test_sliding_window_is_read_as_each_architecture_applies_it(changes, window):
    raw = {**_llama_config().to_dict(), "layer_types": None, **changes}
    assert ModelConfig.from_dict(raw).sliding_window == window


@pytest.mark.parametrize("head", ["embedding", "different"])
def test_tied_checkpoint_storing_lm_head_is_served_as_hf_serves_it(tmp_path, tiny_model_dir, head):
    """tie_word_embeddings with an lm_head.weight stored too: equal to the embedding, the head stays tied;
    different, transformers unties it and serves the stored head (PreTrainedModel.tie_weights)."""
    cfg = _llama_config()
    cfg.tie_word_embeddings = True
    model_dir = write_checkpoint(str(tmp_path / "tied"), cfg, tiny_model_dir, seed=6)
    path = os.path.join(model_dir, "model.safetensors")
    weights = load_file(path)
    embed = weights["model.embed_tokens.weight"]
    weights["lm_head.weight"] = embed.clone() if head == "embedding" else torch.randn_like(embed)
    save_file(weights, path, metadata={"format": "pt"})
    engine = _engine(model_dir)
    assert (engine.model.lm_head.weight is engine.model.embed_tokens.weight) == (head == "embedding")
    assert engine.config.tie_word_embeddings == (head == "embedding")     # its parameter count too
    ids = random_prompt(40, seed=2, vocab=VOCAB)
    blocks = engine.block_manager.allocate(3)
    torch.testing.assert_close(engine.runner.score(ids, blocks), hf_logits(hf_model(model_dir), ids),
                               atol=1e-4, rtol=1e-4)


def test_other_safetensors_beside_model_safetensors_are_not_loaded(plain_dir, tmp_path):
    """Mistral's repos ship `consolidated.safetensors` (its own tensor names) beside the HF weights;
    transformers reads model.safetensors alone, and so does the engine."""
    model_dir = _copy(plain_dir, tmp_path)
    save_file({"tok_embeddings.weight": torch.zeros(VOCAB, 64), "layers.0.attention.wq.weight": torch.zeros(64, 64)},
              os.path.join(model_dir, "consolidated.safetensors"))
    engine = _engine(model_dir)
    ids = random_prompt(30, seed=3, vocab=VOCAB)
    blocks = engine.block_manager.allocate(2)
    torch.testing.assert_close(engine.runner.score(ids, blocks), hf_logits(hf_model(model_dir), ids),
                               atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("content,shown", [
    (b"version https://git-lfs.github.com/spec/v1\noid sha256:4d7a21\nsize 2471645608\n", "a Git LFS pointer"),
    (None, "Error while deserializing header"),      # None: the first half of the real file (a download cut short)
])
def test_unreadable_safetensors_file_is_refused_naming_it(plain_dir, tmp_path, content, shown):
    model_dir = _copy(plain_dir, tmp_path)
    path = os.path.join(model_dir, "model.safetensors")
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(content if content is not None else data[:len(data) // 2])
    with pytest.raises(ValueError, match=f"model.safetensors: not a readable safetensors file \\({shown}"):
        _engine(model_dir)
