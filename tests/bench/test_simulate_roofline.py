"""`bench.simulate`: hardware files, model shapes and the roofline step-time model's formulas."""
from __future__ import annotations

import json

import pytest

from bench.simulate.hardware import Hardware, shipped
from bench.simulate.models import SHAPES, model_config
from bench.simulate.roofline import RooflineModel, attended_pairs
from bench.simulate.step_time import Chunk
from engine.cost_model import decode_weight_params
from engine.model.config import ModelConfig

H100 = Hardware.load("H100-SXM")
LLAMA_8B = model_config("llama-3-8b")


def roofline(hardware=H100, cfg=LLAMA_8B, **kw) -> RooflineModel:
    return RooflineModel(hardware, cfg, model_name="llama-3-8b", **kw)


def memory_s(model: RooflineModel, chunks) -> float:
    return model.rank_bytes(chunks) / (model.hardware.memory_bytes_per_s * model.hardware.memory_efficiency)


def compute_s(model: RooflineModel, chunks) -> float:
    hw = model.hardware
    return model.step_flops(chunks) / model.tensor_parallel / (hw.flops(model.dtype) * hw.compute_efficiency)


# -- hardware files -------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["A100-80GB", "H100-SXM", "H200", "L40S"])
def test_every_shipped_hardware_file_loads_with_its_sources(name):
    assert name in shipped()
    hw = Hardware.load(name.lower())                   # names are case-insensitive
    assert hw.name == name
    assert hw.flops("bf16") > 1e14 and hw.memory_bytes_per_s > 5e11 and hw.memory_bytes >= 48e9
    assert 0 < hw.compute_efficiency <= 1 and 0 < hw.memory_efficiency <= 1
    assert hw.sources and any(s.startswith("https://www.nvidia.com") or s.startswith("https://resources.nvidia")
                              for s in hw.sources)


def test_shipped_figures_are_the_datasheets_dense_ones():
    a100, h200, l40s = Hardware.load("a100-80gb"), Hardware.load("h200"), Hardware.load("l40s")
    assert a100.flops("bf16") == 312e12 and a100.memory_bytes_per_s == 2.039e12
    assert a100.intra_node_link_bytes_per_s == 300e9            # 600 GB/s counts both directions
    assert a100.peak_flops.fp8 is None
    with pytest.raises(ValueError, match="A100-80GB has no fp8"):
        a100.flops("fp8")
    assert H100.flops("bf16") == pytest.approx(989.4e12) and H100.flops("fp8") == pytest.approx(1978.9e12)
    assert H100.memory_bytes_per_s == 3.35e12 and H100.inter_node_link_bytes_per_s == 50e9
    assert h200.peak_flops == H100.peak_flops and h200.memory_bytes == 141e9 and h200.memory_bytes_per_s == 4.8e12
    assert l40s.flops("bf16") == pytest.approx(362.05e12) and l40s.flops("fp8") == 733e12
    assert l40s.memory_bytes == 48e9 and l40s.intra_node_link_bytes_per_s == 32e9   # PCIe Gen4 x16


def _write(tmp_path, text: str) -> str:
    path = tmp_path / "gpu.yaml"
    path.write_text(text)
    return str(path)


GOOD = """name: test-gpu
peak_flops: {bf16: 1.0e+14}
memory_bytes: 1.0e+10
memory_bytes_per_s: "1e12"
intra_node_link_bytes_per_s: 1.0e+11
inter_node_link_bytes_per_s: 1.0e+10
link_latency_s: 1.0e-5
compute_efficiency: 0.5
memory_efficiency: 0.5
step_overhead_s: 1.0e-4
"""


def test_a_hardware_file_by_path_loads_and_numbers_may_be_strings(tmp_path):
    hw = Hardware.load(_write(tmp_path, GOOD))
    assert hw.name == "test-gpu" and hw.memory_bytes_per_s == 1e12 and hw.sources == ()
    assert hw.peak_flops.bf16 == 1e14 and hw.peak_flops.fp16 is None


