"""A compressed-tensors checkpoint written by the format's own library (compressed-tensors, as
llm-compressor writes them) loads into pdserve's int4 path and gives the logits transformers gives
for it after the library decompresses it: a reference that shares no code with pdserve's reader."""
from __future__ import annotations

import os
import shutil

import pytest
import torch

ct = pytest.importorskip("compressed_tensors")
transformers = pytest.importorskip("transformers")

from compressed_tensors.compressors import ModelCompressor  # noqa: E402
from compressed_tensors.quantization import (  # noqa: E402
    QuantizationArgs, QuantizationConfig, QuantizationScheme, apply_quantization_config)
from compressed_tensors.quantization.utils import calculate_qparams  # noqa: E402

from engine import Engine, EngineArgs  # noqa: E402

PROMPT = list(range(5, 45))


def _write(src: str, out: str, strategy: str, group_size: int | None) -> None:
    """Quantize `src`'s linear layers (lm_head aside) symmetric int4 with the library's own qparams and
    save them pack-quantized with its compressor, as llm-compressor's round-to-nearest recipe does."""
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    weights = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy=strategy, group_size=group_size)
    config = QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=weights)},
                                ignore=["lm_head"], format="pack-quantized")
    apply_quantization_config(model, config)
    for module in model.modules():
        if getattr(module, "quantization_scheme", None) is None:
            continue
        w = module.weight.data
        n, k = w.shape
        grouped = w.view(n, k // (group_size or k), group_size or k)
        scale, zero = calculate_qparams(grouped.amin(-1), grouped.amax(-1), weights)
        module.weight_scale.data.copy_(scale.view_as(module.weight_scale))
        module.weight_zero_point.data.copy_(zero.view_as(module.weight_zero_point))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="pack-quantized")
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if os.path.exists(os.path.join(src, name)):
            shutil.copy(os.path.join(src, name), out)


@pytest.mark.parametrize("strategy,group_size", [("group", 32), ("channel", None)])
def test_library_written_checkpoint_matches_transformers_on_its_decompressed_weights(
        tiny_model_dir, tmp_path, float32_plan, strategy, group_size):
    out = str(tmp_path / "ct")
    _write(tiny_model_dir, out, strategy, group_size)
    reference = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)   # decompressed
    with torch.no_grad():
        expected = reference(torch.tensor([PROMPT])).logits[0]
    engine = Engine(EngineArgs(out, dtype="float32", num_blocks=32, attention="eager"))
    assert engine.quantization == "int4"
    blocks = engine.block_manager.allocate(4)
    for rows in (PROMPT[:3], PROMPT):                   # the packed kernel's rows, then the dense path
        got = engine.runner.score(rows, blocks)
        torch.testing.assert_close(got, expected[:len(rows)], atol=2e-5, rtol=2e-5)
    engine.block_manager.free(blocks)
