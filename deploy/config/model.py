"""The ``model`` section: which model every pool serves, its dtype, attention kernels, weight layout and
weight-only quantization."""
from __future__ import annotations

import os
from typing import Annotated, Literal, Optional

from pydantic import AfterValidator, Field, ValidationInfo

from deploy.config.base import PRESET_MODELS, Int, Section, resolve_path

Quantization = Literal["none", "int8", "int4"]
QuantizationGroupSize = Literal[32, 64, 128]
QUANTIZATION_HELP = (
    "Weight-only quantization of the decoder layers' projections, at load: none; int8 (one scale per "
    "output channel); int4 (a scale per group of quantization_group_size input channels). The embedding "
    "stays in dtype, and the LM head too unless quantize_lm_head. A GPTQ / AWQ / compressed-tensors "
    "4-bit checkpoint is served int4 as stored under none or int4 (int8 is refused for it).")


def check_model_name(value: str, info: ValidationInfo | None) -> str:
    """A preset name stays as is; anything else must be a local HF-format
    model directory (it holds ``config.json``) and becomes an absolute path."""
    if value in PRESET_MODELS:
        return value
    path = resolve_path(value, info)
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"{value!r} is neither a preset ({', '.join(PRESET_MODELS)}) "
                         f"nor a model directory with config.json ({path})")
    return path


class ModelSection(Section):
    """Which model every pool serves."""

    name: Annotated[str, AfterValidator(check_model_name)] = Field(
        "pydoc", description="Embedded model (pydoc: trained, the default; tiny, small: random "
        "weights) or a local Hugging Face-format model directory; relative paths are relative to "
        "the config file.")
    dtype: Literal["float32", "bfloat16", "auto"] = Field(
        "auto", description="Weight and KV dtype; auto = bfloat16 on CUDA, float32 on CPU.")
    attention: Literal["auto", "compiled", "eager", "flex", "flex-eager"] = Field(
        "auto", description="Attention kernels: compiled = decode through one Inductor kernel reading K/V "
        "through the block table (a few seconds to compile when a decode actor starts), prefill through "
        "SDPA; eager = gather + bmm; flex = prefill and decode through flex_attention over the paged cache "
        "(compiled, checked at start-up); flex-eager = flex's reference math (slow, for tests); "
        "auto = compiled on CPU, flex on CUDA.")
    weight_layout: Literal["auto", "row-major", "input-major", "onednn-packed", "onednn-packed+input-major"] = Field(
        "auto", description="How projection weights are stored and multiplied on CPU (engine/model/linear.py): "
        "auto = the layout measured fastest on the machine (it may keep a second, input-major copy of "
        "the weights for batch-1 decode, when that fits in 1/8 of RAM); onednn-packed = one packed copy "
        "(the least memory of the fast layouts); row-major / input-major = BLAS on the dense weight. "
        "GPUs always use row-major.")
    quantization: Quantization = Field("none", description=QUANTIZATION_HELP + " Pools may override it "
                                       "(pools.<pool>.quantization): the handoff carries KV, not weights.")
    quantization_group_size: QuantizationGroupSize = Field(
        128, description="int4: input channels per scale (32, 64 or 128; smaller groups: closer to the "
        "unquantized model, a few % more bytes).")
    quantize_lm_head: bool = Field(
        False, description="With quantization int8 / int4: quantize the LM head too (read whole every decode "
        "step; with a large vocabulary a large share of its bytes). The embedding stays in dtype.")
    tool_parser: Literal["auto", "hermes", "llama3_json", "none"] = Field(
        "auto", description="How the OpenAI API writes and reads tool calls (tools, tool_choice): hermes = "
        "{\"name\", \"arguments\"} objects in tool_call tags (Hermes, Qwen2.5, the default chat template); "
        "llama3_json = the reply is {\"name\", \"parameters\"} objects (Llama 3.1+); auto = from the chat "
        "template's text (hermes when it names neither); none = no tool calls (requests with tools need "
        "tool_choice none).")
    max_model_len: Optional[Int] = Field(
        None, gt=0, description="Longest prompt + output in tokens; default: the model's "
        "max_position_embeddings (with yarn RoPE: its original context × factor, when longer).")