@pytest.mark.parametrize("text, named", [
    (GOOD + "memory_bandwith: 1.0e+12\n", "memory_bandwith"),
    (GOOD.replace("{bf16: 1.0e+14}", "{bf16: 1.0e+14, fp4: 2.0e+14}"), "peak_flops.fp4"),
    (GOOD.replace("link_latency_s: 1.0e-5\n", ""), "link_latency_s"),
    (GOOD.replace("compute_efficiency: 0.5", "compute_efficiency: 1.5"), "compute_efficiency"),
    (GOOD.replace("memory_bytes: 1.0e+10", "memory_bytes: lots"), "memory_bytes"),
    (GOOD + "sources: just one string\n", "sources"),
])
def test_a_bad_hardware_file_is_a_value_error_naming_its_key(tmp_path, text, named):
    with pytest.raises(ValueError, match=named):
        Hardware.load(_write(tmp_path, text))


def test_an_unknown_hardware_name_lists_the_shipped_ones():
    with pytest.raises(ValueError, match="'B200'.*A100-80GB, H100-SXM, H200, L40S"):
        Hardware.load("B200")


# -- model shapes ---------------------------------------------------------------------------------

def test_shape_presets_resolve_case_insensitively():
    assert (LLAMA_8B.hidden_size, LLAMA_8B.num_hidden_layers, LLAMA_8B.num_key_value_heads) == (4096, 32, 8)
    assert LLAMA_8B.num_params == pytest.approx(8.03e9, rel=0.01)
    big = model_config("Llama-3-70B")
    assert (big.hidden_size, big.intermediate_size, big.num_hidden_layers) == (8192, 28672, 80)
    assert big.num_params == pytest.approx(70.6e9, rel=0.01)
    assert model_config("llama-2-7b").num_params == pytest.approx(6.74e9, rel=0.01)
    assert model_config("llama-2-13b").num_params == pytest.approx(13.0e9, rel=0.01)
    assert set(SHAPES) == {"llama-3-8b", "llama-3-70b", "llama-2-7b", "llama-2-13b", "opt-13b", "opt-66b"}


def test_opt_is_its_llama_shaped_equivalent():
    opt = model_config("opt-13b")
    h = opt.hidden_size
    assert (h, opt.num_hidden_layers, opt.num_attention_heads, opt.num_key_value_heads) == (5120, 40, 40, 40)
    assert abs(3 * h * opt.intermediate_size - 2 * h * 4 * h) <= 12 * h     # two h·4h matrices, to a multiple of 8
    assert opt.intermediate_size % 8 == 0                                   # split by the degrees OPT's 4h is
    assert opt.num_params == pytest.approx(13e9, rel=0.03)
    assert model_config("opt-66b").num_params == pytest.approx(66e9, rel=0.03)


def test_pdserve_models_and_directories_resolve(tmp_path):
    pydoc = model_config("pydoc")
    assert (pydoc.hidden_size, pydoc.num_hidden_layers, pydoc.vocab_size) == (256, 4, 4096)
    (tmp_path / "config.json").write_text(json.dumps({**SHAPES["llama-2-7b"], "num_hidden_layers": 2}))
    assert model_config(str(tmp_path)).num_hidden_layers == 2


def test_an_unknown_model_lists_the_shipped_names():
    with pytest.raises(ValueError, match="'gpt-5'.*llama-3-8b.*opt-66b.*pydoc.*tiny"):
        model_config("gpt-5")


# -- the roofline ---------------------------------------------------------------------------------

def test_attended_pairs_are_causal():
    assert attended_pairs(Chunk(1, 700)) == 700                         # a decode row sees its whole context
    assert attended_pairs(Chunk(4, 4)) == 1 + 2 + 3 + 4                 # a fresh prompt: a triangle
    assert attended_pairs(Chunk(2, 10)) == 9 + 10                       # a chunk after 8 cached tokens


