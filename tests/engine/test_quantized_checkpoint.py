"""GPTQ, AWQ and compressed-tensors 4-bit checkpoints (written by tests/engine/quantized_checkpoints.py
from each format's definition) load into the int4 path and give the logits of the float model holding
their dequantized weights; the formats and fields pdserve cannot serve are refused naming them."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from hf_checkpoints import random_prompt, write_checkpoint
from quantized_checkpoints import write_quantized
from quantized_support import prompt_logits, small_engine

from engine.model.quantized_linear import QuantizedLinear

transformers = pytest.importorskip("transformers")

VOCAB = 1024


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory, tiny_model_dir) -> str:
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   bos_token_id=0, eos_token_id=1, pad_token_id=None, tie_word_embeddings=False)
    return write_checkpoint(str(tmp_path_factory.mktemp("qckpt") / "float"), cfg, tiny_model_dir, seed=7)


@pytest.mark.parametrize("fmt,group", [("gptq", 32), ("gptq_v2", 64), ("gptq", -1), ("awq", 32),
                                       ("compressed-tensors", 32), ("compressed-tensors", -1)])
def test_checkpoint_loads_into_int4_and_matches_its_dequantized_weights(float_dir, tmp_path, float32_plan, fmt, group):
    qdir, ref_dir = write_quantized(float_dir, str(tmp_path / "q"), str(tmp_path / "ref"), fmt, group)
    engine, reference = small_engine(qdir), small_engine(ref_dir)
    layer = engine.model.layers[0]
    assert engine.quantization == "int4" and reference.quantization == "none"
    assert all(isinstance(m, QuantizedLinear) for m in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj,
                                                        layer.down_proj))
    assert layer.qkv_proj.plan.group_size == (64 if group == -1 else group)   # per channel: as groups of 64
    ids = random_prompt(40, seed=3, vocab=VOCAB)
    for rows in (ids[:3], ids):               # the packed kernel (<= 4 rows) and the dense path
        torch.testing.assert_close(prompt_logits(engine, rows), prompt_logits(reference, rows), atol=2e-5, rtol=2e-5)


def test_measured_plan_serves_a_checkpoint_close_to_its_weights(float_dir, tmp_path):
    """The machine's own plan (bfloat16 activations where that measured faster): bf16-rounding close."""
    qdir, ref_dir = write_quantized(float_dir, str(tmp_path / "q"), str(tmp_path / "ref"), "awq", 32)
    engine, reference = small_engine(qdir, quantization="int4"), small_engine(ref_dir)
    ids = random_prompt(40, seed=4, vocab=VOCAB)
    for rows in (ids[:1], ids[:8], ids):
        got, want = prompt_logits(engine, rows), prompt_logits(reference, rows)
        assert (got - want).abs().max() <= 0.02 * want.abs().max()


def test_projections_the_checkpoint_left_float_load_dense(float_dir, tmp_path, float32_plan):
    qdir, ref_dir = write_quantized(float_dir, str(tmp_path / "q"), str(tmp_path / "ref"), "gptq", 32,
                                    skip=("layers.1.mlp.down_proj",))
    engine = small_engine(qdir)
    assert type(engine.model.layers[1].down_proj).__name__ == "Linear"
    assert isinstance(engine.model.layers[0].down_proj, QuantizedLinear)
    ids = random_prompt(20, seed=5, vocab=VOCAB)
    expected = prompt_logits(small_engine(ref_dir), ids)
    torch.testing.assert_close(prompt_logits(engine, ids), expected, atol=2e-5, rtol=2e-5)


def test_int8_on_a_4bit_checkpoint_is_refused(float_dir, tmp_path):
    qdir, _ = write_quantized(float_dir, str(tmp_path / "q"), str(tmp_path / "ref"), "gptq", 32)
    with pytest.raises(ValueError, match="quantization int8 cannot apply to a 4-bit gptq checkpoint"):
        small_engine(qdir, quantization="int8")


def _with_config(float_dir: str, tmp_path, quant: dict) -> str:
    model_dir = str(tmp_path / "cfg")
    shutil.copytree(float_dir, model_dir)
    path = os.path.join(model_dir, "config.json")
    with open(path, encoding="utf-8") as f:
        raw = json.load(f)
    raw["quantization_config"] = quant
    with open(path, "w", encoding="utf-8") as f:
        json.dump(raw, f)
    return model_dir


@pytest.mark.parametrize("quant,shown", [
    ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "field 'bits' is 8"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True}, "field 'desc_act' is true"),
    ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "field 'checkpoint_format' is 'marlin'"),
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "field 'version' is 'gemv'"),
    ({"quant_method": "awq", "w_bit": 3}, "field 'bits' is 3"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 48}, "field 'group_size' is 48"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method 'bitsandbytes'"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "quant_method 'fp8' stores fp8 weights"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized"}, "format 'float-quantized'"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {
        "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}}}},
     r"field 'config_groups.\*.weights.num_bits' is 8"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {
        "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32},
        "input_activations": {"num_bits": 8}}}}, "activation quantization"),
])
def test_unsupported_quantization_config_is_refused_naming_the_field(float_dir, tmp_path, quant, shown):
    with pytest.raises(ValueError, match=f"config.json: quantized checkpoint .*not supported: .*{shown}"):
        small_engine(_with_config(float_dir, tmp_path, quant))


def test_act_order_g_idx_is_refused_naming_the_tensor(float_dir, tmp_path, float32_plan):
    from safetensors.torch import load_file, save_file
    qdir, _ = write_quantized(float_dir, str(tmp_path / "q"), str(tmp_path / "ref"), "gptq", 32)
    path = os.path.join(qdir, "model.safetensors")
    tensors = load_file(path)
    name = "model.layers.0.mlp.down_proj.g_idx"
    tensors[name] = tensors[name].flip(0).contiguous()
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"gptq tensor '{name}' is not k // group_size"):
        small_engine(qdir)