def test_decode_at_batch_1_is_memory_bound_on_the_weights():
    model, chunks = roofline(), [Chunk(1, 1024)]
    weight_bytes = decode_weight_params(LLAMA_8B) * 2
    assert model.weight_bytes == weight_bytes and 14.5e9 < weight_bytes < 16.5e9
    kv_bytes = (1024 + 1) * LLAMA_8B.kv_bytes_per_token(2)              # read 1024, write 1
    expected = (weight_bytes + kv_bytes) / (3.35e12 * H100.memory_efficiency) + H100.step_overhead_s
    assert compute_s(model, chunks) < 0.05 * memory_s(model, chunks)
    assert model.step_s(chunks) == pytest.approx(expected, rel=0.01)
    assert 5e-3 < model.step_s(chunks) < 7e-3


def test_a_long_prefill_is_compute_bound_and_scales_with_tokens():
    model = roofline()
    long, half = [Chunk(4096, 4096)], [Chunk(2048, 2048)]
    assert compute_s(model, long) > 5 * memory_s(model, long)
    flops = 2 * model.costs.layer_params * 4096 + 4 * 32 * 4096 * (4096 * 4097 // 2) + 2 * model.costs.head_params
    expected = flops / (H100.flops("bf16") * H100.compute_efficiency) + H100.step_overhead_s
    assert model.step_s(long) == pytest.approx(expected, rel=1e-9)
    ratio = (model.step_s(long) - H100.step_overhead_s) / (model.step_s(half) - H100.step_overhead_s)
    assert 2.0 < ratio < 2.2                                            # linear matmuls + a little attention


def test_tensor_parallel_halves_a_memory_bound_step_and_adds_the_all_reduces():
    one, two = roofline(), roofline(tensor_parallel=2)
    chunks = [Chunk(1, 1024)] * 4
    all_reduce = 2 * 32 * (2 * (2 - 1) / 2 * 4 * 4096 * 2 / 450e9 + 1e-5)   # 2 per layer, 4 rows of h bf16
    assert two.all_reduce_s(4) == pytest.approx(all_reduce, rel=1e-12)
    assert one.all_reduce_s(4) == 0.0
    overhead = H100.step_overhead_s
    assert two.step_s(chunks) == pytest.approx((one.step_s(chunks) - overhead) / 2 + overhead + all_reduce,
                                               rel=1e-12)
    assert two.name == "roofline: H100-SXM, llama-3-8b, tp=2"


def test_a_tensor_parallel_degree_must_split_the_heads():
    with pytest.raises(ValueError, match="tensor_parallel 3"):
        roofline(tensor_parallel=3)
    with pytest.raises(ValueError, match="no fp8"):
        roofline(hardware=Hardware.load("A100-80GB"), dtype="fp8")


def test_the_handoff_goes_over_the_network_by_default():
    assert roofline().link_s(1e9) == pytest.approx(1e-5 + 1e9 / 50e9)
    assert roofline(inter_node=False).link_s(1e9) == pytest.approx(1e-5 + 1e9 / 450e9)
    assert roofline(tensor_parallel=2).link_s(1e9) == pytest.approx(1e-5 + 1e9 / 100e9)   # each rank sends its heads


def test_kv_blocks_refuse_weights_that_do_not_fit():
    a100, big = Hardware.load("A100-80GB"), model_config("llama-3-70b")
    with pytest.raises(ValueError, match=r"141\.\d GB per GPU.*72\.0 GB"):
        RooflineModel(a100, big).kv_blocks(16)
    four = RooflineModel(a100, big, tensor_parallel=4)
    assert four.resident_weight_bytes == 2 * (decode_weight_params(big) + big.vocab_size * big.hidden_size)
    free = 80e9 * 0.9 - four.resident_weight_bytes / 4 - 1e9
    expected = int(free // (16 * big.kv_bytes_per_token(2) / 4))
    assert four.kv_blocks(16) == expected and expected > 10_000


def test_kv_blocks_count_the_cache_dtype():
    bf16, fp8 = roofline().kv_blocks(16), roofline(kv_dtype_bytes=1).kv_blocks(16)
    assert fp8 in (2 * bf16, 2 * bf16 + 1)
    assert roofline(kv_dtype_bytes=1).kv_bytes_per_token == 32 * 8 * 128 * 2
    opt = RooflineModel(H100, model_config("opt-13b"))                 # tied: the LM head is the embedding
    assert opt.resident_weight_bytes == opt.weight_bytes


# -- an actor's own storage and KV budget (`for_engine`) ------------------------------------------

def _engine(**overrides):
    from deploy.config import load_config
    from deploy.launcher import engine_args
    cfg = load_config(None, {"model.name": "pydoc", **overrides})
    return engine_args(cfg, "decode", cfg.model.name, LLAMA_8B), cfg.pool_kv_cache("decode")


def test_an_actors_cache_dtype_quantization_and_budget_come_from_its_engine_settings():
    base = roofline()
    assert base.for_engine(*_engine()) is base                        # the defaults: the model as it is
    fp8 = base.for_engine(*_engine(**{"kv_cache.dtype": "fp8"}))
    assert fp8.kv_bytes_per_token == base.kv_bytes_per_token // 2 and fp8.weight_bytes == base.weight_bytes
    assert fp8.kv_blocks(16) in (2 * base.kv_blocks(16), 2 * base.kv_blocks(16) + 1)
    costs = base.costs
    rest = base.weight_bytes - 2 * (costs.layer_params + costs.head_params)     # norms and the final norm, bf16
    int8 = base.for_engine(*_engine(**{"model.quantization": "int8"}))
    assert int8.weight_bytes == costs.layer_params * 1.0 + costs.head_params * 2 + rest
    int4 = base.for_engine(*_engine(**{"model.quantization": "int4", "model.quantize_lm_head": True,
                                       "model.quantization_group_size": 64}))
    assert int4.weight_bytes == pytest.approx((costs.layer_params + costs.head_params) * (0.5 + 4 / 64) + rest)
    decode = [Chunk(1, 512)] * 8
    assert int4.step_s(decode) < int8.step_s(decode) < base.step_s(decode)      # decode reads fewer bytes
    assert int4.step_flops(decode) == base.step_flops(decode)                   # weight-only: the same FLOPs
    assert int4.kv_blocks(16) > base.kv_blocks(16)                              # and the memory goes to KV
    assert base.for_engine(*_engine(**{"kv_cache.num_blocks": 50})).kv_blocks(16) == 50
    gib = base.for_engine(*_engine(**{"kv_cache.memory_gib": 1.0}))
    assert gib.kv_blocks(16) == (1 << 30) // (16 * base.kv_bytes_per_token)
    # the engine sizes memory_gib per actor over a whole block of the model, whatever the degree
    assert gib.at_degree("decode", 2).kv_blocks(16) == gib.kv_blocks(16)
    half = base.for_engine(*_engine(**{"kv_cache.memory_fraction": 0.5})).kv_blocks(16)
    assert half == int((80e9 * 0.5 - base.resident_weight_bytes - 1e9) // (16 * base.kv_bytes_per_token))
    with pytest.raises(ValueError, match="kv_cache.num_blocks: 10000000 KV blocks per actor do not fit"):
        base.for_engine(*_engine(**{"kv_cache.num_blocks": 10_000_000})).kv_blocks(16)


def test_a_4bit_checkpoint_is_priced_as_int4_and_not_split():
    gptq = ModelConfig.from_dict({**SHAPES["llama-3-8b"], "quantization_config": {
        "quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": False}})
    model = RooflineModel(H100, gptq)
    assert model.quantization == "int4" and model.weight_bytes < roofline().weight_bytes / 2.5
    with pytest.raises(ValueError, match="pools.decode.tensor_parallel 2: quantized projections"):
        model.at_degree("decode", 2)
